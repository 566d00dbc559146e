"""Checks on GPTConfig.moe_grouped_gemm_backend='torch', pure, run before any process starts:
torch's grouped GEMM (model/torch_experts.py) computes the experts unquantized from their weights,
so what would quantize them, recompute inside them or capture the host copy it removes is refused
here, naming the key ('auto' picks TE's kernel in these cases instead)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning_mcore.strategy.parallel import LayoutError

if TYPE_CHECKING:  # pragma: no cover
    from lightning_mcore.model.config import GPTConfig


class ExpertGemmError(LayoutError):
    what = "expert GEMM setting"


def validate_expert_gemm(model: "GPTConfig") -> None:
    """Raise ExpertGemmError naming the problem and the fix; None when the backend can run."""
    if model.moe_grouped_gemm_backend != "torch":
        return
    key = "moe_grouped_gemm_backend='torch'"
    if not (model.num_moe_experts and model.moe_grouped_gemm):
        raise ExpertGemmError(f"{key} picks the grouped GEMM's kernel: it needs a MoE model with "
                              f"moe_grouped_gemm=True (set it, or leave the backend 'te').",
                              fields=("moe_grouped_gemm_backend", "moe_grouped_gemm", "num_moe_experts"))
    ffn = model.moe_ffn_hidden_size or model.ffn_hidden_size
    if model.hidden_size % 8 or ffn % 8:
        raise ExpertGemmError(f"{key}: torch's grouped GEMM needs hidden_size ({model.hidden_size}) and "
                              f"moe_ffn_hidden_size ({ffn}) to be multiples of 8 (16-byte rows); "
                              f"use backend 'te' for this shape.",
                              fields=("moe_grouped_gemm_backend", "hidden_size", "moe_ffn_hidden_size"))
    if model.extra.get("add_bias_linear"):
        raise ExpertGemmError(f"{key} computes the experts without biases; extra.add_bias_linear=True "
                              f"would leave them out. Use backend 'te'.",
                              fields=("moe_grouped_gemm_backend", "extra"))
    if model.fp8:
        raise ExpertGemmError(f"{key} runs the experts unquantized: fp8={model.fp8!r} would not reach "
                              f"them; use backend 'te' for fp8 experts.",
                              fields=("moe_grouped_gemm_backend", "fp8"))
    if "moe_act" in (model.recompute_modules or ()):
        raise ExpertGemmError(f"{key} has no 'moe_act' recompute (TE's experts do); remove it from "
                              f"recompute_modules or use backend 'te'.",
                              fields=("moe_grouped_gemm_backend", "recompute_modules"))
    if "moe_preprocess" in (model.cuda_graphs or ()):
        raise ExpertGemmError(f"{key} keeps the token counts on the GPU: the cuda_graphs part "
                              f"'moe_preprocess' (which captures their copy to the host) has nothing "
                              f"to capture; remove it.", fields=("moe_grouped_gemm_backend", "cuda_graphs"))
