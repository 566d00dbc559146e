"""Checks on GPTConfig.moe_grouped_gemm_backend='torch', pure, run before any process starts:
torch's grouped GEMM (model/torch_experts.py) computes the experts unquantized from their weights,
so what would quantize them, recompute inside them or capture the host copy it removes is refused
here, naming the key ('auto' picks TE's kernel in these cases instead). And TE's kernel is
refused where TE does not run (validate_expert_kernel)."""

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
    if not model.grouped_experts:
        raise ExpertGemmError(f"{key} picks the grouped GEMM's kernel: it needs a MoE model with "
                              f"grouped experts (moe_grouped_gemm True or None; or leave the backend 'te').",
                              fields=("moe_grouped_gemm_backend", "moe_grouped_gemm", "num_moe_experts"))
    obstacle = model.torch_experts_obstacle()
    if obstacle:
        why, fields = obstacle
        raise ExpertGemmError(f"{key}: {why}; or use moe_grouped_gemm_backend 'te'.",
                              fields=("moe_grouped_gemm_backend", *fields))


def validate_expert_kernel(model: "GPTConfig", use_te: bool) -> None:
    """mcore's grouped experts without Transformer Engine are its legacy GroupedMLP, which needs a
    package we do not install: refused before any rank builds it."""
    if model.mcore_grouped_gemm and not use_te:
        raise ExpertGemmError(
            "the experts would run on Transformer Engine's grouped GEMM (moe_grouped_gemm_backend='te', "
            "or 'auto' where torch's kernel cannot compute them), which needs TE on a GPU: use "
            "moe_grouped_gemm_backend 'torch' or 'auto' with sizes torch's kernel takes, or "
            "moe_grouped_gemm=False for mcore's SequentialMLP.",
            fields=("moe_grouped_gemm", "moe_grouped_gemm_backend"))
