"""The LM head's logits in fp32: the bf16 hidden states times the bf16 weights, accumulated in
fp32 and returned in fp32, never rounded to bf16.

A bf16 logit near 1 is known to 1/128, near 16 to 1/8. Two forward passes over the same tokens
that differ in the last bit of a hidden state (a decode step against the packed training
forward: other kernels, other GEMM shapes) can then round a logit to neighbouring bf16 values,
and a token's log-probability moves by that step. RL compares exactly those two passes (the
log-probs generation sampled with against the training forward's), so the rounding shows as
train/rollout mismatch. MiniMax-M1 traced its mismatch to the LM head and computed it in fp32;
SGLang (enable_fp32_lm_head), slime and NeMo-RL (fp32_lm_head) followed.

Here the weights stay bf16 and the GEMM stays a bf16 tensor-core GEMM (torch.mm with an fp32
output): no fp32 copy of a [vocab, hidden] weight, no fp32 GEMM. Only the product's rounding
goes. The backward pass is the usual one, in the weights' dtype.

The output layer keeps mcore's ColumnParallelLinear and its tensor-parallel plumbing; only the
matrix product (_forward_impl) is ours:

    sequence parallel:  [s/tp, b, h] --all-gather (backward: reduce-scatter)--> [s, b, h]
    tensor parallel:    [s, b, h]    --copy (backward: all-reduce)-------------> [s, b, h]
    then                [s, b, h] x this rank's [V/tp, h] rows --> [s, b, V/tp] fp32
"""

from __future__ import annotations

import torch
from megatron.core.tensor_parallel import ColumnParallelLinear
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
)


def fp32_product(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """hidden [n, h] x weight [V, h]^T in fp32, from operands in any float dtype (products of
    bf16 values are exact in fp32; only the accumulation order differs between kernels)."""
    if hidden.is_cuda and hidden.dtype == weight.dtype and hidden.dtype in (torch.bfloat16, torch.float16):
        return torch.mm(hidden, weight.t(), out_dtype=torch.float32)
    return hidden.float() @ weight.float().t()  # CPU (no mm with an fp32 output), or fp32 operands


class _Fp32Product(torch.autograd.Function):
    """fp32_product on [n, h] rows; the backward pass in the operands' dtype."""

    @staticmethod
    def forward(ctx, hidden, weight):
        ctx.save_for_backward(hidden, weight)
        return fp32_product(hidden, weight)

    @staticmethod
    def backward(ctx, grad):
        hidden, weight = ctx.saved_tensors
        grad = grad.to(hidden.dtype)  # the gradients of a bf16 head are bf16, as mcore's are
        grad_hidden = grad @ weight.to(hidden.dtype)
        grad_weight = (grad.t() @ hidden).to(weight.dtype) if ctx.needs_input_grad[1] else None
        return grad_hidden, grad_weight


class Fp32LogitsLinear(ColumnParallelLinear):
    """mcore's output layer whose product is _Fp32Product (set on a built layer by `install`)."""

    def _forward_impl(self, input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad,
                      sequence_parallel, grad_output_buffer=None, wgrad_deferral_limit=None,
                      tp_group=None, gtp_remat_size=1):
        if gradient_accumulation_fusion or grad_output_buffer is not None or gtp_remat_size > 1:
            raise NotImplementedError("fp32 logits: the output layer's gradient-accumulation fusion, "
                                      "deferred embedding wgrad and GTP sharding are not supported")
        if sequence_parallel:
            input = gather_from_sequence_parallel_region(input, tensor_parallel_output_grad=True, group=tp_group)
        elif allreduce_dgrad:
            input = copy_to_tensor_model_parallel_region(input, group=tp_group)
        # 2-D inside the Function: the loss may write into the logits in place (a view made
        # inside a custom Function may not be)
        out = _Fp32Product.apply(input.reshape(-1, input.shape[-1]), weight)
        out = out.view(*input.shape[:-1], out.shape[-1])
        return out if bias is None else out + bias.float()


def install(output_layer: ColumnParallelLinear) -> None:
    """Make a built output layer compute fp32 logits (its weights, hooks and state unchanged)."""
    if type(output_layer) is not ColumnParallelLinear:
        raise TypeError(f"fp32 logits replace mcore's ColumnParallelLinear product; this output layer "
                        f"is a {type(output_layer).__name__}")
    output_layer.__class__ = Fp32LogitsLinear
