"""Reducing the metrics mcore's schedule returns: {name: [sum, count]} per microbatch."""

from __future__ import annotations

from typing import Iterable, Optional

import torch
import torch.distributed as dist


def reduce_metrics(
    outputs: Iterable[dict], group: Optional[dist.ProcessGroup] = None
) -> dict[str, torch.Tensor]:
    """Sum [sum, count] pairs over microbatches and the given group; return sum / count."""
    totals: dict[str, torch.Tensor] = {}
    for out in outputs:
        for name, pair in out.items():
            totals[name] = totals.get(name, 0) + pair.detach().float()
    if not totals:
        return {}
    names = sorted(totals)
    stacked = torch.stack([totals[n] for n in names])
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(stacked, group=group)
    return {n: stacked[i, 0] / stacked[i, 1].clamp(min=1) for i, n in enumerate(names)}
