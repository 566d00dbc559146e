"""Read mcore indexed datasets (.bin/.idx) through mcore's own GPTDataset.

Large corpora are tokenized once (``python -m lightning_mcore.data.preprocess``) and read
memory-mapped, with mcore's document/sample/shuffle indices cached next to the data.
"""

from __future__ import annotations

import dataclasses
import os
from collections import OrderedDict
from typing import Any, Optional, Sequence

import torch
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
from torch.utils.data import Dataset

from megatron.core.tokenizers import MegatronTokenizerBase

BATCH_KEYS = {
    "tokens": torch.int64,
    "labels": torch.int64,
    "loss_mask": torch.float32,
    "position_ids": torch.int64,
}


class HFTokenizerAdapter(MegatronTokenizerBase):
    """The part of mcore's tokenizer interface GPTDataset uses, backed by an HF tokenizer.

    GPTDataset reads ``eod`` (document separator), ``pad`` (masked out of the loss),
    ``vocab_size`` (token dtype) and ``unique_identifiers`` (its cache key).
    """

    def __init__(self, tokenizer: Any, path: str) -> None:
        self.tokenizer, self.path = tokenizer, path

    @property
    def unique_identifiers(self) -> OrderedDict:
        return OrderedDict(
            [
                ("class", type(self).__name__),
                ("tokenizer_path", self.path),
                ("vocab_size", self.vocab_size),
            ]
        )

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)

    @property
    def vocab(self) -> dict:
        return self.tokenizer.get_vocab()

    @property
    def eod(self) -> int:
        return self.tokenizer.eos_token_id

    eos = eod

    @property
    def bos(self) -> Optional[int]:
        return self.tokenizer.bos_token_id

    @property
    def pad(self) -> int:
        """-1 (never a token id) when the tokenizer has no pad token, as mcore does."""
        pad = self.tokenizer.pad_token_id
        return -1 if pad is None else pad

    def tokenize(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def detokenize(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids)

    def apply_chat_template(self, *args: Any, **kwargs: Any) -> Any:
        return self.tokenizer.apply_chat_template(*args, **kwargs)


class BatchContractView(Dataset):
    """Keep only the four batch-contract tensors of an mcore sample, in the contract's dtypes."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        sample = self.dataset[int(index)]
        return {key: torch.as_tensor(sample[key]).to(dtype) for key, dtype in BATCH_KEYS.items()}


def build_indexed_datasets(
    prefixes: Sequence[str],
    tokenizer: Any,
    tokenizer_path: str,
    seq_length: int,
    seed: int,
    val_split: float = 0.0,
    cache_dir: Optional[str] = None,
) -> tuple[Dataset, Optional[Dataset]]:
    """Build one epoch of train (and validation) GPTDataset samples from indexed prefixes.

    mcore splits by documents, so ``val_split`` is a fraction of documents here. Must run on
    every rank: when torch.distributed is up, rank 0 builds the index cache first.
    """
    for prefix in prefixes:
        missing = [p for p in (prefix + ".bin", prefix + ".idx") if not os.path.isfile(p)]
        if missing:
            raise FileNotFoundError(
                f"indexed dataset {prefix!r} lacks {', '.join(missing)}; "
                "build it with python -m lightning_mcore.data.preprocess"
            )
    if tokenizer.eos_token_id is None:
        raise ValueError(f"the tokenizer at {tokenizer_path!r} has no eos_token, which mcore needs")
    if len(prefixes) > 1 and not torch.distributed.is_initialized():
        cache_dir = (
            None  # mcore's BlendedDataset can only write a cache_dir under torch.distributed
        )
    options = dict(
        random_seed=seed,
        sequence_length=seq_length,
        blend=(list(prefixes), None),
        split=f"{1.0 - val_split:.6f},{val_split:.6f},0",
        tokenizer=HFTokenizerAdapter(tokenizer, tokenizer_path),
        path_to_cache=cache_dir,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
    )
    known = {field.name for field in dataclasses.fields(GPTDatasetConfig)}
    config = GPTDatasetConfig(**{k: v for k, v in options.items() if k in known})
    train, val, _ = BlendedMegatronDatasetBuilder(
        GPTDataset, [None, None, None], lambda: True, config
    ).build()
    if train is None or len(train) == 0:
        raise ValueError(
            f"indexed datasets {list(prefixes)} give no training sequence "
            f"of {seq_length + 1} tokens"
        )
    if val_split > 0 and (val is None or len(val) == 0):
        raise ValueError(
            f"val_split={val_split} of the documents in {list(prefixes)} gives no "
            f"validation sequence of {seq_length + 1} tokens"
        )
    return BatchContractView(train), (BatchContractView(val) if val_split > 0 else None)
