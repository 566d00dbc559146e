"""Pretraining data: packed token sequences fed per data-parallel rank, resumable mid-epoch."""

from lightning_mcore.data.indexed import HFTokenizerAdapter, build_indexed_datasets
from lightning_mcore.data.pretrain import PackedSequences, PretrainDataModule
from lightning_mcore.data.sampler import DataParallelSampler

__all__ = [
    "DataParallelSampler",
    "HFTokenizerAdapter",
    "PackedSequences",
    "PretrainDataModule",
    "build_indexed_datasets",
]
