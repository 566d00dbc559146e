"""Chat data whose items are two conversations trained in one row: DPO's pairs (chosen |
rejected), KTO's examples (completion | mismatched completion).

Each item is tokenized as two rows, ``2 * i`` and ``2 * i + 1``, with its last reply masked and
the prompt's length; an item that does not fit a row of ``seq_length`` is dropped and counted,
never cut.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any, Callable, Optional, Sequence, Union

import numpy as np
import torch
from lightning.fabric.utilities.rank_zero import rank_zero_only
from torch.utils.data import Dataset

from lightning_mcore.data.chat import tokenize_conversation
from lightning_mcore.data.chat_module import ChatDataModule, split_samples, token_features
from lightning_mcore.data.packing import efficiency
from lightning_mcore.data.sft import SFTRows

# Drop reasons that depend on seq_length (those decided when tokenizing are the subclass's).
LONG_PROMPT, LONG_PAIR = "prompt longer than seq_length", "pair longer than seq_length"
NOT_TOKENIZED = [([], []), ([], [])]


def fit_pairs(
    lengths: np.ndarray, prompt_lengths: np.ndarray, seq_length: int
) -> tuple[np.ndarray, Counter]:
    """(kept pair indices, dropped counts by reason) for pairs of ``lengths[i] = (chosen,
    rejected)`` tokens (0: already dropped) with ``prompt_lengths[i]`` prompt tokens each."""
    usable = lengths[:, 0] > 0
    long_prompt = usable & (prompt_lengths > seq_length)
    long_pair = usable & ~long_prompt & (lengths.sum(axis=1) > seq_length)
    dropped = Counter({LONG_PROMPT: int(long_prompt.sum()), LONG_PAIR: int(long_pair.sum())})
    return np.flatnonzero(usable & ~long_prompt & ~long_pair), +dropped


def tokenize_sides(tokenizer: Any, conversations: Sequence[list], template: str, index: int,
                   empty: str, reason: str = "") -> tuple[list, str]:
    """(both conversations' ids and masks, their last reply masked; the reason to drop them:
    ``reason`` when given (then nothing is tokenized), ``empty`` when a reply renders to no
    token, else "")."""
    if reason:
        return NOT_TOKENIZED, reason
    sides = [tokenize_conversation(tokenizer, turns, template, index, last_only=True)
             for turns in conversations]
    return sides, empty if any(1 not in mask for _, mask in sides) else ""


def empty_batch(*columns: str) -> dict[str, list]:
    """A batch of no rows yet, for ``add_sides``."""
    names = ("input_ids", "assistant_mask", "length", "prompt_length", *columns, "dropped")
    return {name: [] for name in names}


def add_sides(out: dict[str, list], sides: list, reason: str, **columns: Any) -> None:
    """Append an item's two rows to the batch ``out`` (empty ones when ``reason`` drops it),
    with ``columns``' values on both. The reply is the tail of each rendering: both share the
    prompt's tokens before it."""
    sides = NOT_TOKENIZED if reason else sides
    prompt = sides[0][1].index(1) if not reason else 0
    for ids, mask in sides:
        values = dict(input_ids=ids, assistant_mask=mask, length=len(ids), prompt_length=prompt)
        for name, value in (values | columns | {"dropped": reason}).items():
            out[name].append(value)


class RowsWith(Dataset):
    """``rows`` (one per item) with each item's value added as ``name``."""

    def __init__(self, rows: Dataset, name: str, values: list, dtype: Optional[torch.dtype] = None):
        self.rows, self.name, self.values, self.dtype = rows, name, values, dtype

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {**self.rows[index], self.name: torch.tensor(self.values[index], dtype=self.dtype)}


class TwoRowDataModule(ChatDataModule):
    """Subclasses name their ``item`` ("pair"), their tokenized ``columns`` (int8, beside the
    lengths), the cache's ``cache_name``, ``tokenize_batch`` (a module-level function, for
    ``datasets.map``), ``desc``, and the ``title`` and ``logger`` of their log lines; their
    format has ``names`` and a ``chat``."""

    item: str
    cache_name: str
    desc: str
    title: str
    logger: logging.Logger
    columns: tuple[str, ...] = ()
    tokenize_batch: Callable

    def __init__(
        self,
        paths: Union[str, list[str]],
        tokenizer: str,
        seq_length: int,
        columns: Optional[dict[str, Optional[str]]] = None,
        roles: Optional[dict[str, str]] = None,
        chat_template: Optional[str] = None,
        val_split: float = 0.0,
        seed: int = 1234,
        shuffle: bool = True,
        num_workers: int = 0,
        num_proc: Optional[int] = None,
        cache_dir: Optional[str] = None,
    ) -> None:
        """The arguments DPO's and KTO's data modules share (their class docstrings say what
        each means for them)."""
        super().__init__(paths, tokenizer, seq_length, val_split, chat_template)

    def _tokenize(self) -> Any:
        """Two tokenized rows per item: ``2 * i`` and ``2 * i + 1``, so ``SFTRows`` builds the
        item's row from ``[2 * i, 2 * i + 1]``."""
        records, fmt = self._records()
        how = [sorted(fmt.names.items()), sorted(fmt.chat.names.items()), sorted(fmt.chat.roles.items())]
        features = token_features("length", "prompt_length", **{c: "int8" for c in self.columns})
        return self._map(records, self.tokenize_batch, features, (self.cache_name, how),
                         self._batch_kwargs(records, fmt), self.desc)

    def _batch_kwargs(self, records: Any, fmt: Any) -> dict:
        """What ``tokenize_batch`` gets besides the batch, the tokenizer and the template."""
        return {"fmt": fmt}

    def _build(self, tokenized: Any) -> None:
        """The items that fit a row of ``seq_length``, split; refuses when none fits."""
        hp, items = self.hparams, f"{self.item}s"
        names = ["length", "prompt_length", "dropped", *self.columns]
        numbers = tokenized.select_columns(names).with_format("numpy")[:]
        lengths = numbers["length"].reshape(-1, 2)  # [items, 2]: the two sides' lengths
        dropped = Counter(r for r in numbers["dropped"][::2].tolist() if r)
        keep, lost = fit_pairs(lengths, numbers["prompt_length"][::2], hp.seq_length)
        dropped.update(lost)
        if len(keep) == 0:
            raise ValueError(f"no {self.item} left to train on of {len(lengths)}: {dict(dropped)}")
        self.stats = {items: len(lengths), "dropped": dict(dropped)}
        train, val = split_samples(keep.tolist(), hp.val_split, hp.seed, items)
        self._check_training(numbers, train, lengths, dropped)
        self.train_dataset = self._rows("train", tokenized, train, lengths)
        self.val_dataset = self._rows("val", tokenized, val, lengths) if val else None
        self._log_stats()

    def _check_training(self, numbers: dict, train: list[int], lengths: np.ndarray,
                        dropped: Counter) -> None:
        """A subclass's check of the items left for training (``numbers``: the tokenized
        columns as numpy arrays)."""

    def _rows(self, split: str, tokenized: Any, items: list[int], lengths: np.ndarray) -> Dataset:
        """One row per item; the split's numbers go into ``stats``."""
        S, sizes = self.hparams.seq_length, lengths[items].sum(axis=1).tolist()
        self.stats[split] = {
            f"{self.item}s": len(items),
            "tokens": sum(sizes),
            "fill": efficiency(sizes, [[i] for i in range(len(items))], S),
        }
        return SFTRows(tokenized, [[2 * i, 2 * i + 1] for i in items], S, self.pad_token_id)

    def _train_detail(self, train: dict) -> str:
        """What the log line adds about the training rows."""
        return ""

    @rank_zero_only
    def _log_stats(self) -> None:
        stats, items, log = self.stats, f"{self.item}s", self.logger
        train, val = stats["train"], stats.get("val")
        log.info(
            f"{self.title} data: {stats[items]} {items}; training: {train[items]} rows of one "
            f"{self.item}{self._train_detail(train)}, {train['tokens']} tokens filling "
            f"{train['fill']:.1%} of the positions" + (f"; validation: {val[items]} {items}" if val else "")
        )
        if stats["dropped"]:
            log.warning(f"{self.title} data: dropped {stats['dropped']} of {stats[items]} {items} "
                        f"(seq_length={self.hparams.seq_length})")
