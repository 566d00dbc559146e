"""Packed sequences: samples that share a row attend only to themselves, positions restart.

A microbatch [B, S] with `segment_ids` (1..k per sample in a row, 0 for padding) travels
through the model as one THD row of B*S tokens, cut into sequences by `cu_seqlens`:

    segment_ids  [[1 1 1 2 2 0],      tokens   a a a b b _ c c c c d d
                  [1 1 1 1 2 2]]      cu_seqlens 0     3   5 6       10  12

Each row's padding is a sequence of its own (it carries no loss). mcore applies RoPE per
sequence (positions restart), Transformer Engine's attention takes THD with cu_seqlens, and
on the local spec SDPAttention turns cu_seqlens into a block-diagonal causal mask (a sliding
window, where a layer has one, applies within each sequence).
"""

from __future__ import annotations

from typing import Optional

import torch
from megatron.core.packed_seq_params import PackedSeqParams


def cu_seqlens_of(segment_ids: torch.Tensor) -> torch.Tensor:
    """int32 start offsets (and total) of every (row, segment) run of the flattened batch."""
    rows, seq = segment_ids.shape
    key = (segment_ids + torch.arange(rows, device=segment_ids.device)[:, None] * (seq + 1)).reshape(-1)
    starts = torch.nonzero(torch.diff(key, prepend=key[:1] - 1)).reshape(-1)
    total = torch.tensor([key.numel()], device=key.device)
    return torch.cat([starts, total]).to(torch.int32)


def packed_seq_params(segment_ids: torch.Tensor) -> PackedSeqParams:
    cu = cu_seqlens_of(segment_ids)
    longest = int((cu[1:] - cu[:-1]).max())
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                           max_seqlen_q=longest, max_seqlen_kv=longest)


def block_causal_mask(cu_seqlens: torch.Tensor, window: Optional[int] = None) -> torch.Tensor:
    """[total, total] bool, True where attention is allowed: same sequence, not in the future,
    and with a `window`, at most `window` - 1 tokens back (HF's q - window < k <= q)."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    seq_of = torch.repeat_interleave(torch.arange(len(lengths), device=cu_seqlens.device), lengths)
    same = seq_of[:, None] == seq_of[None, :]
    if window is None:
        return torch.tril(same)
    return same & causal_mask(len(seq_of), len(seq_of), window, cu_seqlens.device)


def causal_mask(sq: int, sk: int, window: Optional[int] = None, device=None) -> torch.Tensor:
    """[sq, sk] bool, True where attention is allowed: queries are the last sq of the sk
    positions; each sees itself and earlier keys, with a `window` only the window - 1 before it."""
    q = torch.arange(sk - sq, sk, device=device)[:, None]
    k = torch.arange(sk, device=device)[None, :]
    allowed = k <= q
    return allowed if window is None else allowed & (k > q - window)


def forward_packed(chunk, batch: dict):
    """One microbatch ([micro_batch, seq] tokens, labels, position_ids, segment_ids) through a
    model chunk as a single THD row: per-token losses [1, micro_batch * seq] on the last stage,
    hidden states elsewhere."""
    flat = {k: batch[k].reshape(1, -1) for k in ("tokens", "labels", "position_ids")}
    return chunk(input_ids=flat["tokens"], position_ids=flat["position_ids"], attention_mask=None,
                 labels=flat["labels"], packed_seq_params=packed_seq_params(batch["segment_ids"]))
