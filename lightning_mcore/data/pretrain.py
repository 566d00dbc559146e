"""LightningDataModule for causal-LM pretraining on packed token sequences.

Batches follow the library's contract: a dict of ``[B, S]`` tensors ``tokens``, ``labels``
(next token), ``loss_mask`` (float) and ``position_ids``, where ``B`` is the per-data-parallel-rank
batch of one optimizer step, read from ``trainer.strategy.data_parallel_batch_size``.
"""

from __future__ import annotations

import os
from typing import Any, Optional, Union

import numpy as np
import torch
from torch.utils.data import Dataset, Subset

from lightning_mcore.data import peek, preprocess
from lightning_mcore.data.files import BUILDERS, resolve_files
from lightning_mcore.data.feeding import DataParallelDataModule
from lightning_mcore.data.indexed import build_indexed_datasets


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


class PretrainDataModule(DataParallelDataModule):
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
        self.files = resolve_files(paths) if paths is not None else None
        self.indexed_prefixes = list(indexed_prefixes) if indexed_prefixes is not None else None
        preprocess.tokenizer_dir(tokenizer)  # fail now, not after the trainer has started
        for file in self.files or ():
            if BUILDERS[os.path.splitext(file)[1].lower()] == "text":
                peek.check_has_text(file)
            else:
                peek.check_text_field(file, text_field)
        self.train_dataset: Optional[Dataset] = None
        self.val_dataset: Optional[Dataset] = None
        self._resume = (0, 0)  # (consumed_samples, global_step) restored from a checkpoint

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
