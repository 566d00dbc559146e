"""LightningDataModule for supervised fine-tuning on chat conversations.

Batches are dicts of ``[B, S]`` tensors ``tokens``, ``labels``, ``loss_mask``, ``position_ids``
and ``segment_ids`` (see ``packing``): the loss falls on the assistant's replies only, and a
row holds one conversation (``packing=False``) or several.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any, Mapping, Optional, Union

import numpy as np
import torch
from lightning.fabric.utilities.rank_zero import rank_zero_only
from torch.utils.data import Dataset

from lightning_mcore.data.chat import ChatFormat, drop_reason, tokenize_conversation
from lightning_mcore.data.chat_module import ChatDataModule, split_samples, token_features
from lightning_mcore.data.packing import TRUNCATION, build_row, efficiency, fit_samples, pack

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


class SFTDataModule(ChatDataModule):
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
        super().__init__(paths, tokenizer, seq_length, val_split, chat_template)

    def _check_hparams(self) -> None:
        if self.hparams.truncation not in TRUNCATION:
            raise ValueError(f"truncation must be one of {TRUNCATION}")

    def _format(self, column_names: list[str]) -> ChatFormat:
        hp = self.hparams
        return ChatFormat.detect(column_names, hp.format, hp.columns, hp.roles)

    def _tokenize(self) -> Any:
        """``input_ids``, ``assistant_mask``, ``length``, ``first_loss`` and ``dropped`` (the
        reason, or ""; such rows are empty) of every conversation."""
        records, chat = self._records()
        how = (chat.format, sorted(chat.names.items()), sorted(chat.roles.items()))
        features = token_features("length", "first_loss")
        return self._map(records, _tokenize_batch, features, ("sft", how), {"chat": chat},
                         "Tokenizing conversations")

    def _build(self, tokenized: Any) -> None:
        hp = self.hparams
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
