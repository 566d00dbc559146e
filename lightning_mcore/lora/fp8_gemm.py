"""Real FP8 GEMMs over an FP8 base (LoRAConfig.base_gemm "fp8"): the forward multiplies the base's
e4m3 codes as they are held, on FP8 tensor cores (torch._scaled_mm, torch._scaled_grouped_mm for
torch's grouped experts; both with row-wise scales, fp32 accumulation), instead of dequantizing
the weight into a bf16 GEMM (base_gemm "bf16", lora/quantized_base.py):

    x   [T, in]    xq = e4m3(x / sx),  sx [T] = amax(|x row|) / 448   (this call, per token)
    W'  [out, in]  = codes * s,        s [out] the base's scales       (lora/quantized_base.py)
    y   [T, out]   = (xq codes^T) * sx s^T   in fp32, written in bf16 (CPU: the input's dtype)

So the forward's error is the input's rounding to e4m3 on top of the base's own. The backward
gives exact input gradients for the dequantized weight, dx = dy W' (W' dequantized again by the
fused kernel into a bf16 GEMM); the base is frozen, so there is no weight gradient and the call
saves nothing but a reference to the codes.

A row-parallel linear holds a slice of each input row: sx takes the row's max over the
(expert-)TP group, as the weight's scales do, so the codes of x, like those of W, are the same
numbers at any layout. Where torch has no FP8 kernel (CPU: `_scaled_mm` only, no grouped one)
the experts run one `_scaled_mm` per expert; CUDA needs compute capability 8.9 (Ada, Hopper).
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

from lightning_mcore.lora.config import LoRAError
from lightning_mcore.lora.grouped_base import ExpertsGemm, compute_from_record
from lightning_mcore.lora.quantized_base import QuantizedWeights, row_scales, to_e4m3
from lightning_mcore.model.torch_experts import grouped_mm


@functools.cache
def _fused_to_e4m3():
    """to_e4m3 as one kernel (eager: three passes through an fp32 copy of the input)."""
    return torch.compile(to_e4m3, dynamic=True)


def quantize_input(x: torch.Tensor, group=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(xq, sx) of x [T, in]: the weights' rule (row_scales, to_e4m3) on each call's input rows."""
    scales = row_scales(x, group)
    cast = _fused_to_e4m3() if x.is_cuda else to_e4m3
    with torch.no_grad():
        return cast(x, scales), scales


def out_dtype(x: torch.Tensor) -> torch.dtype:
    """What the GEMM writes: bf16 on CUDA (torch's row-wise scaled kernels write nothing else),
    the input's dtype elsewhere (CPU tests run in fp32, where layouts then agree to fp32's rounding)."""
    return torch.bfloat16 if x.is_cuda else x.dtype


def scaled_mm(xq, sx, codes, scales, dtype: torch.dtype) -> torch.Tensor:
    """(xq codes^T) * sx s^T: xq [T, in] e4m3, sx [T, 1], codes [out, in] e4m3, scales [out]."""
    return torch._scaled_mm(xq, codes.t(), scale_a=sx, scale_b=scales.float().unsqueeze(0), out_dtype=dtype)


def scaled_grouped_mm(xq, sx, codes, scales, offsets, dtype: torch.dtype) -> torch.Tensor:
    """Expert e's rows of xq (ending at offsets[e]) times its codes [E, out, in]^T."""
    if xq.shape[0] == 0:  # no token reached this rank's experts
        return torch.zeros(0, codes.shape[1], dtype=dtype, device=xq.device)
    if xq.is_cuda:
        return torch._scaled_grouped_mm(xq, codes.transpose(1, 2), scale_a=sx.squeeze(-1),
                                        scale_b=scales.float(), offs=offsets, out_dtype=dtype)
    out = torch.zeros(xq.shape[0], codes.shape[1], dtype=dtype, device=xq.device)
    start = 0
    for e, end in enumerate(offsets.tolist()):
        if end > start:
            out[start:end] = scaled_mm(xq[start:end], sx[start:end], codes[e], scales[e], dtype)
        start = end
    return out


class Fp8FrozenLinear(torch.autograd.Function):
    """y = x W'^T (+ bias) by an FP8 GEMM on the record's codes; dx = dy W' exact (module docstring)."""

    @staticmethod
    def forward(ctx, x, record: QuantizedWeights, bias, allreduce_dgrad: bool, tp_group, input_group):
        ctx.record, ctx.allreduce_dgrad, ctx.tp_group = record, allreduce_dgrad, tp_group
        ctx.has_bias = bias is not None
        flat = x.reshape(-1, x.shape[-1])
        xq, sx = quantize_input(flat, input_group)
        y = scaled_mm(xq, sx, record.codes, record.scales, out_dtype(x)).to(x.dtype).reshape(*x.shape[:-1], -1)
        return y + bias if bias is not None else y

    @staticmethod
    def backward(ctx, dy):
        dx = (dy.reshape(-1, dy.shape[-1]) @ ctx.record.values()).reshape(*dy.shape[:-1], -1)
        if ctx.allreduce_dgrad:
            dist.all_reduce(dx, group=ctx.tp_group)
        dbias = dy.reshape(-1, dy.shape[-1]).sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return dx, None, dbias, None, None, None


class Fp8GroupedLinear(torch.autograd.Function):
    """Torch's grouped experts' y = x W_e'^T on each expert's rows by one FP8 grouped GEMM;
    dx = dy W_e' exact, by the bf16 grouped GEMM on the dequantized block."""

    @staticmethod
    def forward(ctx, x, offsets, record: QuantizedWeights, input_group):
        ctx.record = record
        ctx.save_for_backward(offsets)
        xq, sx = quantize_input(x, input_group)
        return scaled_grouped_mm(xq, sx, record.codes, record.scales, offsets, out_dtype(x)).to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        (offsets,) = ctx.saved_tensors
        return grouped_mm(dy.contiguous(), ctx.record.values(), offs=offsets), None, None, None


class Fp8GemmLinear:
    """Mixed into an mcore Column/RowParallelLinear whose base weight is FP8 codes: its GEMM (mcore's
    `_forward_impl`, which mcore's forward calls after its own communication: sequence-parallel
    gathers are done here as mcore's frozen-weight path does them) becomes Fp8FrozenLinear; a
    merged weight (export, generation) computes as before."""

    fp8_record: QuantizedWeights
    fp8_input_group = None  # row-parallel: the group the input rows are split across

    def _forward_impl(self, input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad,
                      sequence_parallel, tp_group, *args, **kwargs):
        if self.fp8_record.merged:
            return super()._forward_impl(input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad,
                                         sequence_parallel, tp_group, *args, **kwargs)
        if sequence_parallel:
            input = gather_from_sequence_parallel_region(input, tensor_parallel_output_grad=True, group=tp_group)
        return Fp8FrozenLinear.apply(input, self.fp8_record, bias, allreduce_dgrad, tp_group, self.fp8_input_group)


@functools.cache
def _with_fp8_gemm(cls: type) -> type:
    return type(f"Fp8Gemm{cls.__name__}", (Fp8GemmLinear, cls), {})


def check_device(weight: torch.Tensor) -> None:
    """Refuse where torch's scaled GEMMs cannot run (before the first step, not inside it)."""
    if weight.is_cuda and torch.cuda.get_device_capability(weight.device) < (8, 9):
        raise LoRAError(f"LoRA base_gemm='fp8' needs FP8 tensor cores (compute capability 8.9 or newer: Ada, "
                        f"Hopper, Blackwell), but this GPU has {torch.cuda.get_device_capability(weight.device)}: "
                        f"use base_gemm='bf16' (the FP8 base dequantized into bf16 GEMMs).")


def use_fp8_gemm(owner: torch.nn.Module, record: QuantizedWeights, group=None, experts_linear: Optional[str] = None):
    """Make `owner` compute with `record`'s codes: a linear's class gains Fp8GemmLinear; torch's
    grouped experts (`experts_linear`: which of their linears) compute it by Fp8GroupedLinear. `group`: the
    row-parallel (expert-)TP group. The record stops giving the weight values per call."""
    if record.codec.name != "fp8":
        raise LoRAError(f"LoRA base_gemm='fp8' computes with FP8 codes, but base_precision is "
                        f"{record.codec.name!r}: use base_precision='fp8', or base_gemm='bf16'.")
    check_device(record.codes)
    if experts_linear is not None:
        compute_from_record(owner, experts_linear, record, ExpertsGemm(Fp8GroupedLinear, record, group))
    elif isinstance(owner, (ColumnParallelLinear, RowParallelLinear)):
        owner.__class__ = _with_fp8_gemm(type(owner))
        owner.fp8_record, owner.fp8_input_group = record, group
        record.direct = True
    else:
        raise LoRAError(f"LoRA base_gemm='fp8' runs on mcore's local linears and torch's grouped experts, not "
                        f"{type(owner).__name__}: use base_gemm='bf16'.")
