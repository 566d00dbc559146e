"""Feeding a map-style dataset to each data-parallel rank of MegatronStrategy, resumably.

Shared by every data module of the library: the per-rank batch comes from
``trainer.strategy.data_parallel_batch_size``, the rank's slice of each global batch from
``DataParallelSampler``, and the position from the trainer's step, so a resumed run continues
where it stopped. Subclasses set ``train_dataset``/``val_dataset`` in ``setup`` and have the
hyperparameters ``seq_length``, ``seed``, ``shuffle`` and ``num_workers``.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, Optional, Union

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

from lightning_mcore.data.preprocess import load_tokenizer
from lightning_mcore.data.sampler import DataParallelSampler


def _layout(trainer: Any, owner: str = "the data module") -> tuple[int, int, int]:
    """(dp_rank, dp_size, per-rank batch size B) from the strategy's public attributes."""
    if trainer is None:
        raise RuntimeError(f"{owner} must be attached to a Trainer to build dataloaders")
    strategy = trainer.strategy
    batch_size = getattr(strategy, "data_parallel_batch_size", None)
    if batch_size is None:
        raise TypeError(
            f"{owner} needs lightning_mcore.MegatronStrategy, got "
            f"{type(strategy).__name__}: it reads the per-rank batch size from "
            "strategy.data_parallel_batch_size"
        )
    kwargs = getattr(strategy, "distributed_sampler_kwargs", None) or {}
    return int(kwargs.get("rank", 0)), int(kwargs.get("num_replicas", 1)), int(batch_size)


class _SeatedLoader(DataLoader):
    """DataLoader that puts its sampler at ``position()`` on every ``iter()``.

    The sampler's own counter runs ahead of training when an iterator is dropped early (worker
    prefetch, ``limit_val_batches``, ``max_steps``); re-reading the trainer's step avoids that.
    """

    def __init__(self, *args: Any, position: Callable[[], int] = lambda: 0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._position = position

    def __iter__(self):
        if isinstance(self.sampler, DataParallelSampler):
            self.sampler.consumed_samples = self._position()
        return super().__iter__()

    def state_dict(self) -> dict[str, int]:
        """Marks the loader resumable for Lightning; the position returns with the trainer step."""
        return {"consumed_samples": self._position()}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        """Nothing to restore: ``position()`` follows the restored trainer step."""


class DataParallelDataModule(L.LightningDataModule):
    """Base of the library's data modules: dataloaders per data-parallel rank, resumable."""

    train_dataset: Optional[Dataset] = None
    val_dataset: Optional[Dataset] = None
    _resume = (0, 0)  # (consumed_samples, global_step) restored from a checkpoint
    _tokenizer: Any = None
    # Joins a batch's rows (None: torch's default, which stacks equal-shaped tensors).
    collate_fn: Optional[Callable[[list], Any]] = None

    def __init__(self) -> None:
        """Imports `datasets`, which every rank's `setup` reads the data with, here in the
        launching process: ranks forked from it (the CLI on CPU, start_method fork) share the
        import instead of each paying it (1-2 s on a 2-core machine)."""
        super().__init__()
        importlib.import_module("datasets")

    @property
    def tokenizer(self) -> Any:
        """The loaded HF tokenizer."""
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.hparams.tokenizer)
        return self._tokenizer

    @property
    def pad_token_id(self) -> int:
        """Fills padding and unused labels (never with loss): pad, else EOS, else 0."""
        tok = self.tokenizer
        return next((i for i in (tok.pad_token_id, tok.eos_token_id) if i is not None), 0)

    @property
    def vocab_size(self) -> int:
        """``len(tokenizer)``, special tokens included: the size a model's embedding needs."""
        return len(self.tokenizer)

    def _consumed_samples(self) -> int:
        """Global samples consumed at the trainer's step, continuing from a restored checkpoint."""
        _, dp_size, batch_size = _layout(self.trainer, type(self).__name__)
        consumed, step = self._resume
        return max(0, consumed + (self.trainer.global_step - step) * batch_size * dp_size)

    def _loader(
        self, split: str, dataset: Dataset, shuffle: bool, position: Callable[[], int]
    ) -> DataLoader:
        rank, dp_size, batch_size = _layout(self.trainer, type(self).__name__)
        try:
            sampler = DataParallelSampler(
                len(dataset),
                batch_size,
                rank,
                dp_size,
                shuffle=shuffle,
                seed=self.hparams.seed,
                consumed_samples=position(),
            )
        except ValueError as err:
            raise ValueError(
                f"{split} data of seq_length={self.hparams.seq_length}: {err}"
            ) from None
        return _SeatedLoader(
            dataset,
            batch_size=batch_size,
            sampler=sampler,
            num_workers=self.hparams.num_workers,
            pin_memory=torch.cuda.is_available(),
            collate_fn=type(self).collate_fn,
            position=position,
        )

    def train_dataloader(self) -> DataLoader:
        if self.train_dataset is None:
            self.setup("fit")
        shuffle = self.hparams.shuffle
        return self._loader("training", self.train_dataset, shuffle, self._consumed_samples)

    def val_dataloader(self) -> Union[DataLoader, list]:
        if self.train_dataset is None:
            self.setup("validate")
        if self.val_dataset is None:
            return []
        return self._loader("validation", self.val_dataset, False, lambda: 0)

    def state_dict(self) -> dict[str, Any]:
        if self.trainer is None:
            return {"consumed_samples": self._resume[0], "global_step": self._resume[1]}
        return {
            "consumed_samples": self._consumed_samples(),
            "global_step": self.trainer.global_step,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._resume = (int(state_dict["consumed_samples"]), int(state_dict.get("global_step", 0)))
