"""LightningDataModule for causal-LM pretraining on packed token sequences.

Batches follow the library's contract: a dict of ``[B, S]`` tensors ``tokens``, ``labels``
(next token), ``loss_mask`` (float) and ``position_ids``, where ``B`` is the per-data-parallel-rank
batch of one optimizer step, read from ``trainer.strategy.data_parallel_batch_size``.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Union

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Subset

from lightning_mcore.data import preprocess
from lightning_mcore.data.sampler import DataParallelSampler


def _layout(trainer: Any) -> tuple[int, int, int]:
    """(dp_rank, dp_size, per-rank batch size B) from the strategy's public attributes."""
    if trainer is None:
        raise RuntimeError("PretrainDataModule must be attached to a Trainer to build dataloaders")
    strategy = trainer.strategy
    batch_size = getattr(strategy, "data_parallel_batch_size", None)
    if batch_size is None:
        raise TypeError(
            "PretrainDataModule needs lightning_mcore.MegatronStrategy, got "
            f"{type(strategy).__name__}: it reads the per-rank batch size from "
            "strategy.data_parallel_batch_size"
        )
    kwargs = getattr(strategy, "distributed_sampler_kwargs", None) or {}
    return int(kwargs.get("rank", 0)), int(kwargs.get("num_replicas", 1)), int(batch_size)


class PackedSequences(Dataset):
    """Documents concatenated in order and cut into back-to-back windows of seq_length + 1 tokens.

    Nothing is padded; only the tail shorter than a window is dropped. Windows are sliced from
    the tokenized Arrow table's memory-mapped buffers, so the corpus is never copied into RAM.
    """

    def __init__(self, tokenized: Any, seq_length: int) -> None:
        self.tokenized, self.seq_length = tokenized, seq_length
        self._chunks: Optional[list[np.ndarray]] = None
        self.num_tokens = int(self._views()[1][-1])

    def _views(self) -> tuple[list[np.ndarray], np.ndarray]:
        """Token arrays of the Arrow chunks and their start offsets; rebuilt after unpickling."""
        if self._chunks is None:
            self._chunks = preprocess.token_chunks(self.tokenized)
            self._bounds = np.cumsum([0] + [len(c) for c in self._chunks])
        return self._chunks, self._bounds

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_chunks": None, "_bounds": None}

    def __len__(self) -> int:
        return self.num_tokens // (self.seq_length + 1)

    def window(self, index: int) -> np.ndarray:
        """Tokens ``[index * (S + 1), (index + 1) * (S + 1))`` of the concatenated documents."""
        if not 0 <= index < len(self):
            raise IndexError(index)
        chunks, bounds = self._views()
        start = index * (self.seq_length + 1)
        stop = start + self.seq_length + 1
        chunk = int(np.searchsorted(bounds, start, side="right")) - 1
        parts = []
        while start < stop:
            part = chunks[chunk][start - bounds[chunk] :][: stop - start]
            parts.append(part)
            start, chunk = start + len(part), chunk + 1
        return np.concatenate(parts)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        chunk = torch.from_numpy(self.window(index).astype(np.int64))
        return {
            "tokens": chunk[:-1],
            "labels": chunk[1:],
            "loss_mask": torch.ones(self.seq_length, dtype=torch.float32),
            "position_ids": torch.arange(self.seq_length, dtype=torch.int64),
        }


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


class PretrainDataModule(L.LightningDataModule):
    """Pretraining data from text/jsonl/parquet files, or from mcore indexed datasets.

    Args:
        paths: files or globs (``.txt``, ``.jsonl``/``.json``, ``.parquet``).
        tokenizer: path to an HF tokenizer directory.
        seq_length: tokens per sequence ``S``.
        text_field: document column of jsonl/parquet files.
        val_split: fraction held out for validation (0: no validation): of the packed
            sequences, or for indexed datasets (split by mcore) of the documents.
        seed: seed of the train/validation split and of the per-epoch shuffle.
        shuffle: reshuffle training sequences every epoch.
        num_workers: DataLoader worker processes.
        num_proc: processes for tokenizing with ``datasets.map``.
        add_eos: end every document with the tokenizer's EOS token.
        indexed_prefixes: mcore indexed dataset prefixes (``PREFIX.bin``/``.idx``, see
            ``python -m lightning_mcore.data.preprocess``), instead of ``paths``.
        cache_dir: ``datasets`` cache directory (its default when None); for indexed datasets,
            where mcore caches its sample indices (next to the data when None).
    """

    def __init__(
        self,
        paths: Union[str, list[str], None] = None,
        tokenizer: Optional[str] = None,
        seq_length: Optional[int] = None,
        text_field: str = "text",
        val_split: float = 0.0,
        seed: int = 1234,
        shuffle: bool = True,
        num_workers: int = 0,
        num_proc: Optional[int] = None,
        add_eos: bool = True,
        indexed_prefixes: Optional[list[str]] = None,
        cache_dir: Optional[str] = None,
    ) -> None:
        super().__init__()
        if (paths is None) == (indexed_prefixes is None):
            raise ValueError(
                "give exactly one of paths (text files) or indexed_prefixes (mcore .bin/.idx)"
            )
        if not tokenizer:
            raise ValueError("tokenizer is required: a path to an HF tokenizer directory")
        if not isinstance(seq_length, int) or seq_length < 1:
            raise ValueError(f"seq_length must be a positive int, got {seq_length!r}")
        if not 0.0 <= val_split < 1.0:
            raise ValueError(f"val_split must be in [0, 1), got {val_split}")
        self.save_hyperparameters()
        self.files = preprocess.resolve_files(paths) if paths is not None else None
        self.indexed_prefixes = list(indexed_prefixes) if indexed_prefixes is not None else None
        preprocess.tokenizer_dir(tokenizer)  # fail now, not after the trainer has started
        self._tokenizer: Any = None
        self.train_dataset: Optional[Dataset] = None
        self.val_dataset: Optional[Dataset] = None
        self._resume = (0, 0)  # (consumed_samples, global_step) restored from a checkpoint

    @property
    def tokenizer(self) -> Any:
        """The loaded HF tokenizer."""
        if self._tokenizer is None:
            self._tokenizer = preprocess.load_tokenizer(self.hparams.tokenizer)
        return self._tokenizer

    @property
    def vocab_size(self) -> int:
        """``len(tokenizer)``, special tokens included: the size a model's embedding needs."""
        return len(self.tokenizer)

    @property
    def eos_token_id(self) -> Optional[int]:
        return self.tokenizer.eos_token_id

    def prepare_data(self) -> None:
        """Tokenize once per node (Lightning runs this on local rank 0); setup() hits the cache."""
        if self.files is not None:
            self._tokenize()

    def _tokenize(self) -> Any:
        hp = self.hparams
        documents = preprocess.load_documents(self.files, hp.text_field, hp.cache_dir)
        return preprocess.tokenize_documents(documents, self.tokenizer, hp.add_eos, hp.num_proc)

    def setup(self, stage: Optional[str] = None) -> None:
        if self.train_dataset is not None:
            return
        if self.indexed_prefixes is not None:
            from lightning_mcore.data.indexed import build_indexed_datasets

            hp = self.hparams
            self.train_dataset, self.val_dataset = build_indexed_datasets(
                self.indexed_prefixes,
                self.tokenizer,
                hp.tokenizer,
                hp.seq_length,
                hp.seed,
                hp.val_split,
                hp.cache_dir,
            )
            return
        packed = PackedSequences(self._tokenize(), self.hparams.seq_length)
        if len(packed) == 0:
            raise ValueError(
                f"the text has {packed.num_tokens} tokens but one sequence needs "
                f"seq_length + 1 = {self.hparams.seq_length + 1}: {self.files}"
            )
        self.train_dataset, self.val_dataset = self._split(packed)

    def _split(self, packed: PackedSequences) -> tuple[Dataset, Optional[Dataset]]:
        """Hold out a seeded random ``val_split`` fraction of the packed sequences."""
        num_val = int(round(len(packed) * self.hparams.val_split))
        if self.hparams.val_split > 0 and not 0 < num_val < len(packed):
            raise ValueError(
                f"val_split={self.hparams.val_split} of {len(packed)} sequences leaves "
                f"{num_val} for validation and {len(packed) - num_val} for training"
            )
        if num_val == 0:
            return packed, None
        order = torch.randperm(
            len(packed), generator=torch.Generator().manual_seed(self.hparams.seed)
        )
        val, train = order[:num_val].sort().values, order[num_val:].sort().values
        return Subset(packed, train.tolist()), Subset(packed, val.tolist())

    def _consumed_samples(self) -> int:
        """Global samples consumed at the trainer's step, continuing from a restored checkpoint."""
        _, dp_size, batch_size = _layout(self.trainer)
        consumed, step = self._resume
        return max(0, consumed + (self.trainer.global_step - step) * batch_size * dp_size)

    def _loader(
        self, split: str, dataset: Dataset, shuffle: bool, position: Callable[[], int]
    ) -> DataLoader:
        rank, dp_size, batch_size = _layout(self.trainer)
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
