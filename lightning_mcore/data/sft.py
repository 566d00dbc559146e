"""LightningDataModule for supervised fine-tuning on chat conversations.

Batches are dicts of ``[B, S]`` tensors ``tokens``, ``labels``, ``loss_mask``, ``position_ids``
and ``segment_ids`` (see ``packing``): the loss falls on the assistant's replies only, and a
row holds one conversation (``packing=False``) or several.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections import Counter
from contextlib import contextmanager
from typing import Any, Mapping, Optional, Sequence, Union

import numpy as np
import torch
from lightning.fabric.utilities.rank_zero import rank_zero_only
from torch.utils.data import Dataset

from lightning_mcore.data import peek, preprocess
from lightning_mcore.data.files import BUILDERS, resolve_files
from lightning_mcore.data.chat import (
    ChatFormat,
    drop_reason,
    resolve_template,
    tokenize_conversation,
)
from lightning_mcore.data.feeding import DataParallelDataModule
from lightning_mcore.data.packing import (
    TRUNCATION,
    build_row,
    efficiency,
    fit_samples,
    pack,
)

log = logging.getLogger(__name__)


class SFTRows(Dataset):
    """Rows of ``seq_length`` tokens, each built from the tokenized samples listed for it."""

    def __init__(self, tokenized: Any, rows: list[list[int]], seq_length: int, pad_id: int):
        self.tokenized = tokenized.select_columns(["input_ids", "assistant_mask"])
        self.rows, self.seq_length, self.pad_id = rows, seq_length, pad_id

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        got, cut = self.tokenized[self.rows[index]], self.seq_length
        samples = [(i[:cut], m[:cut]) for i, m in zip(got["input_ids"], got["assistant_mask"])]
        return build_row(samples, self.seq_length, self.pad_id)


class SFTDataModule(DataParallelDataModule):
    """Chat fine-tuning data from jsonl/json/parquet files or ``save_to_disk`` directories.

    Args:
        paths: files or globs (``.jsonl``/``.json``, ``.parquet``) or saved dataset directories.
        tokenizer: path to an HF tokenizer directory.
        seq_length: tokens per row ``S``.
        format: ``"messages"``, ``"alpaca"`` or ``"auto"`` (from the columns), see ``chat``.
        columns: our field names to the dataset's, e.g. ``{"messages": "conversations",
            "role": "from", "content": "value"}``.
        roles: the dataset's role names to ours, e.g. ``{"human": "user", "gpt": "assistant"}``.
        chat_template: None (the tokenizer's), ``"chatml"`` (built in) or a Jinja template.
        truncation: samples longer than ``S`` are ``"drop"``-ped or ``"truncate"``-d to the
            first ``S`` tokens (dropped anyway when no assistant token is left).
        packing: several samples per row (best-fit decreasing) instead of one.
        val_split: fraction of the samples held out for validation (0: none).
        seed: seed of the split and of the per-epoch shuffle.
        shuffle: reshuffle training rows every epoch.
        num_workers: DataLoader worker processes.
        num_proc: processes for tokenizing with ``datasets.map``.
        cache_dir: ``datasets`` cache directory (its default when None).

    After ``setup``, ``stats`` holds what happened to the samples: counts dropped by reason,
    truncated, and per split the samples, rows, tokens and packing efficiency.
    """

    def __init__(
        self,
        paths: Union[str, list[str]],
        tokenizer: str,
        seq_length: int,
        format: str = "auto",
        columns: Optional[dict[str, str]] = None,
        roles: Optional[dict[str, str]] = None,
        chat_template: Optional[str] = None,
        truncation: str = "drop",
        packing: bool = True,
        val_split: float = 0.0,
        seed: int = 1234,
        shuffle: bool = True,
        num_workers: int = 0,
        num_proc: Optional[int] = None,
        cache_dir: Optional[str] = None,
    ) -> None:
        super().__init__()
        self.paths = [paths] if isinstance(paths, str) else list(paths)
        check_options(self.paths, seq_length, val_split, tokenizer)
        if truncation not in TRUNCATION:
            raise ValueError(f"truncation must be one of {TRUNCATION}")
        self.save_hyperparameters()
        self.stats: dict[str, Any] = {}
        check_template(self, chat_template)
        peek.check_records(
            self.paths, lambda names: ChatFormat.detect(names, format, columns, roles).read
        )

    def prepare_data(self) -> None:
        """Tokenize once per node (Lightning runs this on local rank 0); setup() hits the cache."""
        self._tokenize()

    def _tokenize(self) -> Any:
        hp = self.hparams
        records = load_records(self.paths, hp.cache_dir)
        chat = ChatFormat.detect(records.column_names, hp.format, hp.columns, hp.roles)
        records = records.select_columns(chat.record_columns)
        with naming_files(self.paths):
            return tokenize_records(
                records, self.tokenizer, chat, hp.chat_template, hp.num_proc, hp.cache_dir
            )

    def setup(self, stage: Optional[str] = None) -> None:
        if self.train_dataset is not None:
            return
        hp, tokenized = self.hparams, self._tokenize()
        numbers = tokenized.select_columns(["length", "first_loss"]).with_format("numpy")[:]
        lengths, first = numbers["length"], numbers["first_loss"]
        dropped = Counter(r for r in tokenized["dropped"] if r)
        usable = np.flatnonzero(lengths > 0)
        keep, fitted, lost, truncated = fit_samples(
            lengths[usable], first[usable], hp.seq_length, hp.truncation
        )
        dropped.update(lost)
        self.stats = {"samples": len(tokenized), "dropped": dict(dropped), "truncated": truncated}
        if len(keep) == 0:
            raise ValueError(f"no sample left to train on of {len(tokenized)}: {dict(dropped)}")
        kept_lengths = dict(zip(usable[keep].tolist(), fitted.tolist()))
        train, val = split_samples(usable[keep].tolist(), hp.val_split, hp.seed)
        self.train_dataset = self._rows("train", tokenized, train, kept_lengths)
        self.val_dataset = self._rows("val", tokenized, val, kept_lengths) if val else None
        _log_stats(self.stats)

    def _rows(self, split: str, tokenized: Any, samples: list[int], lengths: dict) -> SFTRows:
        """Pack the split's samples into rows and record its numbers in ``stats``."""
        S, sizes = self.hparams.seq_length, [lengths[i] for i in samples]
        rows = pack(sizes, S) if self.hparams.packing else [[i] for i in range(len(sizes))]
        self.stats[split] = {
            "samples": len(samples),
            "rows": len(rows),
            "tokens": sum(sizes),
            "packing_efficiency": efficiency(sizes, rows, S),
        }
        rows = [[samples[i] for i in row] for row in rows]
        return SFTRows(tokenized, rows, S, self.pad_token_id)


def check_options(paths: Sequence[str], seq_length: Any, val_split: float, tokenizer: str) -> None:
    """The checks every chat data module makes in ``__init__``: fail now, not after the trainer
    has started (missing files, text files, a missing tokenizer)."""
    if not isinstance(seq_length, int) or seq_length < 2:
        raise ValueError(f"seq_length must be an int >= 2, got {seq_length!r}")
    if not 0.0 <= val_split < 1.0:
        raise ValueError(f"val_split must be in [0, 1), got {val_split}")
    for path in paths:
        if not os.path.isdir(os.path.expanduser(path)):
            conversation_files(path)
    preprocess.tokenizer_dir(tokenizer)


def check_template(module: Any, chat_template: Optional[str]) -> None:
    """Refuse a tokenizer without a chat template when none is given, naming the tokenizer."""
    if chat_template is None:
        try:
            resolve_template(module.tokenizer)
        except ValueError as err:
            raise ValueError(f"tokenizer {module.hparams.tokenizer!r}: {err}") from None


@contextmanager
def naming_files(paths: Sequence[str]):
    """A sample's error (``sample N: ...``, raised while tokenizing) names the data files too."""
    try:
        yield
    except ValueError as err:
        if not str(err).startswith("sample "):
            raise
        raise ValueError(f"{', '.join(paths)}: {err}") from None


def conversation_files(path: str) -> list[str]:
    """The files behind a path or glob, refusing plain text (it holds no conversations)."""
    files = resolve_files(path)
    for file in files:
        if BUILDERS[os.path.splitext(file)[1].lower()] == "text":
            raise ValueError(
                f"{file!r}: text files hold no conversations; use .jsonl/.json, "
                ".parquet or a save_to_disk directory"
            )
    return files


def split_samples(
    samples: list[int], val_split: float, seed: int, what: str = "samples"
) -> tuple[list[int], list[int]]:
    """(train, val): a seeded random ``val_split`` fraction of ``samples`` held out, each sorted
    (before packing: a sample is never split across the two)."""
    num_val = int(round(len(samples) * val_split))
    if val_split > 0 and not 0 < num_val < len(samples):
        raise ValueError(
            f"val_split={val_split} of {len(samples)} {what} leaves "
            f"{num_val} for validation and {len(samples) - num_val} for training"
        )
    generator = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(samples), generator=generator).tolist()
    val = sorted(samples[i] for i in order[:num_val])
    return sorted(samples[i] for i in order[num_val:]), val


def load_records(paths: Sequence[str], cache_dir: Optional[str] = None) -> Any:
    """One ``datasets.Dataset`` of the records of every path, in order."""
    import datasets

    parts = []
    for path in paths:
        if os.path.isdir(os.path.expanduser(path)):
            loaded = datasets.load_from_disk(os.path.expanduser(path))
            if isinstance(loaded, datasets.DatasetDict):
                if "train" not in loaded:
                    raise ValueError(f"{path!r} holds splits {list(loaded)} but no 'train' split")
                loaded = loaded["train"]
            parts.append(loaded)
            continue
        for builder, group in preprocess._runs_of_same_builder(conversation_files(path)):
            parts.append(preprocess.load_files(builder, group, cache_dir))
    return parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)


def tokenize_records(
    records: Any,
    tokenizer: Any,
    chat: ChatFormat,
    chat_template: Optional[str] = None,
    num_proc: Optional[int] = None,
    cache_dir: Optional[str] = None,
) -> Any:
    """``datasets.map`` the records to ``input_ids``, ``assistant_mask``, ``length``,
    ``first_loss`` and ``dropped`` (the reason, or ""; such rows are empty). Cached, see
    ``map_cached``."""
    import datasets

    template = resolve_template(tokenizer, chat_template)
    how = (chat.format, sorted(chat.names.items()), sorted(chat.roles.items()))
    ints, mask = datasets.Value("int32"), datasets.Sequence(datasets.Value("int8"))
    ids = datasets.Sequence(datasets.Value("int32"))
    features = dict(input_ids=ids, assistant_mask=mask, length=ints, first_loss=ints)
    features["dropped"] = datasets.Value("string")
    return map_cached(
        records,
        _tokenize_batch,
        features,
        key=("sft", tokenizer, template, how),
        fn_kwargs={"tokenizer": tokenizer, "chat": chat, "template": template},
        num_proc=num_proc,
        cache_dir=cache_dir,
        desc="Tokenizing conversations",
    )


def map_cached(
    records: Any,
    function: Any,
    features: dict,
    key: tuple[str, Any, str, Any],
    fn_kwargs: dict,
    num_proc: Optional[int] = None,
    cache_dir: Optional[str] = None,
    desc: Optional[str] = None,
) -> Any:
    """``records.map(function)`` in batches with indices, replacing the records' columns by
    ``features``. ``key`` is (name, tokenizer, template, how the records are read): the result is
    cached under a fingerprint of the data, the tokenizer's content and the rest of the key, so
    ranks that come second load it instead of tokenizing again."""
    import datasets

    name, tokenizer, template, how = key
    content = preprocess._tokenizer_content(tokenizer)
    text = f"lightning_mcore-{name}-v1|{records._fingerprint}|{content}|{template}|{how}"
    fingerprint = hashlib.sha256(text.encode()).hexdigest()[:32]
    cache_file = os.path.join(cache_dir, f"{name}-{fingerprint}.arrow") if cache_dir else None
    return records.map(
        function,
        batched=True,
        with_indices=True,
        remove_columns=records.column_names,
        fn_kwargs=fn_kwargs,
        features=datasets.Features(features),
        num_proc=num_proc,
        new_fingerprint=fingerprint,
        cache_file_name=cache_file,
        desc=desc,
    )


def _tokenize_batch(batch: dict, indices: list, tokenizer: Any, chat: ChatFormat, template: str):
    rows = []
    for row, index in enumerate(indices):
        messages = chat.read({column: values[row] for column, values in batch.items()}, index)
        reason = drop_reason(messages)
        ids, mask = (
            ([], []) if reason else tokenize_conversation(tokenizer, messages, template, index)
        )
        first = next((j for j in range(1, len(mask)) if mask[j]), len(ids))
        rows.append((ids, mask, len(ids), first, reason or ""))
    names = ("input_ids", "assistant_mask", "length", "first_loss", "dropped")
    return {name: [r[k] for r in rows] for k, name in enumerate(names)}


@rank_zero_only
def _log_stats(stats: Mapping[str, Any]) -> None:
    train, val = stats["train"], stats.get("val")
    log.info(
        f"SFT data: {stats['samples']} samples; training: {train['samples']} samples in "
        f"{train['rows']} rows, {train['tokens']} tokens, packing efficiency "
        f"{train['packing_efficiency']:.1%}" + (f"; validation: {val['rows']} rows" if val else "")
    )
    if stats["dropped"] or stats["truncated"]:
        log.warning(
            f"SFT data: dropped {stats['dropped'] or 'none'}, truncated {stats['truncated']} "
            f"of {stats['samples']} samples"
        )
