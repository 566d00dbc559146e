"""LoRA's settings: which linears it adapts (mcore's names and the HF names they fuse), its rank
and scale, and the errors of a setting that names nothing adaptable. Plain Python, no torch or
mcore: the CLI and the strategy's checks read it before any model exists (the adapters
themselves: lora/adapters.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Optional, Union

# mcore module name -> (parallel kind, the HF names it fuses)
TARGETS = {
    "linear_qkv": ("column", ("q_proj", "k_proj", "v_proj")),
    "linear_proj": ("row", ("o_proj",)),
    "linear_fc1": ("column", ("gate_proj", "up_proj")),
    "linear_fc2": ("row", ("down_proj",)),
    # multi-latent attention (DeepSeek); its q_proj (no q_lora_rank) is "linear_q_proj" by name
    "linear_q_proj": ("column", ("q_proj",)),
    "linear_q_down_proj": ("column", ("q_a_proj",)),
    "linear_q_up_proj": ("column", ("q_b_proj",)),
    "linear_kv_down_proj": ("column", ("kv_a_proj_with_mqa",)),
    "linear_kv_up_proj": ("column", ("kv_b_proj",)),
    # linear attention (Gated DeltaNet; Qwen3.5's HF names: Qwen3-Next fuses them as
    # in_proj_qkvz and in_proj_ba, which the export writes)
    "in_proj": ("column", ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")),
    "out_proj": ("row", ("out_proj",)),
}


def _hf_to_mcore() -> dict[str, str]:
    """An HF name's module: the first in TARGETS that has it (q_proj: linear_qkv)."""
    out: dict[str, str] = {}
    for name, (_, hfs) in TARGETS.items():
        for hf in hfs:
            out.setdefault(hf, name)
    return out


HF_TO_MCORE = _hf_to_mcore()
EXPERT_TARGETS = ("linear_fc1", "linear_fc2")  # the linears of each routed expert


class LoRAError(ValueError):
    """A LoRA configuration that cannot apply to the model."""


@dataclass(frozen=True)
class LoRAConfig:
    """LoRA: low-rank adapters trained on chosen linear layers while their base weights stay
    frozen (a module's `lora`).

    `target_modules`: "all-linear", or mcore names (linear_qkv, linear_proj, linear_fc1,
    linear_fc2; MLA: linear_q_proj, linear_q_down_proj, ...) and/or HF names (q_proj, ...,
    down_proj, q_a_proj, ...; fused ones come together)."""

    target_modules: Union[str, tuple[str, ...], list[str]] = "all-linear"
    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    use_rslora: bool = False
    # MoE routed experts: None adapts them when the targets name their linears (linear_fc1/fc2,
    # gate/up/down_proj, all-linear); False keeps them frozen; True requires it (an error if
    # the targets name no expert linear).
    experts: Optional[bool] = None
    # The frozen base weights LoRA adapts: "bf16" (the model's dtype, as loaded), "fp8" (FP8
    # e4m3 codes with one scale per output row), "nf4" (QLoRA's 4-bit NormalFloat codes, an
    # absmax scale per 64 inputs) or "mxfp4" (OCP MXFP4: E2M1 codes, a power-of-two scale per 32
    # inputs; GPT-OSS's published experts keep their values exactly), dequantized per call:
    # lora/quantized_base.py, lora/nf4.py, lora/mxfp4.py.
    base_precision: Literal["bf16", "fp8", "nf4", "mxfp4"] = "bf16"
    # How an FP8 base's forward multiplies: "bf16" (dequantized into the model's dtype per call; the
    # values are exactly the codes') or "fp8" (FP8 GEMMs on the codes, the input rounded to e4m3
    # per token: FP8 tensor cores, compute capability 8.9+; lora/fp8_gemm.py). Input gradients are
    # exact for the dequantized weight either way.
    base_gemm: Literal["bf16", "fp8"] = "bf16"

    def __post_init__(self) -> None:
        if self.base_precision not in ("bf16", "fp8", "nf4", "mxfp4"):
            raise LoRAError(
                f"LoRA base_precision {self.base_precision!r} is not supported: use 'bf16' "
                f"(the base as loaded), 'fp8' (e4m3 codes, a scale per output row), 'nf4' "
                f"(4-bit NormalFloat codes, a scale per 64 inputs) or 'mxfp4' (E2M1 codes, a "
                f"power-of-two scale per 32 inputs).")
        if self.base_gemm not in ("bf16", "fp8"):
            raise LoRAError(f"LoRA base_gemm {self.base_gemm!r} is not supported: use 'bf16' (the base "
                            f"dequantized into the model's GEMMs) or 'fp8' (FP8 GEMMs on an FP8 base's codes).")
        if self.base_gemm == "fp8" and self.base_precision != "fp8":
            raise LoRAError(f"LoRA base_gemm='fp8' multiplies FP8 codes, but base_precision is "
                            f"{self.base_precision!r}: set base_precision='fp8', or base_gemm='bf16'.")
        if not isinstance(self.rank, int) or self.rank <= 0:
            raise LoRAError(f"LoRA rank must be a positive int, got {self.rank!r}.")
        if not 0.0 <= self.dropout < 1.0:
            raise LoRAError(f"LoRA dropout must be in [0, 1), got {self.dropout}.")
        targets = resolve_targets(self.target_modules)
        if self.experts and not set(targets) & set(EXPERT_TARGETS):
            raise LoRAError(
                f"LoRA experts=True but target_modules {self.target_modules!r} name no expert "
                f"linear; add linear_fc1/linear_fc2 (gate_proj, up_proj, down_proj) or "
                f"'all-linear', or set experts=False.")

    @property
    def scale(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)


def saved_lora(fields: dict) -> LoRAConfig:
    """The LoRAConfig a checkpoint recorded; those from before expert adapters had none."""
    return LoRAConfig(**{"experts": False, **fields})


def resolve_targets(target_modules) -> tuple[str, ...]:
    """mcore module names to adapt, in a fixed order; clear errors for anything else."""
    names = [target_modules] if isinstance(target_modules, str) else list(target_modules)
    if names == ["all-linear"]:
        return tuple(TARGETS)
    unknown = [n for n in names if n not in TARGETS and n not in HF_TO_MCORE]
    if unknown or not names:
        raise LoRAError(
            f"LoRA target_modules {unknown or names} match no adaptable layer; available: "
            f"'all-linear', {', '.join(TARGETS)} (mcore) or {', '.join(HF_TO_MCORE)} (HF)."
        )
    chosen = {n if n in TARGETS else HF_TO_MCORE[n] for n in names}
    for name in chosen:
        hf = set(TARGETS[name][1])
        given = hf & set(names)
        if given and given != hf and name not in names:
            raise LoRAError(
                f"mcore fuses {', '.join(sorted(hf))} into {name}: target all of them (or "
                f"'{name}'), not only {', '.join(sorted(given))}."
            )
    return tuple(n for n in TARGETS if n in chosen)


def adapts_experts(lora: LoRAConfig, cfg=None) -> bool:
    """Whether `lora` puts adapters on routed experts (of `cfg`'s model, when given)."""
    wanted = lora.experts is not False and bool(set(resolve_targets(lora.target_modules)) & set(EXPERT_TARGETS))
    return wanted and (cfg is None or bool(cfg.num_moe_experts))
