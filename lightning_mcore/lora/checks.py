"""LoRA settings that cannot work with the model or the parallel layout, as pure functions.

The strategy runs `check_lora_plan` before any process group or model exists (validate_module),
so a mistake ends with one error naming its settings instead of a traceback from every rank.
apply_lora (lora/adapters.py) keeps the same checks on the built modules, as a second line.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Optional

from lightning_mcore.lora.config import LoRAConfig, LoRAError, adapts_experts, resolve_targets
from lightning_mcore.lora.quantized_base import CODECS

if TYPE_CHECKING:  # pragma: no cover
    from lightning_mcore.model.config import GPTConfig


class LoRAPlanError(LoRAError):
    """A LoRA setting that cannot apply to this model or layout. Like strategy/parallel.py's
    LayoutError it names the settings involved, for a front end (the CLI) to point at: `lora`
    (LoRAConfig fields), `fields` (model config fields), `options` (MegatronStrategy arguments)."""

    devices = accelerator = optimizer = False  # read by the CLI's key naming, as LayoutError's

    def __init__(self, message: str, lora: tuple = (), fields: tuple = (), options: tuple = ()) -> None:
        super().__init__(message)
        self.lora, self.fields, self.options = tuple(lora), tuple(fields), tuple(options)


def check_lora_plan(lora: LoRAConfig, model: "GPTConfig", uses_te: bool = False, tp: int = 1,
                    etp: Optional[int] = None) -> None:
    """Raise LoRAPlanError naming the settings and the fix; return None when `lora` applies.
    `uses_te`: whether the model is built with Transformer Engine's layers; `tp`, `etp`: the
    tensor- and expert-tensor-parallel sizes, which split row-parallel inputs (an NF4 or MXFP4
    block must not straddle a shard). (Any expert-TP size applies to the adapters: they shard over it like
    the expert linears.)"""
    if lora.experts and not model.num_moe_experts:
        raise LoRAPlanError(
            "LoRA experts=True, but the model has no MoE experts (num_moe_experts is not set): "
            "leave lora.experts unset (or False).", lora=("experts",), fields=("num_moe_experts",))
    if lora.base_precision != "bf16" and uses_te:
        raise LoRAPlanError(
            f"LoRA base_precision={lora.base_precision!r} runs on mcore's local layers (and torch's "
            "grouped experts) only so far; this model is built with Transformer Engine's layers: set "
            "the model's transformer_impl='local', or lora.base_precision='bf16'.",
            lora=("base_precision",), fields=("transformer_impl",))
    if block_of(lora.base_precision):
        check_block_widths(lora, model, tp, etp or tp)
    if not adapts_experts(lora, model):
        return
    refuse_grouped_gemm_experts(lora, model, uses_te)
    check_expert_rank(lora, model)


def check_expert_rank(lora: LoRAConfig, model: "GPTConfig") -> None:
    """An expert adapter's rank is at most the smaller side of the expert's linears (hidden
    size and expert FFN size): beyond that B A has no more rank to give, only parameters."""
    ffn = model.moe_ffn_hidden_size or model.ffn_hidden_size
    smallest = min(model.hidden_size, ffn)
    if lora.rank > smallest:
        raise LoRAPlanError(
            f"LoRA rank {lora.rank} is larger than the expert linears (hidden_size="
            f"{model.hidden_size}, moe_ffn_hidden_size={ffn}): use lora.rank <= {smallest}, or "
            f"lora.experts=False to keep experts frozen.",
            lora=("rank", "experts"), fields=("hidden_size", "moe_ffn_hidden_size"))


def expert_backend_for_lora(lora: Optional[LoRAConfig], model: "GPTConfig") -> "GPTConfig":
    """`model` for `lora` adapting routed experts with a rank torch's grouped GEMMs cannot take
    (not a multiple of 8): with moe_grouped_gemm=None (the default) the SequentialMLP, which takes
    any rank; with moe_grouped_gemm=True backend 'auto' resolved to 'te'. Otherwise 'auto' stays
    torch's where it runs, 2.6-4.7x TE's for LoRA on one H100 (benchmarks/RESULTS.md, session 9)."""
    if (lora is None or model.moe_grouped_gemm_backend != "auto" or not adapts_experts(lora, model)
            or lora.rank % 8 == 0):
        return model
    if model.moe_grouped_gemm is None:
        return dataclasses.replace(model, moe_grouped_gemm=False)
    return dataclasses.replace(model, moe_grouped_gemm_backend="te")


def refuse_grouped_gemm_experts(lora: LoRAConfig, model: "GPTConfig", uses_te: bool) -> None:
    """Grouped-GEMM experts take adapters as torch's grouped experts (model/torch_experts.py:
    two more grouped GEMMs per linear) or Transformer Engine's (TEGroupedMLP, one linear per fc
    with a weight per expert) build them; without either, mcore's legacy GroupedMLP has bare
    weight tensors and no linear to hook."""
    if model.torch_experts:
        if lora.rank % 8:
            raise LoRAPlanError(
                f"LoRA rank {lora.rank} on torch's grouped experts (moe_grouped_gemm_backend="
                f"{model.moe_grouped_gemm_backend!r}): its grouped GEMMs need a rank that is a "
                f"multiple of 8 (16-byte rows on the GPU): use lora.rank {8 * (lora.rank // 8 + 1)}, "
                f"or moe_grouped_gemm_backend='te'.", lora=("rank",), fields=("moe_grouped_gemm_backend",))
        return
    if (model.grouped_experts or model.extra.get("moe_grouped_gemm")) and not uses_te:
        raise LoRAPlanError(
            "LoRA on grouped-GEMM experts (moe_grouped_gemm=True) needs torch's grouped experts "
            "(moe_grouped_gemm_backend='torch') or Transformer Engine's (GPU); mcore's legacy "
            "GroupedMLP has no expert linears to adapt: set moe_grouped_gemm_backend='torch', "
            "moe_grouped_gemm=False, or lora.experts=False to keep experts frozen.",
            lora=("experts",), fields=("moe_grouped_gemm", "moe_grouped_gemm_backend"))


def block_of(base_precision: str) -> Optional[int]:
    """The inputs one scale covers in a base precision quantized by blocks (nf4: 64, mxfp4: 32),
    else None (bf16, and fp8's scale per whole row)."""
    codec = CODECS.get(base_precision)
    return codec.block if codec else None


def check_block_widths(lora: LoRAConfig, model: "GPTConfig", tp: int = 1, etp: int = 1) -> None:
    """NF4 and MXFP4 quantize blocks of inputs within a row (lora/nf4.py: 64, lora/mxfp4.py: 32): a
    targeted linear whose input width, or whose row-parallel shard's (its width / TP, experts:
    / expert-TP), is not whole blocks is refused here, before launch. (The linears of
    multi-latent attention are refused where the base is quantized, naming the layer:
    lora/adapters.py.)"""
    block, name = block_of(lora.base_precision), lora.base_precision
    targets = resolve_targets(lora.target_modules)
    widths = []  # (the linear, its input width, the model field that sets it, the shards of its inputs)
    if "linear_qkv" in targets or "linear_fc1" in targets:
        widths.append(("linear_qkv/linear_fc1", model.hidden_size, "hidden_size", 1))
    if "linear_proj" in targets and model.mla is None:
        widths.append(("linear_proj", model.num_attention_heads * model.head_dim, "kv_channels", tp))
    if "linear_fc2" in targets:
        if any(not model.is_moe_layer(layer) for layer in range(model.num_layers)):
            widths.append(("linear_fc2", model.ffn_hidden_size, "ffn_hidden_size", tp))
        if model.moe_shared_expert_intermediate_size:
            widths.append(("shared_experts.linear_fc2", model.moe_shared_expert_intermediate_size,
                           "moe_shared_expert_intermediate_size", tp))
        if adapts_experts(lora, model):
            widths.append(("experts' linear_fc2", model.moe_ffn_hidden_size or model.ffn_hidden_size,
                           "moe_ffn_hidden_size", etp))
    for linear, width, field, shards in widths:
        if width % block:
            raise LoRAPlanError(
                f"LoRA base_precision={name!r} quantizes blocks of {block} inputs, but {linear} has {width} "
                f"inputs ({field}), not a multiple of {block}: leave it out of lora.target_modules, "
                f"or use lora.base_precision='fp8'.", lora=("base_precision", "target_modules"), fields=(field,))
        if width // shards % block:
            option = "expert_tensor_parallel_size" if shards == etp and linear.startswith("experts") \
                else "tensor_model_parallel_size"
            raise LoRAPlanError(
                f"LoRA base_precision={name!r} quantizes blocks of {block} inputs, but {linear}'s {width} inputs "
                f"({field}) split over {shards} tensor-parallel ranks leave {width // shards} per rank, not a "
                f"multiple of {block}: choose a {option} that leaves whole blocks, leave {linear} out of "
                f"lora.target_modules, or use lora.base_precision='fp8'.",
                lora=("base_precision", "target_modules"), fields=(field,), options=(option,))
