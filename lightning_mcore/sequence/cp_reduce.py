"""Sums over the context-parallel group, for objectives that need whole-sequence quantities
(DPO's per-sequence log-probs) when each cp rank holds only its share of every sequence.

The sum is straight-through for autograd: each rank's gradient flows into its own share only.
Every cp rank then computes the same loss from the same totals, and its backward gives the
derivative through its own tokens; the data-parallel x cp gradient reduction adds the shares,
which is the whole gradient, once. (A sum whose backward all-reduced again would count it cp
times.) So a loss built on these totals must be counted once per cp group, on its first rank
(context_parallel_first), for the token/pair count that divides the gradients.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps


def _group():
    """The cp group, or None when there is no context parallelism."""
    if not dist.is_initialized() or not ps.model_parallel_is_initialized():
        return None
    if ps.get_context_parallel_world_size() == 1:
        return None
    return ps.get_context_parallel_group()


def context_parallel_sum(local: torch.Tensor) -> torch.Tensor:
    """`local` summed over the cp ranks; its gradient reaches `local` unchanged."""
    group = _group()
    if group is None:
        return local
    total = local.detach().clone()
    dist.all_reduce(total, group=group)
    return local + (total - local.detach())


def context_parallel_first() -> bool:
    """True on the first rank of the cp group (and without context parallelism)."""
    return _group() is None or ps.get_context_parallel_rank() == 0
