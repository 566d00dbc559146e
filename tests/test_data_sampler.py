"""DataParallelSampler: global batches split across ranks, exact mid-epoch resume, reshuffles."""

import itertools

import pytest
import torch
from torch.utils.data import DistributedSampler

from lightning_mcore.data import DataParallelSampler


def epochs(sampler, n):
    """Indices of ``n`` successive ``iter()`` calls, one list per call."""
    return [list(sampler) for _ in range(n)]


def test_sequential_global_batches_are_split_by_rank():
    # 50 samples, B=3, dp=4: global batch k is samples 12k..12k+11; rank r reads 12k+3r..12k+3r+2.
    per_rank = [list(DataParallelSampler(50, 3, r, 4, shuffle=False)) for r in range(4)]
    for r, indices in enumerate(per_rank):
        expected = [12 * k + 3 * r + i for k in range(4) for i in range(3)]  # 48 usable samples
        assert indices == expected


@pytest.mark.parametrize("dp_size", [1, 2, 4])
def test_shuffled_ranks_cover_each_global_batch_without_overlap(dp_size):
    batch, seed = 3, 11
    samplers = [
        DataParallelSampler(50, batch, r, dp_size, shuffle=True, seed=seed) for r in range(dp_size)
    ]
    per_rank = [list(s) for s in samplers]
    perm = torch.randperm(50, generator=torch.Generator().manual_seed(seed)).tolist()
    gbs = batch * dp_size
    for step in range(50 // gbs):
        slices = [indices[step * batch : (step + 1) * batch] for indices in per_rank]
        union = [i for s in slices for i in s]
        assert len(set(union)) == gbs  # no overlap between ranks
        assert union == perm[step * gbs : (step + 1) * gbs]


def test_len_counts_what_this_rank_yields_from_the_position():
    sampler = DataParallelSampler(50, 3, 1, 4)  # 4 global steps of 12 per epoch
    assert len(sampler) == 12 == len(list(sampler))
    resumed = DataParallelSampler(50, 3, 1, 4, consumed_samples=24)
    assert len(resumed) == 6 == len(list(resumed))


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("steps", [0, 1, 3, 4, 6, 9])
def test_resume_yields_the_tail_of_an_uninterrupted_run(shuffle, steps):
    batch, dp_size = 2, 3  # 20 samples -> 3 global steps of 6 per epoch
    for rank in range(dp_size):
        full = [
            i
            for e in epochs(DataParallelSampler(20, batch, rank, dp_size, shuffle, seed=5), 4)
            for i in e
        ]
        resumed = DataParallelSampler(
            20, batch, rank, dp_size, shuffle, seed=5, consumed_samples=steps * 6
        )
        tail = [i for e in epochs(resumed, 4) for i in e]
        assert tail[: len(full) - steps * batch] == full[steps * batch :]


def test_epochs_reshuffle_and_keep_the_same_samples():
    first, second = epochs(DataParallelSampler(64, 8, shuffle=True, seed=0), 2)
    assert first != second
    assert sorted(first) == sorted(second) == list(range(64))


def test_state_dict_counts_global_batches_handed_out():
    sampler = DataParallelSampler(100, 4, 0, 2)
    list(itertools.islice(iter(sampler), 3 * 4))  # three batches of this rank
    assert sampler.state_dict() == {"consumed_samples": 3 * 8}
    other = DataParallelSampler(100, 4, 0, 2)
    other.load_state_dict(sampler.state_dict())
    assert list(other) == list(sampler)  # both continue from step 3


def test_position_between_global_batches_continues_exactly():
    # 10 samples were consumed under another global batch size; gbs=4 now starts at 10
    sampler = DataParallelSampler(24, 2, 0, 2, shuffle=False, consumed_samples=10)
    assert list(sampler) == [10, 11, 14, 15, 18, 19]
    assert sampler.consumed_samples == 24  # the short tail is skipped, next iter is epoch 1
    assert list(sampler)[:2] == [0, 1]


def test_drop_last_false_pads_the_last_global_batch_from_the_epoch_start():
    ranks = [
        list(DataParallelSampler(10, 3, r, 2, shuffle=False, drop_last=False)) for r in range(2)
    ]
    assert ranks == [[0, 1, 2, 6, 7, 8], [3, 4, 5, 9, 0, 1]]


def test_errors_name_the_numbers():
    with pytest.raises(ValueError, match="5 samples cannot fill one global batch of 6"):
        DataParallelSampler(5, 3, 0, 2)
    with pytest.raises(ValueError, match="dp_rank"):
        DataParallelSampler(50, 3, 2, 2)


def test_lightning_keeps_it_and_set_epoch_is_ignored():
    sampler = DataParallelSampler(20, 2, shuffle=True)
    assert isinstance(sampler, DistributedSampler)  # Lightning does not wrap it again
    before = list(sampler)
    sampler.set_epoch(0)  # Lightning calls this every epoch: must not rewind
    assert sampler.epoch == 1 and list(sampler) != before
