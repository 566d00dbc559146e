"""Acceptance (issue 22, CPU): context parallelism for packed SFT rows. A hand-built packed
microbatch (2 rows, samples of odd lengths) split for cp=2 gives each rank the tokens, labels,
loss mask and position ids written out by hand here and by model/cp_partition; the offsets that
PackedSeqParams carries are the hand-computed ones; the loss-carrying tokens of all ranks are the
original ones, so summed losses over summed counts equal the unsplit row's.

References are literal lists written by hand and cp_partition (verified against Transformer
Engine's order in test_cp_partition), never the slicing under test.
"""

import pytest
import torch

from lightning_mcore.sequence import cp_partition
from lightning_mcore.sequence.packing import (
    cp_row_length,
    packed_context_parallel_slice,
    packed_seq_params,
    packed_seq_params_for,
)
from lightning_mcore.objectives.loss import masked_token_loss

# row 0: samples a (3 tokens), b (5); row 1: sample c (7), then 1 pad token d (segment 0)
SEGMENTS = torch.tensor([[1, 1, 1, 2, 2, 2, 2, 2],
                         [1, 1, 1, 1, 1, 1, 1, 0]])
TOKENS = torch.tensor([[10, 11, 12, 13, 14, 15, 16, 17],
                       [20, 21, 22, 23, 24, 25, 26, 27]])
LOSS_MASK = torch.tensor([[0, 1, 1, 0, 1, 1, 1, 1],
                          [0, 0, 1, 1, 1, 1, 1, 0]])
POSITIONS = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4],
                          [0, 1, 2, 3, 4, 5, 6, 0]])
CU = [0, 3, 8, 15, 16]  # a, b, c, d
CU_PADDED = [0, 4, 12, 20, 24]  # padded to multiples of 2*cp = 4: 4, 8, 8, 4


def micro():
    return {"tokens": TOKENS, "labels": TOKENS + 100, "loss_mask": LOSS_MASK,
            "position_ids": POSITIONS, "segment_ids": SEGMENTS}


# Chunks of 1, 2, 2, 1 tokens per sequence; rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2:
#   a: [10][11][12][_]   b: [13 14][15 16][17 _][_ _]   c: [20 21][22 23][24 25][26 _]   d: [27][_][_][_]
HAND_TOKENS = {0: [10, 0, 13, 14, 0, 0, 20, 21, 26, 0, 27, 0],
               1: [11, 12, 15, 16, 17, 0, 22, 23, 24, 25, 0, 0]}
HAND_LOSS_MASK = {0: [0, 0, 0, 1, 0, 0, 0, 0, 1, 0, 0, 0],
                  1: [1, 1, 1, 1, 1, 0, 1, 1, 1, 1, 0, 0]}
HAND_POSITIONS = {0: [0, 0, 0, 1, 0, 0, 0, 1, 6, 0, 0, 0],
                  1: [1, 2, 2, 3, 4, 0, 2, 3, 4, 5, 0, 0]}


@pytest.mark.parametrize("rank", [0, 1])
def test_rank_share_matches_hand_layout_and_cp_partition(rank):
    got = packed_context_parallel_slice(micro(), cp=2, rank=rank)
    assert got["tokens"].tolist() == [HAND_TOKENS[rank]]
    assert got["labels"].tolist() == [[t + 100 if t else 0 for t in HAND_TOKENS[rank]]]
    assert got["loss_mask"].tolist() == [HAND_LOSS_MASK[rank]]
    assert got["position_ids"].tolist() == [HAND_POSITIONS[rank]]
    assert got["cu_seqlens"].tolist() == CU and got["cu_seqlens_padded"].tolist() == CU_PADDED
    assert got["cu_seqlens"].dtype == got["cu_seqlens_padded"].dtype == torch.int32
    assert int(got["max_seqlen"]) == 8
    cu, padded = torch.tensor(CU), torch.tensor(CU_PADDED)
    for key, value in micro().items():
        want = cp_partition.partition(cp_partition.pad(value.reshape(-1), cu, padded, 0), padded, 2, rank, 0)
        assert got[key].tolist() == [want.tolist()], key


def test_union_of_loss_tokens_over_ranks_is_the_original():
    shares = [packed_context_parallel_slice(micro(), 2, r) for r in range(2)]

    def carried(m):
        keep = m["loss_mask"].reshape(-1).bool()
        return sorted(zip(*(m[k].reshape(-1)[keep].tolist() for k in ("tokens", "labels", "position_ids"))))

    assert sorted(sum((carried(s) for s in shares), [])) == carried(micro())
    padded = torch.tensor(CU_PADDED)
    joined = cp_partition.unpartition([s["tokens"][0] for s in shares], padded, 2, 0)
    assert cp_partition.unpad(joined, torch.tensor(CU), padded, 0).tolist() == TOKENS.reshape(-1).tolist()


def test_summed_losses_over_ranks_equal_the_unsplit_row():
    """The data-parallel x cp reduction adds every rank's (loss sum, token count); any per-token
    loss of (token, label, position) gives the cp=1 mean."""
    def token_losses(m):
        return (m["tokens"] * 0.37 + m["labels"] * 0.011 + m["position_ids"] * 0.5).float().sin()

    whole = packed_context_parallel_slice(micro(), 1, 0)
    total, count, _ = masked_token_loss(token_losses(whole), whole["loss_mask"])
    parts = [packed_context_parallel_slice(micro(), 2, r) for r in range(2)]
    sums = [masked_token_loss(token_losses(p), p["loss_mask"]) for p in parts]
    assert sum(int(c) for _, c, _ in sums) == int(count) == int(LOSS_MASK.sum()) != 0
    assert torch.allclose(sum(t for t, _, _ in sums) / count, total / count)
    assert [int(c) for _, c, _ in sums] == [2, 9]  # ranks hold different numbers of real tokens


def test_packed_seq_params_carry_padded_offsets():
    share = packed_context_parallel_slice(micro(), 2, 1)
    params = packed_seq_params_for(share)
    assert params.qkv_format == "thd"
    assert params.cu_seqlens_q.tolist() == params.cu_seqlens_kv.tolist() == CU
    assert params.cu_seqlens_q_padded.tolist() == params.cu_seqlens_kv_padded.tolist() == CU_PADDED
    assert params.max_seqlen_q == params.max_seqlen_kv == 8
    # without context parallelism: from segment_ids, as before (longest real sequence, c's 7)
    plain = packed_seq_params_for(micro())
    assert plain.cu_seqlens_q.tolist() == CU and plain.cu_seqlens_q_padded is None
    assert plain.max_seqlen_q == packed_seq_params(SEGMENTS).max_seqlen_q == 7


def test_filled_to_a_common_length_with_a_pad_sequence():
    """A step's microbatches share one row length (pipeline tensor shape): the fill is one more
    sequence of pad tokens without loss, chunked like the others."""
    other = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8], [1, 1, 1, 1, 1, 1, 1, 1]])  # 8 x 1 token + 8
    assert cp_row_length([SEGMENTS], 2, 4) == 24
    assert cp_row_length([SEGMENTS, other], 2, 4) == 8 * 4 + 8  # a 1-token sample pads to 4
    assert cp_row_length([SEGMENTS], 2, 16) == 32  # x tensor parallel under sequence parallelism
    shares = [packed_context_parallel_slice(micro(), 2, r, length=32) for r in range(2)]
    assert shares[0]["cu_seqlens"].tolist() == CU + [24]
    assert shares[0]["cu_seqlens_padded"].tolist() == CU_PADDED + [32]
    assert int(shares[0]["max_seqlen"]) == 8
    for rank, share in enumerate(shares):  # the fill's 8 tokens: 2 chunks of 2 per rank, all pad
        assert share["tokens"].tolist() == [HAND_TOKENS[rank] + [0, 0, 0, 0]]
        assert share["loss_mask"].tolist() == [HAND_LOSS_MASK[rank] + [0, 0, 0, 0]]
    with pytest.raises(ValueError, match="at least the padded row"):
        packed_context_parallel_slice(micro(), 2, 0, length=20)
    with pytest.raises(ValueError, match="multiple of 2\\*cp"):
        packed_context_parallel_slice(micro(), 2, 0, length=26)


def test_packed_objectives_other_than_sft_and_dpo_refused_with_context_parallelism():
    from lightning_mcore import MegatronStrategy
    from lightning_mcore import DistillModule, GRPOModule, KTOModule
    from lightning_mcore.objectives.dpo import DPOModule
    from lightning_mcore.objectives.reward import RewardModule
    from lightning_mcore.objectives.sft import SFTModule
    from lightning_mcore.strategy.parallel import LayoutError

    strategy = MegatronStrategy(context_parallel_size=2, global_batch_size=4)
    strategy.parallel = strategy._requested_parallel
    strategy.refuse_packed_context_parallel(SFTModule.__new__(SFTModule))
    strategy.refuse_packed_context_parallel(DPOModule.__new__(DPOModule))
    for cls in (KTOModule, RewardModule, DistillModule, GRPOModule):
        with pytest.raises(LayoutError, match=f"context_parallel_size=2 with {cls.__name__}'s packed"):
            strategy.refuse_packed_context_parallel(cls.__new__(cls))
    cp1 = MegatronStrategy(global_batch_size=4)
    cp1.parallel = cp1._requested_parallel
    cp1.refuse_packed_context_parallel(DPOModule.__new__(DPOModule))


def test_schedule_shape_is_the_common_padded_row():
    from lightning_mcore import MegatronStrategy

    strategy = MegatronStrategy(context_parallel_size=2, global_batch_size=4, micro_batch_size=2)
    shares = [packed_context_parallel_slice(micro(), 2, 0, length=32)] * 2
    assert strategy._schedule_shape(8, True, shares) == (32, 1)  # mcore divides by cp: 16 per rank
    assert strategy._schedule_shape(8, True, [micro()]) == (16, 1)
    assert strategy._schedule_shape(8, False, [micro()]) == (8, 2)


@pytest.mark.parametrize("rank", [0, 1])
def test_strategy_fills_microbatches_to_one_length(monkeypatch, rank):
    """The packed path of MegatronStrategy._context_parallel_slices: every microbatch of a step
    padded to the longest padded row (here 40 tokens: eight 1-token samples pad to 4 each, + 8)."""
    from megatron.core import parallel_state

    from lightning_mcore import MegatronStrategy

    monkeypatch.setattr(parallel_state, "get_context_parallel_rank", lambda: rank)
    other = {k: v.clone() for k, v in micro().items()}
    other["segment_ids"] = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8], [1, 1, 1, 1, 1, 1, 1, 1]])
    other["position_ids"] = torch.tensor([[0] * 8, list(range(8))])
    strategy = MegatronStrategy(context_parallel_size=2, global_batch_size=4, micro_batch_size=2)
    strategy.parallel = strategy._requested_parallel
    got = strategy._context_parallel_slices([micro(), other], packed=True)
    for share, mb in zip(got, [micro(), other]):
        want = packed_context_parallel_slice(mb, 2, rank, length=40)
        assert share.keys() == want.keys()
        for key in want:
            assert torch.equal(share[key], want[key]), key
    assert got[0]["tokens"].shape == got[1]["tokens"].shape == (1, 20)
    assert got[0]["cu_seqlens_padded"].tolist() == CU_PADDED + [40]
    assert strategy._schedule_shape(8, True, got) == (40, 1)


def test_dpo_pair_sums_of_all_cp_shares_equal_the_whole_rows():
    """DPO under cp=2: each rank sums its share of every (row, chosen/rejected) sequence by the
    row_ids the split carries; the two ranks' sums add up to the sums over the whole rows,
    written out here by hand. Per-row tensors (the reference log-probs) reach both ranks whole."""
    from lightning_mcore.objectives.dpo import pair_sums

    # row 0: chosen = sample a (3 tokens), rejected = b (5); row 1: chosen c (7), rejected d (1)
    segments = torch.tensor([[1, 1, 1, 2, 2, 2, 2, 2], [1, 1, 1, 1, 1, 1, 1, 2]])
    reference = torch.tensor([[-1.0, -2.0], [-3.0, -4.0]])
    micro = {**{k: v for k, v in globals()["micro"]().items() if k != "segment_ids"},
             "segment_ids": segments, "ref_logps": reference}
    # a token loss that travels with its token: 0.01 * token id
    hand_sums = [[-(0.11 + 0.12), -(0.14 + 0.15 + 0.16 + 0.17)],  # loss-mask 1 tokens only
                 [-(0.22 + 0.23 + 0.24 + 0.25 + 0.26), 0.0]]
    hand_counts = [[2, 4], [5, 0]]
    total_sums, total_counts = torch.zeros(2, 2), torch.zeros(2, 2)
    for rank in (0, 1):
        share = packed_context_parallel_slice(micro, cp=2, rank=rank)
        assert torch.equal(share["ref_logps"], reference)
        sums, counts = pair_sums(share["tokens"].double() * 0.01, share, rows=2)
        total_sums += sums
        total_counts += counts
    torch.testing.assert_close(total_sums, torch.tensor(hand_sums), rtol=0, atol=1e-6)
    assert total_counts.tolist() == hand_counts
    whole_sums, whole_counts = pair_sums(TOKENS.double() * 0.01, micro)  # the unsplit path agrees
    torch.testing.assert_close(whole_sums, torch.tensor(hand_sums), rtol=0, atol=1e-6)
    assert whole_counts.tolist() == hand_counts
