"""The CLI's console: our progress bar and model summary (objectives/console.py) in place of
Lightning's defaults, unless the run turned them off or brought its own; on GPU the memory
plan's figure beside the measured peak after the first steps (callbacks/memory_plan.py)."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import lightning as L
from lightning.pytorch.callbacks import ModelSummary, ProgressBar

from lightning_mcore.callbacks.memory_plan import MemoryPlanReport
from lightning_mcore.objectives.console import MegatronModelSummary, MegatronProgressBar

__all__ = ["MegatronModelSummary", "MegatronProgressBar", "default_console"]


def default_console(trainer_options: Mapping[str, Any], callbacks: Sequence[L.Callback]) -> dict:
    """Trainer arguments that put our bar and summary in place of Lightning's defaults, unless
    the run turned them off or brought its own, and the memory plan's report (GPU runs):
    {"callbacks": [...], ...}."""
    callbacks = list(callbacks)
    extra: dict = {}
    if trainer_options.get("enable_progress_bar") is not False and not any(
        isinstance(c, ProgressBar) for c in callbacks
    ):
        callbacks.append(MegatronProgressBar())
    if trainer_options.get("enable_model_summary") is not False and not any(
        isinstance(c, ModelSummary) for c in callbacks
    ):
        callbacks.append(MegatronModelSummary())
        extra["enable_model_summary"] = False  # Lightning's own summary: ours replaces it
    if not any(isinstance(c, MemoryPlanReport) for c in callbacks):
        callbacks.append(MemoryPlanReport())
    return {"callbacks": callbacks, **extra}
