"""What the chat data modules (SFT, DPO, KTO; multimodal and prompt data in part) share: the
checks made before training starts, loading records from jsonl/json/parquet files or
``save_to_disk`` directories, the seeded validation split, tokenizing cached under a fingerprint
of the data and the tokenizer, and ``ChatDataModule``, their base: each subclass holds only its
record format, its tokenizing and its rows."""

from __future__ import annotations

import hashlib
import inspect
import os
from contextlib import contextmanager
from typing import Any, Callable, Optional, Sequence, Union

import torch

from lightning_mcore.data import peek, preprocess
from lightning_mcore.data.chat import resolve_template
from lightning_mcore.data.feeding import DataParallelDataModule
from lightning_mcore.data.files import BUILDERS, resolve_files


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
    import datasets  # lazy: datasets' import takes ~0.4 s, which `import lightning_mcore` and `--help` skip

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
    import datasets  # lazy: datasets' import takes ~0.4 s, which `import lightning_mcore` and `--help` skip

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



def token_features(*counts: str, **columns: str) -> dict:
    """The columns of a tokenized chat dataset: ``input_ids``, ``assistant_mask``, the int32
    ``counts``, ``columns`` (name: dtype) and ``dropped`` (the reason, or "": an empty row)."""
    import datasets  # lazy: datasets' import takes ~0.4 s, which `import lightning_mcore` and `--help` skip

    ints, mask = datasets.Value("int32"), datasets.Sequence(datasets.Value("int8"))
    features = dict(input_ids=datasets.Sequence(ints), assistant_mask=mask)
    features |= {name: ints for name in counts}
    features |= {name: datasets.Value(dtype) for name, dtype in columns.items()}
    return features | {"dropped": datasets.Value("string")}


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
