"""Acceptance (issue 22, CPU): the context-parallel partition of a packed THD batch (sequences of
odd lengths) equals a hand-built expectation and Transformer Engine's order; unpartitioning
restores it; loss-carrying tokens are preserved; position ids travel with their tokens.

References are literal lists written by hand, TE's own test case, a loop written here, and
mcore's THD RoPE slicing (`_get_thd_freqs_on_this_cp_rank`), never the code under test.
"""

import importlib.util
import random

import pytest
import torch
from megatron.core.models.common.embeddings.rope_utils import _get_thd_freqs_on_this_cp_rank

from lightning_mcore.sequence.cp_partition import (
    pad,
    pad_for_cp,
    partition,
    partition_indices,
    unpad,
    unpartition,
)
from lightning_mcore.sequence.packing import cu_seqlens_of

CU = torch.tensor([0, 5, 8, 16], dtype=torch.int32)  # sequences a, b, c of 5, 3, 8 tokens


def reference_indices(lengths, cp, rank):
    """Each length padded up to a multiple of 2*cp, cut into 2*cp chunks; the rank takes chunk
    `rank`, then chunk 2*cp-1-rank, of every sequence in order."""
    out, start = [], 0
    for n in lengths:
        padded = -(-n // (2 * cp)) * 2 * cp
        size = padded // (2 * cp)
        chunks = [list(range(start + k * size, start + (k + 1) * size)) for k in range(2 * cp)]
        out += chunks[rank] + chunks[2 * cp - 1 - rank]
        start += padded
    return out


def cu_of(lengths):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)


def test_hand_built_cp2():
    cu_p = pad_for_cp(CU, 2)
    assert cu_p.dtype == torch.int32 and cu_p.tolist() == [0, 8, 12, 20]
    # padded layout: a0-a4 at 0-4 (pads 5-7), b0-b2 at 8-10 (pad 11), c0-c7 at 12-19
    assert partition_indices(cu_p, 2, 0).tolist() == [0, 1, 6, 7, 8, 11, 12, 13, 18, 19]
    assert partition_indices(cu_p, 2, 1).tolist() == [2, 3, 4, 5, 9, 10, 14, 15, 16, 17]

    tokens = torch.arange(16)[None]  # token i is the i-th of the unpadded batch; -1 marks a pad
    padded = pad(tokens, CU, cu_p, dim=1, value=-1)
    assert padded.tolist() == [[0, 1, 2, 3, 4, -1, -1, -1, 5, 6, 7, -1,
                                8, 9, 10, 11, 12, 13, 14, 15]]
    assert partition(padded, cu_p, 2, 0, dim=1).tolist() == [[0, 1, -1, -1, 5, -1, 8, 9, 14, 15]]
    assert partition(padded, cu_p, 2, 1, dim=1).tolist() == [[2, 3, 4, -1, 6, 7, 10, 11, 12, 13]]


def test_transformer_engines_own_case():
    # TE tests/pytorch/attention/test_cp_utils.py: thd_get_partitioned_indices([0, 8, 16], 16, 2, r)
    cu_p = torch.tensor([0, 8, 16], dtype=torch.int32)
    assert partition_indices(cu_p, 2, 0).tolist() == [0, 1, 6, 7, 8, 9, 14, 15]
    assert partition_indices(cu_p, 2, 1).tolist() == [2, 3, 4, 5, 10, 11, 12, 13]


def test_cp1_is_the_identity():
    assert torch.equal(pad_for_cp(CU, 1), CU)
    x = torch.randn(16, 2, 3)
    assert torch.equal(partition(pad(x, CU, CU, dim=0), CU, 1, 0, dim=0), x)
    assert torch.equal(unpartition([x], CU, 1, dim=0), x)


def test_cp4_odd_lengths_match_a_loop():
    lengths = [7, 1, 13, 9, 3, 17]
    cu_p = pad_for_cp(cu_of(lengths), 4)
    padded = [-(-n // 8) * 8 for n in lengths]
    assert cu_p.tolist() == [0] + torch.tensor(padded).cumsum(0).tolist()
    for rank in range(4):
        assert partition_indices(cu_p, 4, rank).tolist() == reference_indices(lengths, 4, rank)


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_unpartition_restores_the_batch(cp):
    rng = random.Random(cp)
    for _ in range(5):
        lengths = [2 * rng.randint(0, 12) + 1 for _ in range(rng.randint(1, 6))]
        cu = cu_of(lengths)
        cu_p = pad_for_cp(cu, cp)
        held = torch.cat([partition_indices(cu_p, cp, r) for r in range(cp)])
        assert sorted(held.tolist()) == list(range(int(cu_p[-1])))  # every position exactly once
        for x, dim in ((torch.randn(int(cu[-1]), 2, 3), 0), (torch.randint(0, 500, (1, int(cu[-1]))), 1),
                       (torch.randn(2, int(cu[-1])), -1)):
            padded = pad(x, cu, cu_p, dim=dim, value=7)
            parts = [partition(padded, cu_p, cp, r, dim=dim) for r in range(cp)]
            assert all(p.size(dim) == int(cu_p[-1]) // cp for p in parts)
            back = unpartition(parts, cu_p, cp, dim=dim)
            assert torch.equal(back, padded)
            assert torch.equal(unpad(back, cu, cu_p, dim=dim), x)


def packed_batch():
    """A [2, 16] microbatch of odd-length samples with row padding, as the THD row forward_packed
    builds, with labels, a loss mask and positions restarting per sample."""
    segment_ids = torch.tensor([[1, 1, 1, 1, 1, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 0],
                                [1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2]])
    gen = torch.Generator().manual_seed(3)
    loss_mask = (torch.rand(2, 16, generator=gen) < 0.7).float()
    loss_mask[0, 15] = 0
    positions = []
    for row in segment_ids.tolist():
        for i, s in enumerate(row):
            positions.append(0 if i == 0 or row[i - 1] != s else positions[-1] + 1)
    batch = {"tokens": torch.arange(32)[None], "labels": torch.randint(1, 500, (1, 32), generator=gen),
             "loss_mask": loss_mask.reshape(1, -1), "position_ids": torch.tensor([positions])}
    return batch, cu_seqlens_of(segment_ids)


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_token_counts_are_preserved(cp):
    batch, cu = packed_batch()
    assert cu.tolist() == [0, 5, 8, 15, 16, 25, 32]
    cu_p = pad_for_cp(cu, cp)
    padded = {k: pad(v, cu, cu_p, dim=1, value=-1 if k == "tokens" else 0) for k, v in batch.items()}
    parts = [{k: partition(v, cu_p, cp, r, dim=1) for k, v in padded.items()} for r in range(cp)]

    assert sum(p["loss_mask"].sum() for p in parts) == batch["loss_mask"].sum()
    assert sum(int((p["tokens"] >= 0).sum()) for p in parts) == 32
    for p in parts:
        is_pad = p["tokens"] < 0
        assert (p["loss_mask"][is_pad] == 0).all()
        real = p["tokens"][~is_pad]  # each real token keeps its own label and loss mask
        assert torch.equal(p["labels"][~is_pad], batch["labels"][0, real])
        assert torch.equal(p["loss_mask"][~is_pad], batch["loss_mask"][0, real])


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_position_ids_travel_with_their_tokens(cp):
    batch, cu = packed_batch()
    cu_p = pad_for_cp(cu, cp)
    tokens = pad(batch["tokens"], cu, cu_p, dim=1, value=-1)
    positions = pad(batch["position_ids"], cu, cu_p, dim=1, value=0)
    padded_lengths = (cu_p[1:] - cu_p[:-1]).tolist()
    for rank in range(cp):
        held_tokens = partition(tokens, cu_p, cp, rank, dim=1)[0]
        held_positions = partition(positions, cu_p, cp, rank, dim=1)[0]
        real = held_tokens >= 0
        assert torch.equal(held_positions[real], batch["position_ids"][0, held_tokens[real]])
        # mcore's THD RoPE under CP takes each sequence's positions from cu_seqlens_padded
        freqs = torch.arange(max(padded_lengths))
        rope = torch.cat([_get_thd_freqs_on_this_cp_rank(rank, cp, torch.empty(n // cp), freqs)
                          for n in padded_lengths])
        assert torch.equal(held_positions[real], rope[real])


def test_bad_inputs_are_refused():
    cu_p = pad_for_cp(CU, 2)
    for cp in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match=r"cp \(the context parallel size\) must be an integer >= 1"):
            pad_for_cp(CU, cp)
        with pytest.raises(ValueError, match="cp"):
            partition_indices(cu_p, cp, 0)
    with pytest.raises(ValueError, match="cu_seqlens must start at 0, got 2"):
        pad_for_cp(torch.tensor([2, 5, 8], dtype=torch.int32), 2)
    with pytest.raises(ValueError, match=r"strictly increasing .* cu_seqlens\[2\] = 5 after 5"):
        pad_for_cp(torch.tensor([0, 5, 5, 8], dtype=torch.int32), 2)
    with pytest.raises(ValueError, match=r"strictly increasing .* cu_seqlens\[2\] = 3 after 5"):
        pad_for_cp(torch.tensor([0, 5, 3], dtype=torch.int32), 2)
    with pytest.raises(ValueError, match="1-D tensor of offsets"):
        pad_for_cp(CU[None], 2)
    with pytest.raises(ValueError, match="must hold integers"):
        pad_for_cp(CU.float(), 2)
    with pytest.raises(ValueError, match=r"rank must be an integer in \[0, cp=2\), got 2"):
        partition_indices(cu_p, 2, 2)
    with pytest.raises(ValueError, match="sequence 0 has 5 tokens, not a multiple of 2\\*cp = 4; pad"):
        partition_indices(CU, 2, 0)
    with pytest.raises(ValueError, match="has 16 tokens along dim 1, cu_seqlens_padded"):
        partition(torch.zeros(1, 16), cu_p, 2, 0, dim=1)
    with pytest.raises(ValueError, match="has 15 tokens along dim 0, cu_seqlens"):
        pad(torch.zeros(15), CU, cu_p, dim=0)
    with pytest.raises(ValueError, match="shorter than in cu_seqlens"):
        pad(torch.zeros(16), CU, torch.tensor([0, 4, 8, 16], dtype=torch.int32), dim=0)
    with pytest.raises(ValueError, match="one part per CP rank: 2, got 1"):
        unpartition([torch.zeros(10)], cu_p, 2, dim=0)
    with pytest.raises(ValueError, match="rank 1's share"):
        unpartition([torch.zeros(10), torch.zeros(9)], cu_p, 2, dim=0)


@pytest.mark.gpu
@pytest.mark.skipif(importlib.util.find_spec("transformer_engine_torch") is None, reason="needs TE")
def test_matches_transformer_engine_on_gpu():
    import transformer_engine_torch as tex

    for lengths, cp in (([5, 3, 8], 2), ([7, 1, 13, 9, 3, 17], 4), ([11, 2, 6], 3), ([1], 8)):
        cu_p = pad_for_cp(cu_of(lengths), cp).cuda()
        for rank in range(cp):
            theirs = tex.thd_get_partitioned_indices(cu_p, int(cu_p[-1]), cp, rank)
            assert torch.equal(partition_indices(cu_p, cp, rank), theirs.long())
