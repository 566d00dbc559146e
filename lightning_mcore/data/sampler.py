"""Megatron-style data-parallel sampler that resumes mid-epoch from a sample count."""

from __future__ import annotations

from typing import Any, Iterator

import torch
from torch.utils.data import DistributedSampler


class DataParallelSampler(DistributedSampler):
    """Yield this data-parallel rank's sample indices, global batch after global batch.

    Every optimizer step consumes one global batch of ``batch_size * dp_size`` samples;
    rank ``r`` reads the ``r``-th slice of ``batch_size`` indices of it. The position is one
    number, ``consumed_samples`` (global samples consumed so far), so a run resumed at
    ``global_step * global_batch_size`` continues exactly where it stopped, even mid-epoch.

    An epoch is ``num_samples`` rounded down to whole global batches (rounded up, padded
    with the epoch's first samples, when ``drop_last=False``, so every rank keeps the same
    step count). With ``shuffle`` each epoch is permuted by ``torch.Generator`` seeded with
    ``seed + epoch``, identically on all ranks.

    ``__iter__`` yields the rest of the current epoch and advances ``consumed_samples`` by a
    global batch as each batch starts, so the next ``iter()`` starts the next epoch. It subclasses
    ``DistributedSampler`` only so Lightning's ``use_distributed_sampler`` leaves it in place.
    """

    def __init__(
        self,
        num_samples: int,
        batch_size: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        shuffle: bool = True,
        seed: int = 0,
        consumed_samples: int = 0,
        drop_last: bool = True,
    ) -> None:
        if batch_size < 1 or dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise ValueError(
                f"need batch_size >= 1 and 0 <= dp_rank < dp_size, got batch_size={batch_size}, "
                f"dp_rank={dp_rank}, dp_size={dp_size}"
            )
        if consumed_samples < 0:
            raise ValueError(f"consumed_samples must be >= 0, got {consumed_samples}")
        self.total_samples = int(num_samples)
        self.batch_size = int(batch_size)
        self.rank, self.num_replicas = int(dp_rank), int(dp_size)
        self.shuffle, self.seed, self.drop_last = bool(shuffle), int(seed), bool(drop_last)
        self.global_batch_size = self.batch_size * self.num_replicas
        full, rest = divmod(self.total_samples, self.global_batch_size)
        self.epoch_samples = (full + (rest > 0 and not drop_last)) * self.global_batch_size
        if self.epoch_samples == 0:
            raise ValueError(
                f"{self.total_samples} samples cannot fill one global batch of "
                f"{self.global_batch_size} (batch_size={self.batch_size} "
                f"x dp_size={self.num_replicas})"
            )
        self.consumed_samples = int(consumed_samples)

    @property
    def epoch(self) -> int:
        """The data epoch ``consumed_samples`` falls in."""
        return self.consumed_samples // self.epoch_samples

    def set_epoch(self, epoch: int) -> None:
        """Ignored: the epoch follows from ``consumed_samples`` (Lightning calls this)."""

    def _epoch_order(self, epoch: int) -> torch.Tensor:
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + epoch)
            order = torch.randperm(self.total_samples, generator=generator)
        else:
            order = torch.arange(self.total_samples)
        repeats = -(-self.epoch_samples // self.total_samples)  # > 1 only to pad (drop_last=False)
        return order.repeat(repeats)[: self.epoch_samples]

    def __iter__(self) -> Iterator[int]:
        epoch = self.epoch
        order = self._epoch_order(epoch)
        epoch_start = epoch * self.epoch_samples
        begin = self.consumed_samples - epoch_start
        while begin + self.global_batch_size <= self.epoch_samples:
            self.consumed_samples = epoch_start + begin + self.global_batch_size
            mine = begin + self.rank * self.batch_size
            yield from order[mine : mine + self.batch_size].tolist()
            begin += self.global_batch_size
        # A position that is not a whole number of global batches (the global batch size
        # changed on resume) leaves a short tail: skip it rather than split it unevenly.
        self.consumed_samples = epoch_start + self.epoch_samples

    def __len__(self) -> int:
        position = self.consumed_samples % self.epoch_samples
        return (self.epoch_samples - position) // self.global_batch_size * self.batch_size

    def state_dict(self) -> dict[str, Any]:
        return {"consumed_samples": self.consumed_samples}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.consumed_samples = int(state_dict["consumed_samples"])
