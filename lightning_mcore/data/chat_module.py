"""The base of the chat data modules (SFT, DPO, KTO): what they do alike, so that each holds only
its record format, its tokenizing and how it builds rows.

Alike: the arguments checked in ``__init__`` (files, tokenizer, chat template, the records' first
lines), tokenizing once per node in ``prepare_data`` with the result cached, a sample's error
naming the data files, and ``setup`` building the datasets once.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Optional, Union

from lightning_mcore.data import peek
from lightning_mcore.data.chat import resolve_template
from lightning_mcore.data.chat_records import (
    check_options,
    check_template,
    load_records,
    map_cached,
    naming_files,
)
from lightning_mcore.data.feeding import DataParallelDataModule


class ChatDataModule(DataParallelDataModule):
    """Subclasses give ``_format``, ``_tokenize`` (the tokenized dataset, cached: ``_map``) and
    ``_build`` (``train_dataset``, ``val_dataset`` and ``stats`` from it); their ``__init__``
    keeps its own arguments and passes these on, so that the hyperparameters saved are theirs."""

    def __init__(self, paths: Union[str, list[str]], tokenizer: str, seq_length: Any,
                 val_split: float, chat_template: Optional[str]) -> None:
        super().__init__()
        self.paths = [paths] if isinstance(paths, str) else list(paths)
        check_options(self.paths, seq_length, val_split, tokenizer)
        # the subclass's arguments (and those of any class above it), as if it called this itself
        self.save_hyperparameters(frame=inspect.currentframe().f_back)
        self._check_hparams()
        self.stats: dict[str, Any] = {}
        check_template(self, chat_template)
        peek.check_records(self.paths, lambda names: self._format(names).read)

    def _check_hparams(self) -> None:
        """A subclass's own argument checks, made before the data is looked at."""

    def _format(self, column_names: list[str]) -> Any:
        """The record format (``ChatFormat``, ``PairFormat``...) for a dataset of these columns:
        it refuses missing columns and reads records with ``read(record, index)``."""
        raise NotImplementedError

    def prepare_data(self) -> None:
        """Tokenize once per node (Lightning runs this on local rank 0); setup() hits the cache."""
        self._tokenize()

    def setup(self, stage: Optional[str] = None) -> None:
        if self.train_dataset is None:
            self._build(self._tokenize())

    def _records(self) -> tuple[Any, Any]:
        """(the records, holding only the columns their format reads; that format)."""
        records = load_records(self.paths, self.hparams.cache_dir)
        fmt = self._format(records.column_names)
        return records.select_columns(fmt.record_columns), fmt

    def _map(self, records: Any, function: Callable, features: dict, key: tuple[str, Any],
             fn_kwargs: dict, desc: str) -> Any:
        """``map_cached`` with this module's tokenizer and chat template (``fn_kwargs`` get both
        as ``tokenizer`` and ``template``); ``key`` is (name, how the records are read). A
        sample's error names the data files."""
        template = resolve_template(self.tokenizer, self.hparams.chat_template)
        name, how = key
        with naming_files(self.paths):
            return map_cached(
                records,
                function,
                features,
                key=(name, self.tokenizer, template, how),
                fn_kwargs={"tokenizer": self.tokenizer, **fn_kwargs, "template": template},
                num_proc=self.hparams.num_proc,
                cache_dir=self.hparams.cache_dir,
                desc=desc,
            )
