"""LightningDataModule for unpaired feedback (KTO): a prompt, a completion and a boolean label.

Batches are the DPO batches (``[B, S]`` ``tokens``, ``labels``, ``loss_mask``, ``position_ids``,
``segment_ids``) plus ``label`` ``[B]`` (1.0: desirable, 0.0: undesirable), ONE ROW PER EXAMPLE:
the prompt with its own completion (segment 1), then the same prompt with a mismatched
completion (segment 2), then padding. The mismatched completion is the next record's (the last
record takes the first one's), as trl pairs prompt i with completion i + 1: its log-probability
under the policy and the reference estimates KTO's KL reference point. The loss mask covers the
completions only.

Records (``columns`` maps the names, ``roles`` the role names as for SFT):

* strings: ``prompt`` (read as a user turn) and ``completion`` (the assistant's reply);
* message lists: ``prompt`` (the turns before the reply) and ``completion`` (ending with the
  assistant's reply);

and ``label``: true (desirable) or false (undesirable).
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

import numpy as np
from torch.utils.data import Dataset

from lightning_mcore.data import peek
from lightning_mcore.data.chat import ChatFormat, field_names
from lightning_mcore.data.two_rows import (
    RowsWith,
    TwoRowDataModule,
    add_sides,
    empty_batch,
    tokenize_sides,
)

log = logging.getLogger(__name__)

FIELDS = ("prompt", "completion", "label", "role", "content")
REQUIRED = {"prompt": "prompts", "completion": "completions", "label": "true/false labels"}
MISMATCHED = "__kto_mismatched_completion"  # the next record's completion, added before tokenizing
EMPTY, EMPTY_MISMATCHED = "empty completion", "empty mismatched completion"
# With one kind the loss only pushes every reward one way from z0, and the other kind's metrics
# (rewards/rejected or rewards/chosen) are logged as 0.0 for examples never seen; trl's
# KTOTrainer refuses such data too.
BOTH_KINDS = "KTO needs both desirable (label true) and undesirable (label false) examples"


def one_kind(labels: Sequence[bool]) -> Optional[str]:
    """"desirable" or "undesirable" when every one of `labels` is that kind; None when both
    kinds are there (or there are none)."""
    kinds = {bool(v) for v in labels}
    return None if len(kinds) != 1 else "desirable" if kinds.pop() else "undesirable"


def refuse_one_kind(paths: Sequence[str], label: str) -> None:
    """Refuse data whose labels are all of one kind. The files are read label by label until
    both kinds have turned up, which in mixed data is within the first records; a file that
    cannot be read cheaply (a large JSON array) is left to setup's check."""
    labels, files = [], []
    try:
        for file in peek.data_files(paths):
            values = peek.column_values(file, label)
            if values is None:
                return
            files.append(file)
            for value in values:
                if isinstance(value, bool):
                    labels.append(value)
                if len(labels) > 1 and labels[-1] != labels[0]:
                    return
    except ValueError:  # a line further down that is not JSON: tokenizing names it
        return
    kind = one_kind(labels)
    if kind is not None:
        other = "undesirable" if kind == "desirable" else "desirable"
        raise ValueError(f"{', '.join(files)}: {BOTH_KINDS}, but {'it holds' if len(files) == 1 else 'they hold'} "
                         f"only {kind} examples ({len(labels)}): add {other} ones.")


@dataclass(frozen=True)
class UnpairedFormat:
    """Where records hold an example: the dataset's columns for ``prompt``, ``completion`` and
    ``label``, and a ``ChatFormat`` reading message lists."""

    names: Mapping[str, str]
    chat: ChatFormat

    @classmethod
    def detect(
        cls,
        column_names: Sequence[str],
        columns: Optional[Mapping[str, str]] = None,
        roles: Optional[Mapping[str, str]] = None,
    ) -> "UnpairedFormat":
        """Check the dataset's columns up front: a missing one is named with the fix."""
        names = field_names(FIELDS, columns)
        have = list(column_names)
        for field, what in REQUIRED.items():
            if names[field] not in have:
                raise ValueError(
                    f"column {names[field]!r} ({what}) not found; columns found: {have}; KTO "
                    f"data needs {list(REQUIRED)}: name yours with columns={{{field!r}: "
                    "'your_column'}"
                )
        chat = ChatFormat.of_turns(names, roles)  # takes role and content out of names
        return cls(names, chat)

    @property
    def record_columns(self) -> list[str]:
        return [self.names[f] for f in REQUIRED]

    def read(self, record: Mapping, index: int) -> tuple[list[dict], bool]:
        """The example's conversation (``[{"role", "content"}]``, ending with the completion)
        and its label."""
        where, label = f"sample {index}", record.get(self.names["label"])
        if not isinstance(label, bool):
            raise ValueError(
                f"{where}: {self.names['label']!r} must be true (desirable) or false "
                f"(undesirable), got {label!r}"
            )
        return self.conversation(record, record.get(self.names["completion"]), where), label

    def conversation(self, record: Mapping, completion: Any, where: str) -> list[dict]:
        """The record's prompt followed by ``completion`` (its own or another record's)."""
        prompt, name = record.get(self.names["prompt"]), self.names
        kinds = (type(prompt).__name__, type(completion).__name__)
        if kinds == ("str", "str"):
            return [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]
        if kinds != ("list", "list"):
            raise ValueError(
                f"{where}: {name['prompt']!r} and {name['completion']!r} must both be strings or "
                f"both message lists, got {kinds[0]} and {kinds[1]}"
            )
        turns = self.chat.read_messages(prompt, f"{where}, prompt")
        turns += self.chat.read_messages(completion, f"{where}, completion")
        if not turns or turns[-1]["role"] != "assistant":
            last = turns[-1]["role"] if turns else "nothing"
            raise ValueError(
                f"{where}: the completion must end with the assistant's reply, but ends with {last}"
            )
        return turns


def _tokenize_batch(batch: dict, indices: list, tokenizer: Any, fmt: UnpairedFormat,
                    template: str, count: int):
    out = empty_batch("label")
    for row, index in enumerate(indices):
        record = {column: values[row] for column, values in batch.items()}
        own, label = fmt.read(record, index)
        where = f"sample {(index + 1) % count} (its completion after sample {index}'s prompt)"
        mismatched = fmt.conversation(record, record[MISMATCHED], where)
        reason = EMPTY if not own[-1]["content"].strip() else ""
        reason = reason or (EMPTY_MISMATCHED if not mismatched[-1]["content"].strip() else "")
        sides, reason = tokenize_sides(tokenizer, (own, mismatched), template, index, EMPTY, reason)
        add_sides(out, sides, reason, label=int(label))
    return out


class KTODataModule(TwoRowDataModule):
    """Unpaired desirable/undesirable examples from jsonl/json/parquet files or ``save_to_disk``
    directories, one row per example (its completion | a mismatched one, see the module doc).

    Args:
        paths: files or globs (``.jsonl``/``.json``, ``.parquet``) or saved dataset directories.
        tokenizer: path to an HF tokenizer directory.
        seq_length: tokens per row ``S``: both conversations of the row together.
        columns: our field names (``prompt``, ``completion``, ``label``, ``role``, ``content``)
            to the dataset's, e.g. ``{"label": "thumbs_up"}``.
        roles: the dataset's role names to ours, e.g. ``{"human": "user", "gpt": "assistant"}``.
        chat_template: None (the tokenizer's), ``"chatml"`` (built in) or a Jinja template.
        val_split: fraction of the examples held out for validation (0: none).
        seed: seed of the split and of the per-epoch shuffle.
        shuffle: reshuffle training rows every epoch.
        num_workers: DataLoader worker processes.
        num_proc: processes for tokenizing with ``datasets.map``.
        cache_dir: ``datasets`` cache directory (its default when None).

    Data of one kind only (every label true, or every one false) is refused, here and again
    for the training examples left after dropping and the validation split.

    Examples that cannot be trained on are dropped and counted, never cut: an empty completion
    (or an empty mismatched one), a prompt longer than ``S``, or a row longer than ``S``. After
    ``setup``, ``stats`` holds the counts by reason and per split the examples (desirable ones
    too), their tokens and the fraction of row positions they fill.
    """

    item, cache_name, desc, columns = "example", "kto", "Tokenizing KTO examples", ("label",)
    tokenize_batch, title, logger = staticmethod(_tokenize_batch), "KTO", log

    def _check_hparams(self) -> None:
        refuse_one_kind(self.paths, (self.hparams.columns or {}).get("label", "label"))

    def _format(self, column_names: list[str]) -> UnpairedFormat:
        return UnpairedFormat.detect(column_names, self.hparams.columns, self.hparams.roles)

    def _records(self) -> tuple[Any, UnpairedFormat]:
        """The records with ``MISMATCHED``: each one's next record's completion (cyclic), so
        that row ``2 * i + 1`` is prompt ``i`` with completion ``i + 1``."""
        records, fmt = super()._records()
        completion = fmt.names["completion"]
        others = records[completion]
        records = records.add_column(MISMATCHED, others[1:] + others[:1],
                                     feature=records.features[completion])
        return records, fmt

    def _batch_kwargs(self, records: Any, fmt: UnpairedFormat) -> dict:
        return {"fmt": fmt, "count": len(records)}

    def _check_training(self, numbers: dict, train: list[int], lengths: np.ndarray,
                        dropped: Counter) -> None:
        """Refuse training examples of one kind; keep every example's label for its row."""
        hp, self._labels = self.hparams, numbers["label"][::2].astype(bool)
        kind = one_kind(self._labels[train].tolist())
        if kind is not None:
            raise ValueError(
                f"{', '.join(self.paths)}: {BOTH_KINDS}, but only {kind} examples ({len(train)}) are "
                f"left for training (of {len(lengths)}; dropped: {dict(dropped)}; seq_length="
                f"{hp.seq_length}; val_split={hp.val_split}): add examples of the other kind, or "
                f"raise seq_length if they were dropped for their length.")

    def _train_detail(self, train: dict) -> str:
        return f" ({train['desirable']} desirable)"

    def _rows(self, split: str, tokenized: Any, examples: list[int], lengths: np.ndarray) -> Dataset:
        """The rows with each example's ``label`` (1.0 desirable)."""
        rows, labels = super()._rows(split, tokenized, examples, lengths), self._labels[examples]
        self.stats[split] = {"examples": len(examples), "desirable": int(labels.sum()),
                             **self.stats[split]}
        return RowsWith(rows, "label", [float(v) for v in labels.tolist()])
