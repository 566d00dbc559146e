"""Packed sequences: samples that share a row attend only to themselves, positions restart.

A microbatch [B, S] with `segment_ids` (1..k per sample in a row, 0 for padding) travels
through the model as one THD row of B*S tokens, cut into sequences by `cu_seqlens`:

    segment_ids  [[1 1 1 2 2 0],      tokens   a a a b b _ c c c c d d
                  [1 1 1 1 2 2]]      cu_seqlens 0     3   5 6       10  12

Each row's padding is a sequence of its own (it carries no loss). mcore applies RoPE per
sequence (positions restart), Transformer Engine's attention takes THD with cu_seqlens, and
on the local spec SDPAttention turns cu_seqlens into a block-diagonal causal mask (a sliding
window, where a layer has one, applies within each sequence).

Under context parallelism (cp > 1) the strategy hands each rank its share of the THD row
(`packed_context_parallel_slice`, layout in sequence/cp_partition.py) with the offsets the model
needs; `packed_seq_params_for` builds PackedSeqParams from them.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from megatron.core.packed_seq_params import PackedSeqParams

from lightning_mcore.sequence import cp_partition


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


def packed_seq_params_for(micro: dict) -> PackedSeqParams:
    """PackedSeqParams of a microbatch: from the context-parallel offsets that
    `packed_context_parallel_slice` put in it, else from its segment_ids."""
    if "cu_seqlens_padded" not in micro:
        return packed_seq_params(micro["segment_ids"])
    cu, padded, longest = micro["cu_seqlens"], micro["cu_seqlens_padded"], int(micro["max_seqlen"])
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                           cu_seqlens_q_padded=padded, cu_seqlens_kv_padded=padded,
                           max_seqlen_q=longest, max_seqlen_kv=longest)


def cp_row_length(segment_ids: Sequence[torch.Tensor], cp: int, multiple: int) -> int:
    """One THD row length for all of a step's microbatches under context parallelism: the
    longest padded row (every sequence padded to a multiple of 2*cp) rounded up to `multiple`
    (2*cp, times the tensor-parallel size under sequence parallelism). Pipeline stages pass
    tensors of one shape for every microbatch."""
    longest = max(int(cp_partition.pad_for_cp(cu_seqlens_of(seg), cp)[-1]) for seg in segment_ids)
    return -(-longest // multiple) * multiple


def packed_context_parallel_slice(micro: dict, cp: int, rank: int, length: Optional[int] = None) -> dict:
    """CP rank `rank`'s share of a packed microbatch ([rows, seq] tensors with segment_ids) as
    one THD row [1, length / cp], plus what PackedSeqParams needs: cu_seqlens (real tokens),
    cu_seqlens_padded and max_seqlen (the longest padded sequence), as mcore's
    get_thd_batch_on_this_cp_rank takes them.

    Every sequence is padded at its end to a multiple of 2*cp (pad tokens: id 0, label 0,
    loss_mask 0, position 0; mcore's THD RoPE derives positions from cu_seqlens_padded).
    `row_ids` (the row each token came from; pads say 0) is added and split like the tokens, for
    objectives that sum per row; tensors with one value per row ([rows] or [rows, k]) pass
    through whole. With
    `length` (a multiple of 2*cp, at least the padded total) the row is filled up to it with
    one more sequence of pad tokens, so that every microbatch of a step has the same shape
    for the pipeline schedule."""
    seg = micro["segment_ids"]
    rows, seq = seg.shape
    cu = cu_seqlens_of(seg)
    padded = cp_partition.pad_for_cp(cu, cp)
    total = int(padded[-1])
    length = total if length is None else length
    if length < total or length % (2 * cp):
        raise ValueError(f"length {length} must be a multiple of 2*cp = {2 * cp} and at least the "
                         f"padded row's {total} tokens")
    fill = length - total
    row_ids = torch.arange(rows, device=seg.device)[:, None].expand(rows, seq)
    out, per_row = {}, {}
    for key, value in {**micro, "row_ids": row_ids}.items():
        if value.shape[:2] != seg.shape:
            if value.shape[0] == rows and (value.dim() == 1 or value.shape[1] != seq):
                per_row[key] = value  # one value per row (e.g. DPO's reference log-probs)
                continue
            raise ValueError(f"packed context parallelism splits [rows, seq] tensors like segment_ids "
                             f"{tuple(seg.shape)}; {key} has shape {tuple(value.shape)}")
        flat = cp_partition.pad(value.reshape(-1, *value.shape[2:]), cu, padded, dim=0, value=0)
        if fill:
            flat = torch.cat([flat, flat.new_zeros(fill, *flat.shape[1:])])
        out[key] = flat.unsqueeze(0)
    if fill:
        cu = torch.cat([cu, cu[-1:] + fill])
        padded = torch.cat([padded, padded.new_tensor([length])])
    out = {k: cp_partition.partition(v, padded, cp, rank, dim=1) for k, v in out.items()}
    out.update(per_row)
    out["cu_seqlens"], out["cu_seqlens_padded"] = cu, padded
    out["max_seqlen"] = (padded[1:] - padded[:-1]).max().reshape(1)
    return out


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
                 labels=flat["labels"], packed_seq_params=packed_seq_params_for(batch))
