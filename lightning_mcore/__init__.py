"""Train and fine-tune LLMs with Megatron-Core parallelism from plain Lightning."""

from lightning_mcore import quiet

quiet.install()  # before megatron.core is imported: its import warns

from lightning_mcore.callbacks import HFExport, MegatronThroughput
from lightning_mcore.lora.config import LoRAConfig
from lightning_mcore.model.config import GPTConfig
from lightning_mcore.objectives.base import MegatronModule
from lightning_mcore.objectives.distill import DistillModule, DistillSettings
from lightning_mcore.objectives.dpo import DPOModule
from lightning_mcore.objectives.grpo import GRPOModule, GRPOSampling, RolloutCorrection
from lightning_mcore.objectives.grpo_variants import DynamicSampling, OverlongShaping
from lightning_mcore.objectives.kto import KTOModule
from lightning_mcore.objectives.pretrain import PretrainModule
from lightning_mcore.objectives.reward import RewardModule
from lightning_mcore.objectives.sft import SFTModule
from lightning_mcore.objectives.vision_language import Freezing, VisionLanguageSFTModule
from lightning_mcore.strategy.checkpoint_io import CheckpointOptions
from lightning_mcore.strategy.megatron import MegatronStrategy
from lightning_mcore.strategy.optimizer import OptimizerSettings
from lightning_mcore.strategy.parallel import BatchConfig, LayoutError, ParallelConfig

__all__ = [
    "BatchConfig",
    "CheckpointOptions",
    "DistillModule",
    "DistillSettings",
    "DPOModule",
    "DynamicSampling",
    "Freezing",
    "GPTConfig",
    "GRPOModule",
    "GRPOSampling",
    "HFExport",
    "KTOModule",
    "LayoutError",
    "LoRAConfig",
    "MegatronModule",
    "MegatronStrategy",
    "MegatronThroughput",
    "OverlongShaping",
    "OptimizerSettings",
    "ParallelConfig",
    "PretrainModule",
    "RewardModule",
    "RolloutCorrection",
    "SFTModule",
    "VisionLanguageSFTModule",
]
__version__ = "0.1.0"
