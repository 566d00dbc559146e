"""Torch's grouped experts over a quantized base (lora/quantized_base.py) computed from the codes'
record itself, not through the experts' weight parameters.

Through the parameters, every call gave each expert's weight a view of the dequantized block and
took it back afterwards (a new placeholder per expert: for Qwen3-30B-A3B's 128 experts, 256 small
allocations and fill kernels per layer and pass), and handed autograd every expert's weight to save
and restore. Here the grouped GEMM takes the block itself: the same values in the same GEMMs, bit
for bit; only the host's bookkeeping goes.

    forward   W' = the dequantized block [E, out, in] (this call only);  y = grouped_mm(x, W'^T)
    backward  W' again;  dx = grouped_mm(dy, W')   (the base is frozen: no weight gradient)

lora/fp8_gemm.py's FP8 GEMMs plug in the same way, with another function.
"""

from __future__ import annotations

import torch

from lightning_mcore.lora.quantized_base import QuantizedWeights
from lightning_mcore.model.torch_experts import grouped_mm


class DequantizedGroupedLinear(torch.autograd.Function):
    """y = x W_e'^T on each expert's rows (ending at `offsets`), W' dequantized per call and pass."""

    @staticmethod
    def forward(ctx, x, offsets, record: QuantizedWeights):
        ctx.record = record
        ctx.save_for_backward(offsets)
        return grouped_mm(x, record.values().transpose(1, 2), offs=offsets)

    @staticmethod
    def backward(ctx, dy):
        (offsets,) = ctx.saved_tensors
        return grouped_mm(dy.contiguous(), ctx.record.values(), offs=offsets), None, None


class ExpertsGemm:
    """One linear of torch's grouped experts (TorchGroupedMLP.base_gemms[name]): `function` applied to
    (x, offsets, record, *extra) while the record is not merged (a merged weight computes as before)."""

    def __init__(self, function, record: QuantizedWeights, *extra) -> None:
        self.function, self.record, self.extra = function, record, extra

    @property
    def active(self) -> bool:
        return not self.record.merged

    def __call__(self, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return self.function.apply(x, offsets, self.record, *self.extra)


def compute_from_record(experts, name: str, record: QuantizedWeights, gemm: ExpertsGemm = None) -> None:
    """Make torch's grouped experts compute their linear `name` from `record` (by `gemm`; default:
    dequantized into the bf16 grouped GEMM); the record stops giving the weights values per call."""
    experts.base_gemms = {**experts.base_gemms, name: gemm or ExpertsGemm(DequantizedGroupedLinear, record)}
    record.direct = True
