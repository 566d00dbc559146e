"""LightningDataModule of prompts for on-policy training (GRPOModule): no replies, just questions.

Each record's ``prompt`` (a string, read as a user turn, or a message list) is rendered with the
chat template and the generation prompt (``<|im_start|>assistant\\n`` in ChatML), as SFT renders
conversations. Batches are dicts of lists: ``prompt_ids`` (token ids), ``prompt`` (the record's
prompt as given) and every other column of the dataset (e.g. ``answer``), which the reward
functions receive as keyword arguments.

A step of GRPO trains on ``num_generations`` completions per prompt: each data-parallel rank
gets ``global_batch_size / dp / num_generations`` prompts, and with ``num_iterations`` > 1 the
same batch again for each optimizer step on that rollout (no prompt is skipped). Both numbers
are read from the module being trained.
"""

from __future__ import annotations

import logging
from typing import Any, Optional, Union

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_only
from torch.utils.data import DataLoader, Dataset

from lightning_mcore.data import peek
from lightning_mcore.data.chat import ChatFormat, resolve_template
from lightning_mcore.data.feeding import DataParallelDataModule, _layout, _SeatedLoader
from lightning_mcore.data.sampler import DataParallelSampler
from lightning_mcore.data.chat_module import check_options, check_template, load_records

log = logging.getLogger(__name__)


class Prompts(Dataset):
    """Records with their rendered prompt's ``prompt_ids``."""

    def __init__(self, records: list[dict], prompt_ids: list[list[int]], prompt_column: str):
        self.records, self.prompt_ids, self.column = records, prompt_ids, prompt_column

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> dict:
        record = dict(self.records[index])
        return {**record, "prompt": record.pop(self.column), "prompt_ids": self.prompt_ids[index]}


def collate_prompts(items: list[dict]) -> dict[str, list]:
    """A batch as lists, one per key (reward columns may hold anything)."""
    return {key: [item[key] for item in items] for key in items[0]}


class RepeatedBatches(DataParallelSampler):
    """DataParallelSampler whose every batch comes `repeats` times in a row."""

    def __init__(self, *args: Any, repeats: int = 1, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.repeats = repeats

    def __iter__(self):
        batch = []
        for index in super().__iter__():
            batch.append(index)
            if len(batch) == self.batch_size:
                for _ in range(self.repeats):
                    yield from batch
                batch = []

    def __len__(self) -> int:
        return super().__len__() * self.repeats


class PromptDataModule(DataParallelDataModule):
    """Prompts from jsonl/json/parquet files or ``save_to_disk`` directories.

    Args:
        paths: files or globs (``.jsonl``/``.json``, ``.parquet``) or saved dataset directories.
        tokenizer: path to an HF tokenizer directory.
        max_prompt_length: the longest prompt kept, in tokens (with the template); longer ones
            are dropped and counted. It plus the module's max_completion_length must fit the
            model's seq_length (checked before training starts).
        prompt: the dataset's column holding the prompt.
        roles: the dataset's role names to ours, for message-list prompts.
        chat_template: None (the tokenizer's), ``"chatml"`` (built in) or a Jinja template.
        seed, shuffle, num_workers, cache_dir: as for SFTDataModule.
    """

    def __init__(
        self,
        paths: Union[str, list[str]],
        tokenizer: str,
        max_prompt_length: int,
        prompt: str = "prompt",
        roles: Optional[dict[str, str]] = None,
        chat_template: Optional[str] = None,
        seed: int = 1234,
        shuffle: bool = True,
        num_workers: int = 0,
        cache_dir: Optional[str] = None,
    ) -> None:
        super().__init__()
        self.paths = [paths] if isinstance(paths, str) else list(paths)
        check_options(self.paths, max_prompt_length, 0.0, tokenizer)
        self.save_hyperparameters()
        # The longest row this module yields (DataParallelDataModule's seq_length; the CLI
        # checks it against the model's): a prompt, its completion comes on top.
        self.hparams["seq_length"] = max_prompt_length
        self.stats: dict[str, Any] = {}
        check_template(self, chat_template)
        peek.check_records(self.paths, lambda names: self._reader(names))

    @property
    def max_prompt_length(self) -> int:
        return self.hparams.max_prompt_length

    @property
    def stop_token_ids(self) -> list[int]:
        """Tokens that end a completion: end-of-sequence, and ChatML's end of turn if known."""
        tok, ids = self.tokenizer, set()
        if tok.eos_token_id is not None:
            ids.add(int(tok.eos_token_id))
        end = tok.convert_tokens_to_ids("<|im_end|>")
        if isinstance(end, int) and end != tok.unk_token_id:
            ids.add(end)
        return sorted(ids)

    def _reader(self, columns: list[str]):
        """``read(record, index)``: the record's prompt as messages (refusing a missing column)."""
        column = self.hparams.prompt
        if column not in columns:
            raise ValueError(f"column {column!r} (the prompts) not found; columns found: {columns}; "
                             f"name yours with prompt='your_column'")
        chat = ChatFormat("messages", {"role": "role", "content": "content"}, dict(self.hparams.roles or {}))

        def read(record: dict, index: int) -> list[dict]:
            value = record.get(column)
            if isinstance(value, str):
                return [{"role": "user", "content": value}]
            if isinstance(value, list):
                return chat.read_messages(value, f"sample {index}")
            raise ValueError(f"sample {index}: {column!r} must be a string or a message list, "
                             f"got {type(value).__name__}")

        return read

    def setup(self, stage: Optional[str] = None) -> None:
        if self.train_dataset is not None:
            return
        hp = self.hparams
        records = load_records(self.paths, hp.cache_dir)
        read = self._reader(records.column_names)
        template = resolve_template(self.tokenizer, hp.chat_template)
        kept, ids, long = [], [], 0
        for index, record in enumerate(records):
            try:
                messages = read(record, index)
            except ValueError as err:
                raise ValueError(f"{', '.join(self.paths)}: {err}") from None
            text = self.tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                                      add_generation_prompt=True)
            tokens = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            if len(tokens) > hp.max_prompt_length:
                long += 1
                continue
            kept.append(record)
            ids.append(tokens)
        self.stats = {"prompts": len(records), "dropped": long}
        if not kept:
            raise ValueError(f"{', '.join(self.paths)}: every one of the {len(records)} prompts is "
                             f"longer than max_prompt_length={hp.max_prompt_length} tokens")
        self.train_dataset = Prompts(kept, ids, hp.prompt)
        _log_stats(self.stats, hp.max_prompt_length)

    def _plan(self) -> tuple[int, int]:
        """(num_generations, num_iterations) of the module being trained (1, 1 for others)."""
        module = self.trainer.lightning_module
        return int(getattr(module, "num_generations", 1)), int(getattr(module, "num_iterations", 1))

    def _prompts_per_rank(self) -> int:
        _, _, rows = _layout(self.trainer, type(self).__name__)
        generations, _ = self._plan()
        if rows % generations:
            raise ValueError(f"{rows} completions per data-parallel rank do not split into groups of "
                             f"num_generations={generations}")
        return rows // generations

    def _consumed_samples(self) -> int:
        """Prompts consumed at the trainer's step: one batch per `num_iterations` steps."""
        _, dp_size, _ = _layout(self.trainer, type(self).__name__)
        consumed, step = self._resume
        _, iterations = self._plan()
        steps = (self.trainer.global_step - step) // iterations
        return max(0, consumed + steps * self._prompts_per_rank() * dp_size)

    def train_dataloader(self) -> DataLoader:
        if self.train_dataset is None:
            self.setup("fit")
        rank, dp_size, _ = _layout(self.trainer, type(self).__name__)
        batch_size, (_, iterations) = self._prompts_per_rank(), self._plan()
        try:
            sampler = RepeatedBatches(len(self.train_dataset), batch_size, rank, dp_size,
                                      shuffle=self.hparams.shuffle, seed=self.hparams.seed,
                                      consumed_samples=self._consumed_samples(), repeats=iterations)
        except ValueError as err:
            raise ValueError(f"prompts ({', '.join(self.paths)}): {err}") from None
        return _SeatedLoader(self.train_dataset, batch_size=batch_size, sampler=sampler,
                             num_workers=self.hparams.num_workers, collate_fn=collate_prompts,
                             position=self._consumed_samples)

    def sample_prompts(self, count: int, seed: int) -> dict[str, list]:
        """`count` prompts drawn at random (with replacement) from the training prompts, as a
        batch: DAPO's dynamic sampling refills with them. The same draw for the same `seed` on
        the ranks of one model-parallel group, another on each data-parallel rank."""
        if self.train_dataset is None:
            self.setup("fit")
        rank = _layout(self.trainer, type(self).__name__)[0]
        gen = torch.Generator().manual_seed((seed * 1_000_003 + rank) % 2**63)
        picks = torch.randint(len(self.train_dataset), (count,), generator=gen).tolist()
        return collate_prompts([self.train_dataset[i] for i in picks])

    def val_dataloader(self) -> list:
        return []


@rank_zero_only
def _log_stats(stats: dict, max_prompt_length: int) -> None:
    log.info(f"Prompt data: {stats['prompts'] - stats['dropped']} of {stats['prompts']} prompts kept")
    if stats["dropped"]:
        log.warning(f"Prompt data: dropped {stats['dropped']} prompts longer than "
                    f"max_prompt_length={max_prompt_length} tokens")
