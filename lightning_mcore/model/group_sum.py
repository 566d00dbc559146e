"""A differentiable sum over a process group whose backward sums the gradients over the group too.

Every rank's input feeds every rank's output, so each rank's gradient is the sum of all ranks'
upstream gradients (a normaliser over the vocabulary or over all heads split by tensor
parallelism). torch's own `torch.distributed.nn.functional.all_reduce` does this but is
deprecated and warns on every call, once per rank; its suggested replacement is private.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class _SumOverGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group = group
        tensor = tensor.clone()
        dist.all_reduce(tensor, group=group)
        return tensor

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def sum_over_group(tensor: torch.Tensor, group) -> torch.Tensor:
    """`tensor` summed over `group` on every rank; gradients summed over the group as well."""
    return _SumOverGroup.apply(tensor, group)
