"""MemoryPlanReport: the memory plan's figure beside the measured allocator peak, once, after
the first steps of a GPU run (`lightning-mcore plan` says before launch what this checks)."""

from __future__ import annotations

import sys

import lightning as L
import torch

from lightning_mcore.plan.memory import GiB, stage_plan
from lightning_mcore.plan.parameters import PlanError
from lightning_mcore.plan.run import plan_inputs


def report_line(planned: int, peak: int, steps: int, during_setup: bool = False) -> str:
    """`during_setup`: the peak was reached before training (building and loading the model: a
    LoRA base held in FP8, NF4 or MXFP4 is built in bf16 first), so training's own peak is below it."""
    setup = (" (reached while building and loading the model, before training: training's own peak is "
             "lower)") if during_setup else ""
    return (f"memory: planned {planned / GiB:.1f} GiB per GPU (pipeline stage 0), measured peak "
            f"{peak / GiB:.1f} GiB allocated after {steps} steps{setup} ({(planned - peak) / peak:+.1%} "
            f"planned); lightning-mcore plan --config ... gives the plan before launch.")


def planned_total(trainer, pl_module) -> int:
    """The plan's bytes per GPU (pipeline stage 0) for the run `trainer` is training `pl_module`
    in; PlanError for a model the plan does not count."""
    strategy = trainer.strategy
    inputs = plan_inputs(strategy, pl_module, strategy.parallel, trainer.world_size,
                         strategy.dtype == torch.bfloat16, on_gpu=True)
    return stage_plan(inputs, 0).total


class MemoryPlanReport(L.Callback):
    """After `after_steps` optimizer steps on GPU, rank 0 (pipeline stage 0) writes its plan's
    total and torch.cuda.max_memory_allocated() to stderr. Nothing on CPU."""

    def __init__(self, after_steps: int = 3) -> None:
        self.after_steps = after_steps
        self.setup_peak: int | None = None

    def on_train_start(self, trainer, pl_module) -> None:
        if trainer.strategy.root_device.type == "cuda":
            self.setup_peak = torch.cuda.max_memory_allocated(trainer.strategy.root_device)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        strategy = trainer.strategy
        if trainer.global_step != self.after_steps or not trainer.is_global_zero or strategy.root_device.type != "cuda":
            return
        try:
            planned = planned_total(trainer, pl_module)
        except (PlanError, AttributeError):  # a model the plan does not count, or not ours
            return
        except Exception as error:  # noqa: BLE001 - a report must not end a training run
            sys.stderr.write(f"memory: no plan for this run ({type(error).__name__}: {error}).\n")
            return
        peak = torch.cuda.max_memory_allocated(strategy.root_device)
        during_setup = self.setup_peak is not None and peak <= self.setup_peak
        sys.stderr.write(report_line(planned, peak, self.after_steps, during_setup) + "\n")
