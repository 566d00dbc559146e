"""What a memory plan reads: the model, the layout, the precision, the optimizer, LoRA and the
micro batch, as the strategy and the module hold them (no process, no GPU)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Optional

from lightning_mcore.lora.config import LoRAConfig
from lightning_mcore.model.config import GPTConfig
from lightning_mcore.strategy.optimizer import OptimizerSettings
from lightning_mcore.strategy.parallel import ParallelConfig


@dataclass(frozen=True)
class PlanInputs:
    """One training run's settings. `parallel`: the layout with the device's defaults settled
    (MegatronStrategy.check_run returns it); `bf16`: bf16 weights (bf16-mixed), else fp32;
    `fused`: Transformer Engine's layers (the norm fused into the next linear, a fused SwiGLU),
    False: mcore's local layers as on CPU, whose norms and SwiGLU keep more for backward;
    `vision_parameters`: the vision encoder's size (first pipeline stage), counted by the
    caller from the family's module (plan/run.py)."""

    model: GPTConfig
    parallel: ParallelConfig
    world_size: int
    micro_batch_size: int = 1
    global_batch_size: int = 1
    bf16: bool = True
    optim: OptimizerSettings = field(default_factory=OptimizerSettings)
    lora: Optional[LoRAConfig] = None
    fused: bool = True
    vision_parameters: int = 0

    @property
    def data_parallel_size(self) -> int:
        return self.parallel.data_parallel_size(self.world_size)

    @property
    def expert_data_parallel_size(self) -> int:
        """The ranks an expert's parameters are replicated over (mcore's expert-DP group)."""
        p = self.parallel
        etp = p.expert_tensor_parallel_size or p.tensor_model_parallel_size
        return self.world_size // (p.pipeline_model_parallel_size * p.expert_model_parallel_size * etp)

    @property
    def num_microbatches(self) -> int:
        return max(1, self.global_batch_size // (self.micro_batch_size * self.data_parallel_size))

    def with_micro_batch(self, micro_batch_size: int) -> "PlanInputs":
        return replace(self, micro_batch_size=micro_batch_size)
