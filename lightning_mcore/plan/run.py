"""PlanInputs of a run: its strategy (layout, batch) and module (model, optimizer, LoRA), as a
config builds them, for the device the run will train on."""

from __future__ import annotations

import torch

from lightning_mcore import models
from lightning_mcore.plan.inputs import PlanInputs
from lightning_mcore.strategy.optimizer import OptimizerSettings


def vision_parameters(module) -> int:
    """The vision encoder's parameters (transformers' module, built on the meta device: no
    memory, no weights read)."""
    cfg = module.model_config
    if cfg.vision is None:
        return 0
    with torch.device("meta"):
        encoder = models.vision_encoder(cfg, getattr(module, "hf_family", None))
    return sum(p.numel() for p in encoder.parameters())


def plan_inputs(strategy, module, parallel, world_size: int, bf16: bool, on_gpu: bool) -> PlanInputs:
    """The plan's view of `module` trained by `strategy` on `world_size` ranks; `parallel`: the
    layout with the device's defaults settled (MegatronStrategy.check_run returns it)."""
    cfg, optim = module.model_config, getattr(module, "optim", None)
    optim = optim if isinstance(optim, OptimizerSettings) else OptimizerSettings()
    return PlanInputs(
        model=cfg, parallel=parallel, world_size=world_size,
        micro_batch_size=strategy.batch.micro_batch_size,
        global_batch_size=strategy.batch.global_batch_size, bf16=bf16, optim=optim,
        lora=getattr(module, "lora", None),
        fused=on_gpu and cfg.transformer_impl != "local", vision_parameters=vision_parameters(module),
    )
