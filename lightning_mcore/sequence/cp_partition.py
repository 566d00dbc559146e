"""Context parallelism for packed (THD) sequences: which tokens each CP rank holds.

Under context parallelism of size cp, Transformer Engine's THD attention wants every packed
sequence padded to a multiple of 2*cp tokens and cut into 2*cp equal chunks; rank r holds chunks
r and 2*cp-1-r of every sequence, sequences in order, chunk r first. Under a causal mask an early
chunk is cheap and a late one dear, so each rank gets the same work:

    cp=2, sequences of 5, 3, 8 tokens       cu_seqlens         0 5 8 16
    padded to 8, 4, 8 (multiples of 4)      cu_seqlens_padded  0 8 12 20

    padded    a0 a1 a2 a3 a4 __ __ __ | b0 b1 b2 __ | c0 c1 c2 c3 c4 c5 c6 c7
    chunk     0  0  1  1  2  2  3  3  | 0  1  2  3  | 0  0  1  1  2  2  3  3
    rank 0    a0 a1 __ __ | b0 __ | c0 c1 c6 c7          chunks 0 and 3
    rank 1    a2 a3 a4 __ | b1 b2 | c2 c3 c4 c5          chunks 1 and 2

Padding sits at the end of its sequence: TE, given both cu_seqlens and cu_seqlens_padded, never
attends to it, and its loss mask is 0, so it counts in no loss. Position ids are partitioned like
the tokens; mcore's THD RoPE under CP derives the same positions from cu_seqlens_padded
(rope_utils._get_thd_freqs_on_this_cp_rank). With cp == 1 nothing is split or padded.
Pure tensor functions, no process groups (the caller names the rank); CPU and GPU alike.
"""

from __future__ import annotations

from typing import Sequence

import torch


def pad_for_cp(cu_seqlens: torch.Tensor, cp: int) -> torch.Tensor:
    """int32 offsets with each sequence's length rounded up to a multiple of 2*cp (TE splits
    every sequence into 2*cp equal chunks)."""
    _check_cp(cp)
    _check_cu_seqlens(cu_seqlens, "cu_seqlens")
    multiple = 2 * cp if cp > 1 else 1
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    padded = (lengths + multiple - 1) // multiple * multiple
    return torch.cat([padded.new_zeros(1), padded.cumsum(0)]).to(torch.int32)


def pad(x: torch.Tensor, cu_seqlens: torch.Tensor, cu_seqlens_padded: torch.Tensor, dim: int,
        value=0) -> torch.Tensor:
    """`x` (unpadded THD along `dim`) in the padded layout, each sequence followed by its pad
    tokens set to `value`. Pad labels and the loss mask with 0 so pad tokens carry no loss."""
    index = _real_positions(cu_seqlens, cu_seqlens_padded)
    _check_size(x, dim, index.numel(), "cu_seqlens[-1]")
    shape = list(x.shape)
    shape[dim] = int(cu_seqlens_padded[-1])
    return x.new_full(shape, value).index_copy(dim, index.to(x.device), x)


def unpad(x: torch.Tensor, cu_seqlens: torch.Tensor, cu_seqlens_padded: torch.Tensor,
          dim: int) -> torch.Tensor:
    """The padded layout back to the unpadded one: pad tokens dropped."""
    index = _real_positions(cu_seqlens, cu_seqlens_padded)
    _check_size(x, dim, int(cu_seqlens_padded[-1]), "cu_seqlens_padded[-1]")
    return x.index_select(dim, index.to(x.device))


def partition_indices(cu_seqlens_padded: torch.Tensor, cp: int, rank: int) -> torch.Tensor:
    """Positions in the padded layout that CP rank `rank` holds, in Transformer Engine's order.

    Confirmed against TE's own kernel (NVIDIA/TransformerEngine main @ d0067d0,
    transformer_engine/common/fused_attn/context_parallel.cu lines 83-112:
    thd_partition_src_index / thd_partition_indices_kernel behind
    transformer_engine_torch.thd_get_partitioned_indices): local token i of a sequence of padded
    length L comes from chunk `rank` while i < L / (2*cp), then from chunk 2*cp-1-rank, sequences
    in order. TE's test (tests/pytorch/attention/test_cp_utils.py lines 839-850) expects
    [0, 1, 6, 7, 8, 9, 14, 15] for cu_seqlens [0, 8, 16], cp 2, rank 0. mcore hands TE
    cu_seqlens_padded and index_selects every sequence tensor with the result
    (megatron/core/utils.py _get_batch_on_this_cp_rank_per_document_balancing, 0.19.2 lines
    2406-2452).
    """
    _check_cp(cp)
    _check_cu_seqlens(cu_seqlens_padded, "cu_seqlens_padded")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < cp:
        raise ValueError(f"rank must be an integer in [0, cp={cp}), got {rank!r}")
    total = int(cu_seqlens_padded[-1])
    device = cu_seqlens_padded.device
    if cp == 1:
        return torch.arange(total, device=device)
    lengths = (cu_seqlens_padded[1:] - cu_seqlens_padded[:-1]).long()
    odd = torch.nonzero(lengths % (2 * cp)).reshape(-1)
    if odd.numel():
        i = int(odd[0])
        raise ValueError(f"cu_seqlens_padded: sequence {i} has {int(lengths[i])} tokens, not a multiple "
                         f"of 2*cp = {2 * cp}; pad the offsets with pad_for_cp(cu_seqlens, {cp})")
    chunk = lengths // (2 * cp)
    held = 2 * chunk  # each rank holds two chunks of every sequence
    seq = torch.repeat_interleave(torch.arange(len(lengths), device=device), held)
    local = torch.arange(total // cp, device=device) - torch.repeat_interleave(held.cumsum(0) - held, held)
    early = local < chunk[seq]
    which = torch.where(early, rank, 2 * cp - 1 - rank)
    within = torch.where(early, local, local - chunk[seq])
    return cu_seqlens_padded[:-1].long()[seq] + which * chunk[seq] + within


def partition(x: torch.Tensor, cu_seqlens_padded: torch.Tensor, cp: int, rank: int,
              dim: int) -> torch.Tensor:
    """The part of `x` (padded THD along `dim`) that CP rank `rank` holds."""
    index = partition_indices(cu_seqlens_padded, cp, rank)
    _check_size(x, dim, int(cu_seqlens_padded[-1]), "cu_seqlens_padded[-1]")
    return x.index_select(dim, index.to(x.device))


def unpartition(parts: Sequence[torch.Tensor], cu_seqlens_padded: torch.Tensor, cp: int,
                dim: int) -> torch.Tensor:
    """Every rank's part (rank order) back in the padded layout; `unpad` then drops the pads."""
    if len(parts) != cp:
        raise ValueError(f"unpartition needs one part per CP rank: {cp}, got {len(parts)}")
    index = torch.cat([partition_indices(cu_seqlens_padded, cp, r) for r in range(cp)])
    for rank, part in enumerate(parts):
        _check_size(part, dim, int(cu_seqlens_padded[-1]) // cp, f"rank {rank}'s share")
    inverse = torch.empty_like(index)
    inverse[index] = torch.arange(len(index), device=index.device)
    joined = torch.cat(list(parts), dim)
    return joined.index_select(dim, inverse.to(joined.device))


def _real_positions(cu_seqlens: torch.Tensor, cu_seqlens_padded: torch.Tensor) -> torch.Tensor:
    """Where each unpadded token sits in the padded layout (its sequence moved by the pads before it)."""
    _check_cu_seqlens(cu_seqlens, "cu_seqlens")
    _check_cu_seqlens(cu_seqlens_padded, "cu_seqlens_padded")
    if cu_seqlens.shape != cu_seqlens_padded.shape:
        raise ValueError(f"cu_seqlens ({cu_seqlens.numel() - 1} sequences) and cu_seqlens_padded "
                         f"({cu_seqlens_padded.numel() - 1}) describe different batches")
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    padded = (cu_seqlens_padded[1:] - cu_seqlens_padded[:-1]).long().to(lengths.device)
    if bool((padded < lengths).any()):
        raise ValueError("cu_seqlens_padded holds a sequence shorter than in cu_seqlens; "
                         "build it with pad_for_cp(cu_seqlens, cp)")
    shift = (cu_seqlens_padded[:-1].long().to(lengths.device) - cu_seqlens[:-1].long())
    return torch.arange(int(cu_seqlens[-1]), device=lengths.device) + torch.repeat_interleave(shift, lengths)


def _check_cp(cp) -> None:
    if isinstance(cp, bool) or not isinstance(cp, int) or cp < 1:
        raise ValueError(f"cp (the context parallel size) must be an integer >= 1, got {cp!r}")


def _check_cu_seqlens(cu: torch.Tensor, name: str) -> None:
    """Offsets as packing.cu_seqlens_of makes them: 1-D integers from 0, strictly increasing."""
    if not isinstance(cu, torch.Tensor) or cu.dim() != 1 or cu.numel() < 2:
        shape = tuple(cu.shape) if isinstance(cu, torch.Tensor) else type(cu).__name__
        raise ValueError(f"{name} must be a 1-D tensor of offsets [0, ..., total], got {shape}")
    if cu.dtype.is_floating_point or cu.dtype.is_complex or cu.dtype == torch.bool:
        raise ValueError(f"{name} must hold integers, got {cu.dtype}")
    if int(cu[0]) != 0:
        raise ValueError(f"{name} must start at 0, got {int(cu[0])}")
    steps = torch.nonzero(cu[1:] <= cu[:-1]).reshape(-1)
    if steps.numel():
        i = int(steps[0])
        raise ValueError(f"{name} must be strictly increasing (every sequence holds a token), but "
                         f"{name}[{i + 1}] = {int(cu[i + 1])} after {int(cu[i])}")


def _check_size(x: torch.Tensor, dim: int, expected: int, what: str) -> None:
    if x.size(dim) != expected:
        raise ValueError(f"tensor of shape {tuple(x.shape)} has {x.size(dim)} tokens along dim {dim}, "
                         f"{what} says {expected}")
