"""LightningDataModule for preference pairs (DPO): one prompt, a chosen and a rejected reply.

Batches are dicts of ``[B, S]`` tensors ``tokens``, ``labels``, ``loss_mask``, ``position_ids``
and ``segment_ids`` (see ``packing``), ONE ROW PER PAIR: the chosen conversation (segment 1), then
the rejected one (segment 2), then padding (0). A pair can then never be split across
microbatches or pipeline stages, and the objective compares the two sums of its row. The loss
mask covers each conversation's last reply only (its earlier assistant turns are prompt).

Two record formats (``columns`` maps the names, ``roles`` the role names as for SFT):

* strings: ``prompt`` (read as a user turn), ``chosen`` and ``rejected`` (assistant replies);
* message lists: ``chosen`` and ``rejected`` are whole conversations that differ only in their
  last message, the assistant's reply; an optional ``prompt`` message list goes before both.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence


from lightning_mcore.data.chat import ChatFormat, field_names
from lightning_mcore.data.two_rows import TwoRowDataModule, add_sides, empty_batch, tokenize_sides

log = logging.getLogger(__name__)

FIELDS = ("prompt", "chosen", "rejected", "role", "content")
SIDES = ("chosen", "rejected")
# Drop reasons decided when tokenizing (those that depend on seq_length: two_rows.py).
EMPTY, IDENTICAL = "empty response", "chosen and rejected identical"


@dataclass(frozen=True)
class PairFormat:
    """Where records hold a pair: the dataset's column for ``prompt`` (None: no prompt column),
    ``chosen`` and ``rejected``, and a ``ChatFormat`` reading message lists."""

    names: Mapping[str, Optional[str]]
    chat: ChatFormat

    @classmethod
    def detect(
        cls,
        column_names: Sequence[str],
        columns: Optional[Mapping[str, Optional[str]]] = None,
        roles: Optional[Mapping[str, str]] = None,
    ) -> "PairFormat":
        """Check the dataset's columns up front; ``columns={"prompt": None}`` ignores a prompt
        column (when ``chosen``/``rejected`` hold whole conversations)."""
        names = field_names(FIELDS, columns)
        have = list(column_names)
        for side in SIDES:
            if names[side] not in have:
                raise ValueError(
                    f"column {names[side]!r} ({side} replies) not found; columns found: {have}; "
                    f"name yours with columns={{{side!r}: 'your_column'}}"
                )
        if names["prompt"] not in have:
            names["prompt"] = None
        chat = ChatFormat.of_turns(names, roles)  # takes role and content out of names
        return cls(names, chat)

    @property
    def record_columns(self) -> list[str]:
        """The dataset columns ``read`` uses."""
        return [self.names[f] for f in ("prompt", *SIDES) if self.names[f] is not None]

    def read(self, record: Mapping, index: int) -> tuple[list[dict], list[dict]]:
        """The chosen and the rejected conversation, ``[{"role", "content"}]`` each, ending with
        the reply and sharing every turn before it."""
        where, name = f"sample {index}", self.names
        values = {side: record.get(name[side]) for side in SIDES}
        kinds = {side: type(v).__name__ for side, v in values.items()}
        if kinds["chosen"] != kinds["rejected"] or kinds["chosen"] not in ("str", "list"):
            raise ValueError(
                f"{where}: {name['chosen']!r} and {name['rejected']!r} must both be strings or "
                f"both message lists, got {kinds['chosen']} and {kinds['rejected']}"
            )
        prompt = record.get(name["prompt"]) if name["prompt"] else None
        if kinds["chosen"] == "str":
            if not isinstance(prompt, str):
                got = "there is no prompt column; name yours with columns={'prompt': 'your_column'}"
                got = f"{name['prompt']!r} is {type(prompt).__name__}" if name["prompt"] else got
                raise ValueError(f"{where}: replies given as strings need a string prompt: {got}")
            user = [{"role": "user", "content": prompt}]
            return tuple(user + [{"role": "assistant", "content": values[s]}] for s in SIDES)
        if prompt is not None and not isinstance(prompt, list):
            raise ValueError(
                f"{where}: with message lists the prompt must be a message list too, got "
                f"{type(prompt).__name__}; if {name['chosen']!r} holds whole conversations, "
                "ignore the prompt column with columns={'prompt': None}"
            )
        head = self.chat.read_messages(prompt or [], f"{where}, prompt")
        chosen, rejected = (
            head + self.chat.read_messages(values[side], f"{where}, {side}") for side in SIDES
        )
        for side, turns in zip(SIDES, (chosen, rejected)):
            if not turns or turns[-1]["role"] != "assistant":
                last = turns[-1]["role"] if turns else "nothing"
                raise ValueError(
                    f"{where}: {side} must end with the assistant's reply, but ends with {last}"
                )
        if chosen[:-1] != rejected[:-1]:
            at = next((k for k, (a, b) in enumerate(zip(chosen, rejected)) if a != b), None)
            at = min(len(chosen), len(rejected)) - 1 if at is None else at
            raise ValueError(
                f"{where}: chosen and rejected differ at message {at}, before their last "
                "assistant message: a pair's conversations must share everything but the reply"
            )
        return chosen, rejected


def _tokenize_batch(batch: dict, indices: list, tokenizer: Any, fmt: PairFormat, template: str):
    out = empty_batch()
    for row, index in enumerate(indices):
        conversations = fmt.read({column: values[row] for column, values in batch.items()}, index)
        reason = EMPTY if any(not c[-1]["content"].strip() for c in conversations) else ""
        sides, reason = tokenize_sides(tokenizer, conversations, template, index, EMPTY, reason)
        reason = reason or (IDENTICAL if sides[0][0] == sides[1][0] else "")
        add_sides(out, sides, reason)
    return out


class DPODataModule(TwoRowDataModule):
    """Preference pairs from jsonl/json/parquet files or ``save_to_disk`` directories.

    Args:
        paths: files or globs (``.jsonl``/``.json``, ``.parquet``) or saved dataset directories.
        tokenizer: path to an HF tokenizer directory.
        seq_length: tokens per row ``S``: prompt + chosen and prompt + rejected together.
        columns: our field names (``prompt``, ``chosen``, ``rejected``, ``role``, ``content``)
            to the dataset's, e.g. ``{"prompt": "question"}``; ``{"prompt": None}`` ignores a
            prompt column when ``chosen``/``rejected`` hold whole conversations.
        roles: the dataset's role names to ours, e.g. ``{"human": "user", "gpt": "assistant"}``.
        chat_template: None (the tokenizer's), ``"chatml"`` (built in) or a Jinja template.
        val_split: fraction of the pairs held out for validation (0: none).
        seed: seed of the split and of the per-epoch shuffle.
        shuffle: reshuffle training rows every epoch.
        num_workers: DataLoader worker processes.
        num_proc: processes for tokenizing with ``datasets.map``.
        cache_dir: ``datasets`` cache directory (its default when None).

    Pairs that cannot be trained on are dropped and counted, never cut: an empty reply, identical
    replies (no preference to learn), a prompt longer than ``S``, or a pair longer than ``S``.
    After ``setup``, ``stats`` holds the counts by reason and per split the pairs, their tokens
    and the fraction of row positions they fill.
    """

    item, cache_name, desc = "pair", "dpo", "Tokenizing preference pairs"
    tokenize_batch, title, logger = staticmethod(_tokenize_batch), "DPO", log

    def _format(self, column_names: list[str]) -> PairFormat:
        return PairFormat.detect(column_names, self.hparams.columns, self.hparams.roles)
