"""Fitting tokenized conversations into rows of ``seq_length`` tokens (pure functions).

A row is a dict of ``[S]`` tensors:

* ``tokens`` (int64): the samples back to back, then padding;
* ``labels`` (int64): the next token *of the same sample*; the last position of each sample and
  padding hold the pad id;
* ``loss_mask`` (float32): 1 at ``i`` iff ``labels[i]`` is an assistant token of the sample;
* ``position_ids`` (int64): 0, 1, ... restarting at each sample; 0 on padding;
* ``segment_ids`` (int64): 1..k for the row's k samples in order, 0 on padding.

A sample of length ``L <= S`` occupies exactly ``L`` positions, so no prediction crosses from one
sample into the next; keeping samples from attending to each other is up to the model, which
reads ``segment_ids``/``position_ids``.
"""

from __future__ import annotations

import bisect
from collections import Counter
from typing import Sequence

import numpy as np
import torch

TRUNCATION = ("drop", "truncate")


def fit_samples(
    lengths: Sequence[int], first_loss: Sequence[int], seq_length: int, truncation: str = "drop"
) -> tuple[np.ndarray, np.ndarray, Counter, int]:
    """(kept indices, their lengths after truncation, dropped counts by reason, truncated count).

    ``first_loss[i]`` is the position of sample ``i``'s first assistant token after position 0
    (the first one a prediction can target; ``lengths[i]`` if none). Samples longer than
    ``seq_length`` are dropped, or with ``truncation="truncate"`` cut to their first
    ``seq_length`` tokens unless no assistant token would remain.
    """
    if truncation not in TRUNCATION:
        raise ValueError(f"truncation must be one of {TRUNCATION}, got {truncation!r}")
    lengths, first = np.asarray(lengths, dtype=np.int64), np.asarray(first_loss, dtype=np.int64)
    no_target = first >= lengths
    long = (lengths > seq_length) & ~no_target
    if truncation == "drop":
        lost, truncated = long, 0
        reason = f"longer than seq_length={seq_length}"
    else:
        lost = long & (first >= seq_length)
        truncated = int((long & ~lost).sum())
        reason = f"no assistant token in the first seq_length={seq_length} tokens"
    dropped = Counter({"no assistant token": int(no_target.sum()), reason: int(lost.sum())})
    keep = np.flatnonzero(~(no_target | lost))
    return keep, np.minimum(lengths[keep], seq_length), +dropped, truncated


def pack(lengths: Sequence[int], seq_length: int) -> list[list[int]]:
    """Rows of sample indices by best-fit decreasing: the longest sample first, each into the
    fullest row it still fits (ties: the earliest row), else a new row. Deterministic; within a
    row the samples keep their dataset order."""
    if any(n > seq_length or n < 1 for n in lengths):
        raise ValueError(f"every length must be in [1, seq_length={seq_length}]")
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])  # stable: ties in index order
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []  # sorted (room left, row)
    for i in order:
        slot = bisect.bisect_left(free, (lengths[i], -1))
        if slot == len(free):
            rows.append([i])
            bisect.insort(free, (seq_length - lengths[i], len(rows) - 1))
        else:
            room, row = free.pop(slot)
            rows[row].append(i)
            bisect.insort(free, (room - lengths[i], row))
    return [sorted(row) for row in rows]


def efficiency(lengths: Sequence[int], rows: Sequence[Sequence[int]], seq_length: int) -> float:
    """Real tokens over the ``len(rows) * seq_length`` positions they fill."""
    used = sum(lengths[i] for row in rows for i in row)
    return used / (len(rows) * seq_length) if rows else 0.0


def build_row(
    samples: Sequence[tuple[Sequence[int], Sequence[int]]], seq_length: int, pad_id: int
) -> dict[str, torch.Tensor]:
    """One row from ``(input_ids, assistant_mask)`` samples, in order, padded to ``seq_length``."""
    row = {
        "tokens": torch.full((seq_length,), pad_id, dtype=torch.int64),
        "labels": torch.full((seq_length,), pad_id, dtype=torch.int64),
        "loss_mask": torch.zeros(seq_length, dtype=torch.float32),
        "position_ids": torch.zeros(seq_length, dtype=torch.int64),
        "segment_ids": torch.zeros(seq_length, dtype=torch.int64),
    }
    start = 0
    for segment, (ids, mask) in enumerate(samples, 1):
        n, stop = len(ids), start + len(ids)
        if len(mask) != n or stop > seq_length:
            raise ValueError(f"samples of {n} tokens ({len(mask)} mask) overflow {seq_length}")
        ids_t = torch.as_tensor(ids, dtype=torch.int64)
        row["tokens"][start:stop] = ids_t
        row["labels"][start : stop - 1] = ids_t[1:]
        row["loss_mask"][start : stop - 1] = torch.as_tensor(mask, dtype=torch.float32)[1:]
        row["position_ids"][start:stop] = torch.arange(n)
        row["segment_ids"][start:stop] = segment
        start = stop
    return row
