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
from collections import Counter
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence, Union

import numpy as np
from lightning.fabric.utilities.rank_zero import rank_zero_only

from lightning_mcore.data import peek
from lightning_mcore.data.chat import (
    ChatFormat,
    resolve_template,
    tokenize_conversation,
)
from lightning_mcore.data.feeding import DataParallelDataModule
from lightning_mcore.data.packing import efficiency
from lightning_mcore.data.sft import (
    SFTRows,
    check_options,
    check_template,
    load_records,
    map_cached,
    naming_files,
    split_samples,
)

log = logging.getLogger(__name__)

FIELDS = ("prompt", "chosen", "rejected", "role", "content")
SIDES = ("chosen", "rejected")
# Drop reasons that do not depend on seq_length (decided when tokenizing) and those that do.
EMPTY, IDENTICAL = "empty response", "chosen and rejected identical"
LONG_PROMPT, LONG_PAIR = "prompt longer than seq_length", "pair longer than seq_length"


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
        unknown = sorted(set(columns or {}) - set(FIELDS))
        if unknown:
            raise ValueError(f"columns maps unknown fields {unknown}: the fields are {FIELDS}")
        names: dict = {field: field for field in FIELDS} | dict(columns or {})
        have = list(column_names)
        for side in SIDES:
            if names[side] not in have:
                raise ValueError(
                    f"column {names[side]!r} ({side} replies) not found; columns found: {have}; "
                    f"name yours with columns={{{side!r}: 'your_column'}}"
                )
        if names["prompt"] not in have:
            names["prompt"] = None
        turns = {"role": names.pop("role"), "content": names.pop("content")}
        return cls(names, ChatFormat("messages", turns, dict(roles or {})))

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


def fitting_items(tokenized: Any, seq_length: int, noun: str,
                  columns: Sequence[str] = ()) -> tuple[dict, np.ndarray, np.ndarray, Counter]:
    """Items tokenized as two rows each (``2 * i``, ``2 * i + 1``: DPO's pairs, KTO's examples):
    (their ``length``, ``prompt_length``, ``dropped`` and ``columns`` as numpy arrays, the sides'
    lengths [items, 2], the items that fit a row of ``seq_length``, dropped counts by reason).
    Refuses when no item fits."""
    names = ["length", "prompt_length", "dropped", *columns]
    numbers = tokenized.select_columns(names).with_format("numpy")[:]
    lengths = numbers["length"].reshape(-1, 2)
    dropped = Counter(r for r in numbers["dropped"][::2].tolist() if r)
    keep, lost = fit_pairs(lengths, numbers["prompt_length"][::2], seq_length)
    dropped.update(lost)
    if len(keep) == 0:
        raise ValueError(f"no {noun} left to train on of {len(lengths)}: {dict(dropped)}")
    return numbers, lengths, keep, dropped


class DPODataModule(DataParallelDataModule):
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
        super().__init__()
        self.paths = [paths] if isinstance(paths, str) else list(paths)
        check_options(self.paths, seq_length, val_split, tokenizer)
        self.save_hyperparameters()
        self.stats: dict[str, Any] = {}
        check_template(self, chat_template)
        peek.check_records(self.paths, lambda names: PairFormat.detect(names, columns, roles).read)

    def prepare_data(self) -> None:
        """Tokenize once per node (Lightning runs this on local rank 0); setup() hits the cache."""
        self._tokenize()

    def _tokenize(self) -> Any:
        """Two tokenized rows per pair: ``2 * i`` its chosen conversation, ``2 * i + 1`` its
        rejected one, so ``SFTRows`` builds the pair's row from ``[2 * i, 2 * i + 1]``."""
        import datasets

        hp = self.hparams
        records = load_records(self.paths, hp.cache_dir)
        pairs = PairFormat.detect(records.column_names, hp.columns, hp.roles)
        records = records.select_columns(pairs.record_columns)
        template = resolve_template(self.tokenizer, hp.chat_template)
        ints, mask = datasets.Value("int32"), datasets.Sequence(datasets.Value("int8"))
        ids = datasets.Sequence(datasets.Value("int32"))
        features = dict(input_ids=ids, assistant_mask=mask, length=ints, prompt_length=ints)
        features["dropped"] = datasets.Value("string")
        how = [sorted(pairs.names.items()), sorted(pairs.chat.names.items())]
        how.append(sorted(pairs.chat.roles.items()))
        with naming_files(self.paths):
            return map_cached(
                records,
                _tokenize_batch,
                features,
                key=("dpo", self.tokenizer, template, how),
                fn_kwargs={"tokenizer": self.tokenizer, "pairs": pairs, "template": template},
                num_proc=hp.num_proc,
                cache_dir=hp.cache_dir,
                desc="Tokenizing preference pairs",
            )

    def setup(self, stage: Optional[str] = None) -> None:
        if self.train_dataset is not None:
            return
        hp, tokenized = self.hparams, self._tokenize()
        _, lengths, keep, dropped = fitting_items(tokenized, hp.seq_length, "pair")
        self.stats = {"pairs": len(lengths), "dropped": dict(dropped)}
        train, val = split_samples(keep.tolist(), hp.val_split, hp.seed, "pairs")
        self.train_dataset = self._rows("train", tokenized, train, lengths)
        self.val_dataset = self._rows("val", tokenized, val, lengths) if val else None
        _log_stats(self.stats, hp.seq_length)

    def _rows(self, split: str, tokenized: Any, pairs: list[int], lengths: np.ndarray) -> SFTRows:
        """One row per pair; the split's numbers go into ``stats``."""
        S, sizes = self.hparams.seq_length, lengths[pairs].sum(axis=1).tolist()
        self.stats[split] = {
            "pairs": len(pairs),
            "tokens": sum(sizes),
            "fill": efficiency(sizes, [[i] for i in range(len(pairs))], S),
        }
        return SFTRows(tokenized, [[2 * i, 2 * i + 1] for i in pairs], S, self.pad_token_id)


def _tokenize_batch(batch: dict, indices: list, tokenizer: Any, pairs: PairFormat, template: str):
    out: dict[str, list] = {n: [] for n in ("input_ids", "assistant_mask", "length")}
    out |= {"prompt_length": [], "dropped": []}
    for row, index in enumerate(indices):
        conversations = pairs.read({column: values[row] for column, values in batch.items()}, index)
        reason = EMPTY if any(not c[-1]["content"].strip() for c in conversations) else ""
        if not reason:
            sides = [
                tokenize_conversation(tokenizer, turns, template, index, last_only=True)
                for turns in conversations
            ]
            reason = EMPTY if any(1 not in mask for _, mask in sides) else ""
            reason = reason or (IDENTICAL if sides[0][0] == sides[1][0] else "")
        sides = [([], []), ([], [])] if reason else sides
        # The reply is the tail of the rendering; both share the prompt's tokens before it.
        prompt = sides[0][1].index(1) if not reason else 0
        for ids, mask in sides:
            out["input_ids"].append(ids)
            out["assistant_mask"].append(mask)
            out["length"].append(len(ids))
            out["prompt_length"].append(prompt)
            out["dropped"].append(reason)
    return out


@rank_zero_only
def _log_stats(stats: Mapping[str, Any], seq_length: int) -> None:
    train, val = stats["train"], stats.get("val")
    log.info(
        f"DPO data: {stats['pairs']} pairs; training: {train['pairs']} rows of one pair, "
        f"{train['tokens']} tokens filling {train['fill']:.1%} of the positions"
        + (f"; validation: {val['pairs']} pairs" if val else "")
    )
    if stats["dropped"]:
        log.warning(
            f"DPO data: dropped {stats['dropped']} of {stats['pairs']} pairs "
            f"(seq_length={seq_length})"
        )
