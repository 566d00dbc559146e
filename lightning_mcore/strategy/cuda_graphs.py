"""Checks on GPTConfig.cuda_graphs, pure: mcore asserts most of these inside every rank (or
fails at capture), so the strategy runs them before any process starts. Plus the one check that
needs the data: every captured step must see the first step's shapes."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from megatron.core.transformer.cuda_graphs import delete_cuda_graphs

from lightning_mcore.strategy.parallel import LayoutError

if TYPE_CHECKING:  # pragma: no cover
    from lightning_mcore.model.config import GPTConfig

GRAPH_MODULES = ("attn", "mlp", "moe_router", "moe_preprocess")


class CudaGraphError(LayoutError):
    what = "CUDA graph setting"


def validate_cuda_graphs(model: "GPTConfig", accelerator: str) -> None:
    """Raise CudaGraphError naming the problem and the fix; None when the capture can work."""
    modules = model.cuda_graphs
    if modules is None:
        return
    key = f"cuda_graphs={list(modules)!r}"
    if accelerator != "gpu":
        raise CudaGraphError(f"{key} needs a GPU (CUDA graphs); on CPU leave cuda_graphs unset.",
                             fields=("cuda_graphs",), accelerator=True)
    unknown = sorted(set(modules) - set(GRAPH_MODULES))
    if unknown:
        raise CudaGraphError(f"{key}: unknown part(s) {unknown}; choose from {list(GRAPH_MODULES)} "
                             f"([] captures whole dense layers).", fields=("cuda_graphs",))
    moe_layers = [i for i in range(model.num_layers) if model.is_moe_layer(i)]
    if {"moe_router", "moe_preprocess"} & set(modules) and not moe_layers:
        raise CudaGraphError(f"{key}: moe_router/moe_preprocess need MoE layers (num_moe_experts); "
                             f"use 'attn' and 'mlp'.", fields=("cuda_graphs", "num_moe_experts"))
    if "moe_preprocess" in modules and "moe_router" not in modules:
        raise CudaGraphError(f"{key}: moe_preprocess is captured with moe_router only; add 'moe_router'.",
                             fields=("cuda_graphs",))
    if moe_layers and (not modules or ("mlp" in modules and len(moe_layers) == model.num_layers)):
        # dropless MoE sizes its expert GEMMs on the host from each step's routing
        raise CudaGraphError(f"{key}: the MoE layers cannot be captured whole (their expert GEMMs are "
                             f"sized from each step's routing); list 'attn', 'moe_router', "
                             f"'moe_preprocess' (and 'mlp' for dense layers only).", fields=("cuda_graphs",))
    if model.recompute_granularity == "full":
        raise CudaGraphError(f"{key} cannot replay a layer that recompute_granularity='full' recomputes; "
                             f"use 'selective' or no recompute.",
                             fields=("cuda_graphs", "recompute_granularity"))
    if model.activation_offload_layers:
        raise CudaGraphError(f"{key} does not work with activation_offload_layers="
                             f"{model.activation_offload_layers} (mcore); set one of them off.",
                             fields=("cuda_graphs", "activation_offload_layers"))


def validate_graphed_module(model: "GPTConfig", module: str, packed: bool) -> None:
    """Graphs replay the captured steps' inputs' layout: a module whose microbatches are packed
    THD rows (`packed`: SFT, DPO, GRPO, ...) changes its sequence boundaries every step, and its
    reference, teacher or rollout forwards run outside the captured schedule."""
    if model.cuda_graphs is not None and packed:
        raise CudaGraphError(
            f"cuda_graphs={list(model.cuda_graphs)!r} with {module}: its microbatches are packed rows "
            f"whose sequence boundaries change every step, which a replayed graph would keep from the "
            f"capture; leave cuda_graphs unset (graphs suit fixed rows, as PretrainModule's).",
            fields=("cuda_graphs",))


def graph_safe_rng(model: Optional["GPTConfig"], use_te: bool) -> dict:
    """model_parallel_cuda_manual_seed's tracker arguments: a capture must replay the RNG, and
    Transformer Engine's attention accepts only its own tracker inside a capture."""
    graphs = model is not None and model.cuda_graphs is not None
    return {"te_rng_tracker": graphs and use_te, "use_cudagraphable_rng": graphs and not use_te}


def check_graph_shape(model: "GPTConfig", first: Optional[tuple], shape: tuple) -> tuple:
    """The shape every step must keep once graphs are captured (`first`); returns it. A replay
    with other shapes would compute on the captured buffers' sizes, so it is refused."""
    if first is not None and tuple(shape) != tuple(first):
        raise ValueError(
            f"cuda_graphs={model.cuda_graphs!r}: this training batch has shape {tuple(shape)}, the "
            f"captured steps {tuple(first)}. CUDA graphs replay one shape: pad every batch to the "
            f"same length (e.g. to seq_length) or leave cuda_graphs unset.")
    return tuple(shape)


def release_captured_graphs() -> None:
    """Give back what a fit's captures hold: mcore keeps the graphs, their memory pool and the
    flag that they exist in process globals. A second graphed fit in the same process (a notebook,
    a test session) would otherwise look up the first model's graphs and stop with mcore's
    "no matching cudagraph runners", and the first fit's pool would stay allocated."""
    delete_cuda_graphs()
