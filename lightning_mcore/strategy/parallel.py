"""The parallel layout and every check on it, as pure functions.

Nothing here touches torch.distributed: the strategy calls `validate_layout` before any
process group or model exists, and tests call it directly.

Rank layout (mcore order "tp-cp-ep-dp-pp"): with world size W = tp * cp * dp * pp,
tensor-parallel ranks are adjacent, pipeline stages are the slowest-varying dimension:

    W=8, tp=2, pp=2 -> dp=2     stage 0: [0 1] [2 3]    stage 1: [4 5] [6 7]
                                          tp pair  tp pair (the pairs are the dp replicas)
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:  # pragma: no cover
    from lightning_mcore.model.config import GPTConfig


class LayoutError(ValueError):
    """A parallel layout, batch size or model shape that cannot work together.

    It also says which settings are involved, so that a front end (the CLI) can point at
    them: `options` (MegatronStrategy arguments), `fields` (model config fields), `devices`
    (the world size, devices x num_nodes), `accelerator` and `optimizer` (the module's
    OptimizerSettings.optimizer)."""

    what = "parallel layout"  # what the CLI calls invalid

    def __init__(self, message: str, options: tuple = (), fields: tuple = (),
                 devices: bool = False, accelerator: bool = False, optimizer: bool = False) -> None:
        super().__init__(message)
        self.options, self.fields = tuple(options), tuple(fields)
        self.devices, self.accelerator, self.optimizer = devices, accelerator, optimizer


@dataclass(frozen=True)
class ParallelConfig:
    """Megatron's parallel sizes, under Megatron's names."""

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: Optional[int] = None
    context_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: Optional[int] = None
    sequence_parallel: bool = False
    use_distributed_optimizer: Optional[bool] = False  # None: the strategy picks per device
    overlap_grad_reduce: Optional[bool] = False
    overlap_param_gather: bool = False

    def sizes(self) -> dict:
        """The six sizes under the keyword names that both mcore's initialize_model_parallel
        and TransformerConfig take."""
        names = ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                 "virtual_pipeline_model_parallel_size", "context_parallel_size",
                 "expert_model_parallel_size", "expert_tensor_parallel_size")
        return {n: getattr(self, n) for n in names}

    @property
    def model_parallel_size(self) -> int:
        return (
            self.tensor_model_parallel_size
            * self.pipeline_model_parallel_size
            * self.context_parallel_size
        )

    def data_parallel_size(self, world_size: int) -> int:
        return world_size // self.model_parallel_size

    @property
    def virtual_stages(self) -> int:
        return self.virtual_pipeline_model_parallel_size or 1


@dataclass(frozen=True)
class BatchConfig:
    """Global batch (samples per optimizer step, all ranks) and micro batch (per forward)."""

    global_batch_size: int
    micro_batch_size: int = 1

    def num_microbatches(self, data_parallel_size: int) -> int:
        return self.global_batch_size // (self.micro_batch_size * data_parallel_size)


def resolve_fast_path(parallel: ParallelConfig, on_gpu: bool, optimizer: Optional[str] = None) -> ParallelConfig:
    """Fill the options left at None with the device's fast path: on GPU the distributed
    optimizer and overlapped grad reduce, on CPU neither. mcore's distributed optimizer
    shards Adam's state only, so another optimizer (`optimizer`, e.g. "sgd") keeps the plain one."""
    distributed, overlap = parallel.use_distributed_optimizer, parallel.overlap_grad_reduce
    return replace(
        parallel,
        use_distributed_optimizer=on_gpu and optimizer in (None, "adam") if distributed is None else distributed,
        overlap_grad_reduce=on_gpu if overlap is None else overlap,
    )


def validate_layout(
    world_size: int,
    parallel: ParallelConfig,
    batch: Optional[BatchConfig] = None,
    model: Optional["GPTConfig"] = None,
    accelerator: str = "cpu",
    use_te: bool = False,
    optimizer: Optional[str] = None,
) -> None:
    """Raise LayoutError naming the problem and the fix; return None when the layout works.
    `optimizer` is the module's OptimizerSettings.optimizer, where known."""
    p = parallel
    tp, pp, cp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.context_parallel_size
    ep = p.expert_model_parallel_size
    for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                 "context_parallel_size", "expert_model_parallel_size"):
        if getattr(p, name) < 1:
            raise LayoutError(f"{name}={getattr(p, name)} must be >= 1.", options=(name,))
    if world_size % p.model_parallel_size:
        raise LayoutError(
            f"world size {world_size} is not divisible by tensor_model_parallel_size ({tp}) x "
            f"pipeline_model_parallel_size ({pp}) x context_parallel_size ({cp}) = "
            f"{p.model_parallel_size}. Use devices x num_nodes that is a multiple of "
            f"{p.model_parallel_size}, or change the parallel sizes.",
            options=("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size"),
            devices=True,
        )
    dp = p.data_parallel_size(world_size)
    if p.sequence_parallel and tp == 1:
        raise LayoutError(
            "sequence_parallel=True needs tensor_model_parallel_size > 1 (it splits the "
            "sequence across tensor-parallel ranks). Set tensor_model_parallel_size >= 2 or "
            "sequence_parallel=False.",
            options=("sequence_parallel", "tensor_model_parallel_size"),
        )
    vpp = p.virtual_pipeline_model_parallel_size
    if vpp is not None and (vpp < 1 or pp == 1):
        raise LayoutError(
            f"virtual_pipeline_model_parallel_size={vpp} needs pipeline_model_parallel_size > 1 "
            f"(got {pp}). Set pipeline_model_parallel_size >= 2 or leave the virtual size unset.",
            options=("virtual_pipeline_model_parallel_size", "pipeline_model_parallel_size"),
        )
    etp = p.expert_tensor_parallel_size or tp
    if ep > 1 and (world_size // pp) % (ep * etp):
        raise LayoutError(
            f"expert_model_parallel_size ({ep}) x expert_tensor_parallel_size ({etp}) must divide "
            f"the ranks of one pipeline stage ({world_size // pp}).",
            options=("expert_model_parallel_size", "expert_tensor_parallel_size", "pipeline_model_parallel_size"),
            devices=True,
        )
    if p.overlap_param_gather and not p.use_distributed_optimizer:
        raise LayoutError("overlap_param_gather=True needs use_distributed_optimizer=True.",
                          options=("overlap_param_gather", "use_distributed_optimizer"))
    if p.use_distributed_optimizer and optimizer not in (None, "adam"):
        raise LayoutError(
            f"use_distributed_optimizer=True cannot run optimizer={optimizer!r}: mcore's distributed "
            f"optimizer shards Adam's state only. Use optimizer='adam', or "
            f"use_distributed_optimizer=False (or leave it unset: it is then off for {optimizer!r}).",
            options=("use_distributed_optimizer",), optimizer=True,
        )
    if accelerator == "cpu" and use_te:
        raise LayoutError(
            "Transformer Engine layers need a CUDA GPU; on accelerator='cpu' use the local "
            "layer spec (transformer_impl='local' in the model config).",
            fields=("transformer_impl",), accelerator=True,
        )

    if batch is not None:
        if batch.micro_batch_size < 1 or batch.global_batch_size < 1:
            raise LayoutError("global_batch_size and micro_batch_size must be >= 1.",
                              options=("global_batch_size", "micro_batch_size"))
        if batch.global_batch_size % (batch.micro_batch_size * dp):
            raise LayoutError(
                f"global_batch_size ({batch.global_batch_size}) is not divisible by "
                f"micro_batch_size ({batch.micro_batch_size}) x data-parallel size ({dp}) = "
                f"{batch.micro_batch_size * dp}. Pick a global batch that is a multiple of it.",
                options=("global_batch_size", "micro_batch_size"), devices=True,
            )
        if vpp and pp > 1 and batch.num_microbatches(dp) % pp:
            raise LayoutError(
                f"virtual_pipeline_model_parallel_size={vpp} (interleaved pipeline) needs the number "
                f"of microbatches ({batch.num_microbatches(dp)}) to be a multiple of pipeline_model_parallel_size "
                f"({pp}). Raise global_batch_size or lower micro_batch_size.",
                options=("virtual_pipeline_model_parallel_size", "pipeline_model_parallel_size",
                         "global_batch_size", "micro_batch_size"),
            )

    if model is not None:
        _validate_model(p, model, world_size)
        if model.fp8 and not use_te:
            raise LayoutError(
                f"fp8={model.fp8!r} needs Transformer Engine layers on a GPU (Hopper or newer); "
                f"set fp8=None on this device.",
                fields=("fp8",), accelerator=True,
            )
        if cp > 1 and not use_te:
            raise LayoutError(
                f"context_parallel_size={cp} needs Transformer Engine attention (ring attention "
                f"over the cp group): run on GPU with transformer_impl 'auto' or "
                f"'transformer_engine', or set context_parallel_size=1.",
                options=("context_parallel_size",), fields=("transformer_impl",), accelerator=True,
            )


def _validate_model(p: ParallelConfig, model: "GPTConfig", world_size: int) -> None:
    tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
    groups = model.num_query_groups or model.num_attention_heads
    if model.num_attention_heads % tp:
        raise LayoutError(
            f"num_attention_heads ({model.num_attention_heads}) is not divisible by "
            f"tensor_model_parallel_size ({tp}). Use a tensor-parallel size that divides it.",
            options=("tensor_model_parallel_size",), fields=("num_attention_heads",),
        )
    if groups % tp:
        raise LayoutError(
            f"num_query_groups ({groups}, the key/value heads; num_key_value_heads in a Hugging "
            f"Face config.json) is not divisible by "
            f"tensor_model_parallel_size ({tp}). Use a tensor-parallel size that divides it.",
            options=("tensor_model_parallel_size",), fields=("num_query_groups",),
        )
    _validate_widths(p, model)
    stages = pp * p.virtual_stages
    if model.num_layers % stages:
        what = f"pipeline_model_parallel_size ({pp})"
        if p.virtual_pipeline_model_parallel_size:
            what += f" x virtual_pipeline_model_parallel_size ({p.virtual_stages}) = {stages}"
        raise LayoutError(
            f"num_layers ({model.num_layers}) is not divisible by {what}: every (virtual) "
            f"pipeline stage needs the same number of layers.",
            options=("pipeline_model_parallel_size",)
            + (("virtual_pipeline_model_parallel_size",) if p.virtual_pipeline_model_parallel_size else ()),
            fields=("num_layers",),
        )
    etp = p.expert_tensor_parallel_size or tp
    if model.num_moe_experts and model.add_bias_linear and etp > 1:
        raise LayoutError(
            f"experts with biases (add_bias_linear) are computed by mcore at expert tensor-parallel "
            f"size 1 only; got {etp}"
            + ("" if p.expert_tensor_parallel_size else " (it defaults to tensor_model_parallel_size)")
            + ". Set expert_tensor_parallel_size=1 (experts split over expert_model_parallel_size instead).",
            options=("expert_tensor_parallel_size", "tensor_model_parallel_size"), fields=("add_bias_linear",))
    ep = p.expert_model_parallel_size
    if ep > 1 and not model.num_moe_experts:
        raise LayoutError(
            f"expert_model_parallel_size={ep} needs a MoE model (num_moe_experts is not set).",
            options=("expert_model_parallel_size",), fields=("num_moe_experts",),
        )
    if model.num_moe_experts and model.num_moe_experts % ep:
        raise LayoutError(
            f"expert_model_parallel_size ({ep}) does not divide num_moe_experts "
            f"({model.num_moe_experts}). Use an expert-parallel size that divides it.",
            options=("expert_model_parallel_size",), fields=("num_moe_experts",),
        )
    if model.num_moe_experts and tp > 1 and not p.sequence_parallel:
        # mcore's MoELayer raises this in its first training forward, inside every rank.
        raise LayoutError(
            f"a MoE model (num_moe_experts={model.num_moe_experts}) with "
            f"tensor_model_parallel_size={tp} needs sequence_parallel=True (mcore's MoE layer "
            f"refuses tensor parallelism without it). Set sequence_parallel=True, or "
            f"tensor_model_parallel_size=1 (expert_model_parallel_size splits the experts).",
            options=("sequence_parallel", "tensor_model_parallel_size"), fields=("num_moe_experts",),
        )
    if p.context_parallel_size > 1 and model.seq_length % (2 * p.context_parallel_size):
        raise LayoutError(
            f"seq_length ({model.seq_length}) must be divisible by 2 x context_parallel_size "
            f"({2 * p.context_parallel_size}) for load-balanced context parallelism.",
            options=("context_parallel_size",), fields=("seq_length",),
        )
    if p.context_parallel_size > 1 and model.uses_sliding_window():
        # Transformer Engine's ring attention (mcore's cp_comm_type "p2p") asserts in every rank.
        raise LayoutError(
            f"context_parallel_size={p.context_parallel_size} with sliding-window attention "
            f"(sliding_window={model.sliding_window} < seq_length={model.seq_length}) is not "
            f"supported. Use context_parallel_size=1, or seq_length <= {model.sliding_window}.",
            options=("context_parallel_size",), fields=("sliding_window", "seq_length"),
        )
    if model.linear_attention is not None:
        _validate_linear_attention(p, model)
    if p.sequence_parallel and model.seq_length % tp:
        raise LayoutError(
            f"sequence_parallel splits seq_length ({model.seq_length}) over "
            f"tensor_model_parallel_size ({tp}); make it divisible.",
            options=("sequence_parallel", "tensor_model_parallel_size"), fields=("seq_length",),
        )


def _validate_linear_attention(p: ParallelConfig, model: "GPTConfig") -> None:
    """Gated DeltaNet layers (model/gated_delta_net.py) split their key and value heads over
    tensor-parallel ranks; their output norm (one weight per value-head dimension, on every
    rank) then gets a share of its gradient on each rank, which mcore sums over TP only for
    sequence-parallel weights. Context parallelism would need the recurrence passed between
    ranks, which this torch implementation does not do."""
    la, tp, cp = model.linear_attention, p.tensor_model_parallel_size, p.context_parallel_size
    for heads, field in ((la.num_key_heads, "num_key_heads"), (la.num_value_heads, "num_value_heads")):
        if heads % tp:
            raise LayoutError(
                f"linear_attention.{field} ({heads}; linear_{field} in a Hugging Face config.json) "
                f"is not divisible by tensor_model_parallel_size ({tp}). Use a tensor-parallel size "
                f"that divides it.", options=("tensor_model_parallel_size",), fields=("linear_attention",))
    if tp > 1 and not p.sequence_parallel:
        raise LayoutError(
            f"a model with linear-attention layers at tensor_model_parallel_size={tp} needs "
            f"sequence_parallel=True (their output norm's gradient is summed over tensor-parallel "
            f"ranks only then). Set sequence_parallel=True.",
            options=("sequence_parallel", "tensor_model_parallel_size"), fields=("linear_attention",))
    if cp > 1:
        raise LayoutError(
            f"context_parallel_size={cp} is not supported for models with linear-attention layers "
            f"(the recurrent state would have to pass between ranks). Use context_parallel_size=1.",
            options=("context_parallel_size",), fields=("linear_attention",))


def _validate_widths(p: ParallelConfig, model: "GPTConfig") -> None:
    """Each tensor-parallel rank computes an equal share of every MLP: mcore's linears assert
    that the width divides, in every rank while the model is built. Dense MLP layers and shared
    experts are split over tensor_model_parallel_size, routed experts (SequentialMLP, TE's and
    torch's grouped experts) over expert_tensor_parallel_size, which defaults to it. (mcore's
    legacy GroupedMLP asserts only on width x local experts when built, then fails in its first
    forward on the same rule.)"""
    tp = p.tensor_model_parallel_size
    dense = any(not model.is_moe_layer(layer) for layer in range(model.num_layers))
    if dense and model.ffn_hidden_size % tp:
        raise LayoutError(
            f"ffn_hidden_size ({model.ffn_hidden_size}) is not divisible by tensor_model_parallel_size "
            f"({tp}): each tensor-parallel rank computes an equal share of the MLP width "
            f"(intermediate_size in a Hugging Face config.json). Use a tensor-parallel size that "
            f"divides it.",
            options=("tensor_model_parallel_size",), fields=("ffn_hidden_size",),
        )
    if not model.num_moe_experts:
        return
    etp_option = "expert_tensor_parallel_size" if p.expert_tensor_parallel_size else "tensor_model_parallel_size"
    etp = p.expert_tensor_parallel_size or tp
    field = "moe_ffn_hidden_size" if model.moe_ffn_hidden_size else "ffn_hidden_size"
    width = getattr(model, field)
    if width % etp:
        raise LayoutError(
            f"{field} ({width}) is not divisible by {etp_option} ({etp}): each expert-tensor-parallel "
            f"rank computes an equal share of every routed expert's width. Set "
            f"expert_tensor_parallel_size (default: tensor_model_parallel_size) to a size that divides it.",
            options=(etp_option,), fields=(field,),
        )
    shared = model.moe_shared_expert_intermediate_size
    if shared and shared % tp:
        raise LayoutError(
            f"moe_shared_expert_intermediate_size ({shared}) is not divisible by "
            f"tensor_model_parallel_size ({tp}): each tensor-parallel rank computes an equal share "
            f"of the shared experts' width. Use a tensor-parallel size that divides it.",
            options=("tensor_model_parallel_size",), fields=("moe_shared_expert_intermediate_size",),
        )


def context_parallel_slice(batch: dict, cp_size: int, cp_rank: int) -> dict:
    """This cp rank's part of every [rows, seq] tensor: the sequence is cut into 2*cp chunks
    and rank r keeps chunks r and 2cp-1-r, so causal attention work is balanced (the layout
    mcore's and Transformer Engine's context-parallel attention expect).

        cp=2, chunks [c0 c1 c2 c3]:   rank 0 -> [c0 c3],  rank 1 -> [c1 c2]
    """
    if cp_size == 1:
        return batch
    out = {}
    for key, value in batch.items():
        rows, seq = value.shape[:2]
        if seq % (2 * cp_size):
            raise LayoutError(f"{key}: sequence length {seq} is not divisible by 2 x context_parallel_size "
                              f"({2 * cp_size}).")
        chunks = value.reshape(rows, 2 * cp_size, seq // (2 * cp_size), *value.shape[2:])
        mine = chunks[:, [cp_rank, 2 * cp_size - 1 - cp_rank]]
        out[key] = mine.reshape(rows, -1, *value.shape[2:])
    return out
