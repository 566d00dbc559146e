"""How one mcore parameter is made from Hugging Face tensors, and back, under tensor parallelism.

Each transform states which dimension is sharded over tensor-parallel ranks and provides:
  `load(reader, names, rank, size, dims)`  this rank's shard, reading only the rows it needs
  `save(shards, names, dims)`              the full HF tensors from every rank's shard
`reader.get(name, dim, start, stop)` returns rows [start, stop) of an HF tensor along `dim`
(no bounds = the whole tensor); `reader.shape(name)` its full shape. The pure merge/split
helpers below are what the transforms are built from, and what the unit tests check.

Fused QKV (mcore) is interleaved per query group; tensor parallelism splits whole groups:

    groups g0 g1 | g2 g3        rank 0: [q(g0) k(g0) v(g0) q(g1) k(g1) v(g1)]
    q(g) = heads_per_group x head_dim rows, k(g) = v(g) = head_dim rows

With an output gate (Qwen3.5), HF's q_proj holds [q_h; gate_h] per head and mcore's group is
[q(g) gate(g) k(g) v(g)].

Fused SwiGLU fc1 holds [gate_i; up_i] on tensor-parallel rank i (not [gate; up] sliced), and
any projection made of several sections (linear attention's in_proj: q k v z b a) holds the
i-th slice of each section on rank i (`Sections`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol, Sequence

import torch


class Reader(Protocol):
    def get(self, name: str, dim: int = 0, start: Optional[int] = None,
            stop: Optional[int] = None) -> torch.Tensor: ...

    def shape(self, name: str) -> tuple: ...


@dataclass(frozen=True)
class Dims:
    """The sizes transforms need; `vocab` is the real vocab, `padded_vocab` the mcore one."""

    num_heads: int
    num_groups: int
    head_dim: int
    vocab: int
    padded_vocab: int


# ---------------------------------------------------------------- pure helpers
def qkv_merge(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_groups: int) -> torch.Tensor:
    """HF q/k/v (weights [rows, h] or biases [rows]) -> mcore's per-group interleaved QKV."""
    rest = q.shape[1:]
    q = q.reshape(num_groups, -1, *rest)
    k = k.reshape(num_groups, -1, *rest)
    v = v.reshape(num_groups, -1, *rest)
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest)


def qkv_split(fused: torch.Tensor, num_groups: int, head_dim: int):
    """Inverse of qkv_merge: -> (q, k, v)."""
    rest = fused.shape[1:]
    per_group = fused.reshape(num_groups, -1, *rest)
    q_rows = per_group.shape[1] - 2 * head_dim
    q, k, v = torch.split(per_group, [q_rows, head_dim, head_dim], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def gated_q_split(q: torch.Tensor, num_heads: int):
    """HF q_proj of an output-gated attention ([q_h; gate_h] per head) -> (q, gate)."""
    rest = q.shape[1:]
    pairs = q.reshape(num_heads, 2, -1, *rest)
    return pairs[:, 0].reshape(-1, *rest), pairs[:, 1].reshape(-1, *rest)


def gated_q_merge(q: torch.Tensor, gate: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Inverse of gated_q_split."""
    rest = q.shape[1:]
    pairs = torch.stack([q.reshape(num_heads, -1, *rest), gate.reshape(num_heads, -1, *rest)], dim=1)
    return pairs.reshape(-1, *rest)


def gate_up_shard(gate: torch.Tensor, up: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """mcore fc1 shard of rank `rank`: [gate_rank; up_rank]."""
    return torch.cat([gate.chunk(size)[rank], up.chunk(size)[rank]], dim=0)


def gate_up_unshard(shards: Sequence[torch.Tensor]):
    """All ranks' fc1 shards -> (gate, up)."""
    halves = [s.chunk(2) for s in shards]
    return torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])


# ---------------------------------------------------------------- transforms
class Transform:
    tp_dim: Optional[int] = None  # dimension split over tensor-parallel ranks; None: replicated

    def load(self, reader: Reader, names: Sequence[str], rank: int, size: int, dims: Dims) -> torch.Tensor:
        raise NotImplementedError

    def save(self, shards: Sequence[torch.Tensor], names: Sequence[str], dims: Dims) -> dict:
        raise NotImplementedError


class Replicated(Transform):
    """Same tensor on every rank (norms, router)."""

    def load(self, reader, names, rank, size, dims):
        return reader.get(names[0])

    def save(self, shards, names, dims):
        return {names[0]: shards[0]}


class Split(Transform):
    """Contiguous slice along `dim`: 0 for column-parallel, 1 for row-parallel linears."""

    def __init__(self, dim: int) -> None:
        self.tp_dim = dim

    def load(self, reader, names, rank, size, dims):
        step = reader.shape(names[0])[self.tp_dim] // size
        return reader.get(names[0], self.tp_dim, rank * step, (rank + 1) * step)

    def save(self, shards, names, dims):
        return {names[0]: torch.cat(list(shards), dim=self.tp_dim)}

    def __repr__(self) -> str:
        return f"Split({self.tp_dim})"


class Vocab(Transform):
    """Embedding / output rows, split over ranks after padding the vocab with zero rows."""

    tp_dim = 0

    def load(self, reader, names, rank, size, dims):
        step = dims.padded_vocab // size
        start, stop = rank * step, (rank + 1) * step
        rows = reader.get(names[0], 0, min(start, dims.vocab), min(stop, dims.vocab))
        pad = step - rows.shape[0]
        return torch.cat([rows, rows.new_zeros(pad, *rows.shape[1:])]) if pad else rows

    def save(self, shards, names, dims):
        return {names[0]: torch.cat(list(shards), dim=0)[: dims.vocab]}


class QKV(Transform):
    """q_proj, k_proj, v_proj (weights or biases) <-> linear_qkv, split by query groups."""

    tp_dim = 0

    def load(self, reader, names, rank, size, dims):
        g = dims.num_groups // size
        q_rows = dims.num_heads // dims.num_groups * dims.head_dim
        g0 = rank * g
        q = reader.get(names[0], 0, g0 * q_rows, (g0 + g) * q_rows)
        k = reader.get(names[1], 0, g0 * dims.head_dim, (g0 + g) * dims.head_dim)
        v = reader.get(names[2], 0, g0 * dims.head_dim, (g0 + g) * dims.head_dim)
        return qkv_merge(q, k, v, g)

    def save(self, shards, names, dims):
        q, k, v = qkv_split(torch.cat(list(shards)), dims.num_groups, dims.head_dim)
        return dict(zip(names, (q, k, v)))


class GatedQKV(Transform):
    """q_proj ([q_h; gate_h] per head), k_proj, v_proj <-> linear_qkv of mcore's output-gated
    attention ([q(g) gate(g) k(g) v(g)] per query group), split by query groups."""

    tp_dim = 0

    def load(self, reader, names, rank, size, dims):
        g = dims.num_groups // size
        heads = dims.num_heads // dims.num_groups * g  # this rank's
        rows = 2 * heads * dims.head_dim
        q, gate = gated_q_split(reader.get(names[0], 0, rank * rows, (rank + 1) * rows), heads)
        k = reader.get(names[1], 0, rank * g * dims.head_dim, (rank + 1) * g * dims.head_dim)
        v = reader.get(names[2], 0, rank * g * dims.head_dim, (rank + 1) * g * dims.head_dim)
        return _per_group([q, gate, k, v], g)

    def save(self, shards, names, dims):
        fused = torch.cat(list(shards))
        rest = fused.shape[1:]
        per_group = fused.reshape(dims.num_groups, -1, *rest)
        q_rows = (per_group.shape[1] - 2 * dims.head_dim) // 2
        q, gate, k, v = (t.reshape(-1, *rest) for t in torch.split(
            per_group, [q_rows, q_rows, dims.head_dim, dims.head_dim], dim=1))
        return dict(zip(names, (gated_q_merge(q, gate, dims.num_heads), k, v)))


def _per_group(parts: Sequence[torch.Tensor], groups: int) -> torch.Tensor:
    """Tensors whose rows are in `groups` equal blocks each -> the blocks interleaved by group."""
    rest = parts[0].shape[1:]
    return torch.cat([p.reshape(groups, -1, *rest) for p in parts], dim=1).reshape(-1, *rest)


class Sections(Transform):
    """A column-parallel projection made of sections, each a row range of one HF tensor:
    `parts` = ((tensor index, first row, rows), ...) in mcore's order. Rank i holds the i-th
    slice of every section, in that order (e.g. linear attention's in_proj: q k v z b a)."""

    tp_dim = 0

    def __init__(self, parts: Sequence[tuple[int, int, int]]) -> None:
        self.parts = tuple(tuple(p) for p in parts)

    def load(self, reader, names, rank, size, dims):
        pieces = []
        for index, start, rows in self.parts:
            step = rows // size
            pieces.append(reader.get(names[index], 0, start + rank * step, start + (rank + 1) * step))
        return torch.cat(pieces)

    def save(self, shards, names, dims):
        steps = [rows // len(shards) for _, _, rows in self.parts]
        per_rank = [torch.split(shard, steps) for shard in shards]
        full: dict[int, list] = {}  # HF tensor index -> [(first row, rows)]
        for i, (index, start, _) in enumerate(self.parts):
            full.setdefault(index, []).append((start, torch.cat([pieces[i] for pieces in per_rank])))
        return {names[index]: torch.cat([rows for _, rows in sorted(parts, key=lambda p: p[0])])
                for index, parts in full.items()}

    def __repr__(self) -> str:
        return f"Sections({self.parts})"


class KeyHeadGroups(Transform):
    """HF projections laid out per key head, g = 0..groups-1: tensor i holds for each g the
    sub-blocks of row sizes `blocks[i]` (Qwen3-Next's in_proj_qkvz [q_g k_g v_g z_g] and
    in_proj_ba [b_g a_g]) <-> mcore's sections, each sub-block kind over all of this rank's
    groups, in tensor then sub-block order (in_proj: [q | k | v | z | b | a]). TP splits whole
    key-head groups, dim 0."""

    tp_dim = 0

    def __init__(self, groups: int, blocks: Sequence[Sequence[int]]) -> None:
        self.groups, self.blocks = groups, tuple(tuple(b) for b in blocks)

    def load(self, reader, names, rank, size, dims):
        g = self.groups // size
        sections = []
        for name, blocks in zip(names, self.blocks):
            per = sum(blocks)
            rows = reader.get(name, 0, rank * g * per, (rank + 1) * g * per)
            grouped = rows.reshape(g, per, *rows.shape[1:])
            sections += [b.reshape(-1, *rows.shape[1:]) for b in torch.split(grouped, blocks, dim=1)]
        return torch.cat(sections)

    def save(self, shards, names, dims):
        g = self.groups // len(shards)
        sizes = [g * b for blocks in self.blocks for b in blocks]
        per_rank = [torch.split(shard, sizes) for shard in shards]
        out, first = {}, 0
        for name, blocks in zip(names, self.blocks):
            ranks = []
            for pieces in per_rank:
                mine = pieces[first:first + len(blocks)]
                rest = mine[0].shape[1:]
                ranks.append(torch.cat([p.reshape(g, -1, *rest) for p in mine], dim=1).reshape(-1, *rest))
            out[name] = torch.cat(ranks)
            first += len(blocks)
        return out

    def __repr__(self) -> str:
        return f"KeyHeadGroups({self.groups}, {self.blocks})"


class GateUp(Transform):
    """gate_proj, up_proj <-> linear_fc1 ([gate_i; up_i] on rank i)."""

    tp_dim = 0

    def load(self, reader, names, rank, size, dims):
        rows = reader.shape(names[0])[0] // size
        gate = reader.get(names[0], 0, rank * rows, (rank + 1) * rows)
        up = reader.get(names[1], 0, rank * rows, (rank + 1) * rows)
        return torch.cat([gate, up])

    def save(self, shards, names, dims):
        gate, up = gate_up_unshard(shards)
        return {names[0]: gate, names[1]: up}


def rope_rows_order(block: int, rope: int) -> torch.Tensor:
    """The HF row of each mcore row in one block whose last `rope` rows are RoPE'd: HF pairs
    rows i and i + rope/2 (rotate-half), mcore's multi-latent attention rows 2i and 2i + 1."""
    pairs = torch.arange(rope).view(2, rope // 2).t().reshape(-1)
    return torch.cat([torch.arange(block - rope), block - rope + pairs])


class RopeRows(Transform):
    """A column-parallel weight of rows in blocks (one per head, or a single one) that end in a
    RoPE part laid out for rotate-half (HF's `rope_interleave=False`), reordered for mcore's
    multi-latent attention, which rotates interleaved pairs. Split over TP along dim 0."""

    tp_dim = 0

    def __init__(self, block: int, rope: int) -> None:
        self.block, self.rope = block, rope
        self.order = rope_rows_order(block, rope)

    def _reorder(self, rows: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
        blocks = rows.reshape(-1, self.block, *rows.shape[1:])
        return blocks[:, order].reshape(rows.shape)

    def load(self, reader, names, rank, size, dims):
        step = reader.shape(names[0])[0] // size
        if step % self.block == 0:  # whole blocks per rank: read only this rank's
            return self._reorder(reader.get(names[0], 0, rank * step, (rank + 1) * step), self.order)
        return self._reorder(reader.get(names[0]), self.order)[rank * step:(rank + 1) * step]

    def save(self, shards, names, dims):
        return {names[0]: self._reorder(torch.cat(list(shards)), torch.argsort(self.order))}

    def __repr__(self) -> str:
        return f"RopeRows({self.block}, {self.rope})"


class InterleavedGateUp(Transform):
    """One fused gate_up tensor whose gate and up alternate along its output dimension
    (gate at even, up at odd positions) <-> linear_fc1 ([gate_i; up_i] on rank i). `transposed`:
    HF holds the weight as [in, out] (a bias is [out] either way)."""

    tp_dim = 0

    def __init__(self, transposed: bool = False) -> None:
        self.transposed = transposed

    def load(self, reader, names, rank, size, dims):
        fused = reader.get(names[0])
        fused = fused.t() if self.transposed else fused
        return gate_up_shard(fused[0::2], fused[1::2], rank, size).contiguous()

    def save(self, shards, names, dims):
        gate, up = gate_up_unshard(shards)
        fused = torch.stack([gate, up], dim=1).flatten(0, 1)
        return {names[0]: fused.t().contiguous() if self.transposed else fused}

    def __repr__(self) -> str:
        return f"InterleavedGateUp(transposed={self.transposed})"


class Transposed(Transform):
    """HF holds the weight as [in, out] (mcore [out, in]); split along mcore's `dim`."""

    def __init__(self, dim: int) -> None:
        self.tp_dim = dim

    def load(self, reader, names, rank, size, dims):
        step = reader.shape(names[0])[1 - self.tp_dim] // size
        return reader.get(names[0], 1 - self.tp_dim, rank * step, (rank + 1) * step).t().contiguous()

    def save(self, shards, names, dims):
        return {names[0]: torch.cat(list(shards), dim=self.tp_dim).t().contiguous()}

    def __repr__(self) -> str:
        return f"Transposed({self.tp_dim})"


class FusedQKV(Transform):
    """One HF tensor holding [q; k; v] rows (weights or biases) <-> linear_qkv, split by query
    groups as QKV does."""

    tp_dim = 0

    def load(self, reader, names, rank, size, dims):
        q_rows, kv_rows = dims.num_heads * dims.head_dim, dims.num_groups * dims.head_dim
        q, k, v = torch.split(reader.get(names[0]), [q_rows, kv_rows, kv_rows])
        g = dims.num_groups // size
        per_q = dims.num_heads // dims.num_groups * dims.head_dim
        rows = slice(rank * g * per_q, (rank + 1) * g * per_q)
        kv = slice(rank * g * dims.head_dim, (rank + 1) * g * dims.head_dim)
        return qkv_merge(q[rows], k[kv], v[kv], g)

    def save(self, shards, names, dims):
        return {names[0]: torch.cat(qkv_split(torch.cat(list(shards)), dims.num_groups, dims.head_dim))}
