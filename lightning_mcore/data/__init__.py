"""Training data fed per data-parallel rank, resumable mid-epoch: packed token sequences for
pretraining, chat conversations with assistant-only loss for fine-tuning, preference pairs one
per row for DPO and reward models, unpaired labelled examples one per row for KTO, chats with
images for vision-language models."""

from lightning_mcore.data.dpo import DPODataModule
from lightning_mcore.data.indexed import HFTokenizerAdapter, build_indexed_datasets
from lightning_mcore.data.kto import KTODataModule
from lightning_mcore.data.multimodal import ImageOptions, VisionLanguageDataModule
from lightning_mcore.data.pretrain import PackedSequences, PretrainDataModule
from lightning_mcore.data.prompts import PromptDataModule
from lightning_mcore.data.reward import RewardDataModule
from lightning_mcore.data.sampler import DataParallelSampler
from lightning_mcore.data.sft import SFTDataModule

__all__ = [
    "DPODataModule",
    "DataParallelSampler",
    "HFTokenizerAdapter",
    "ImageOptions",
    "KTODataModule",
    "PackedSequences",
    "PretrainDataModule",
    "PromptDataModule",
    "RewardDataModule",
    "SFTDataModule",
    "VisionLanguageDataModule",
    "build_indexed_datasets",
]
