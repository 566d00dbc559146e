"""What a run shows on the console: progress in optimizer steps, and the whole model's size.

Lightning's defaults assume an epoch-bounded run of a model that lives in one process. Under
`max_steps` its bar reads `Epoch 4/-2` and shows the logger's version as `v_num`; its summary
counts one rank's tensor-parallel shard and prints `Total FLOPs: 0` (it would need an example
input that our chunks cannot take). The CLI uses these two instead (`default_console`).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import lightning as L
from lightning.pytorch.callbacks import ModelSummary, ProgressBar, TQDMProgressBar
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_mcore.model.flops import training_flops_per_token


class MegatronProgressBar(TQDMProgressBar):
    """TQDM's bar ("Epoch N" per epoch), with `step=done/max_steps` in place of `v_num`."""

    def get_metrics(self, trainer, pl_module) -> dict:
        items = super().get_metrics(trainer, pl_module)
        items.pop("v_num", None)
        if trainer.max_steps and trainer.max_steps > 0:
            items = {"step": f"{trainer.global_step}/{trainer.max_steps}", **items}
        return items


class MegatronModelSummary(L.Callback):
    """At the start of fit, two lines from rank 0: the model's shape and parameters (every
    tensor-parallel shard and pipeline stage counted once), and its training FLOPs per token
    (model/flops.py: Megatron's convention, 3 x forward; 2 x with a frozen LoRA base)."""

    def on_fit_start(self, trainer, pl_module) -> None:
        from lightning_mcore.objectives.base import _count_parameters

        cfg = getattr(pl_module, "model_config", None)
        if cfg is None or pl_module.chunks is None:
            return
        total = _count_parameters(pl_module.chunks)  # collective: every rank
        trainable = _count_parameters(pl_module.chunks, trainable_only=True)
        lora = getattr(pl_module, "lora", None) is not None
        flops = training_flops_per_token(cfg, cfg.seq_length, frozen_base=lora)
        groups = cfg.num_query_groups or cfg.num_attention_heads
        rank_zero_info(
            f"Model: {pl_module.hf_family}, {cfg.num_layers} layers, hidden {cfg.hidden_size}, "
            f"{cfg.num_attention_heads} heads / {groups} query groups, vocab {cfg.vocab_size}: "
            f"{total:,} parameters, {trainable:,} trainable\n"
            f"Training FLOPs per token: {flops:,.0f} at seq_length {cfg.seq_length} "
            f"({2 if lora else 3} x forward)"
        )


def default_console(trainer_options: Mapping[str, Any], callbacks: Sequence[L.Callback]) -> dict:
    """Trainer arguments that put our bar and summary in place of Lightning's defaults, unless
    the run turned them off or brought its own: {"callbacks": [...], ...}."""
    callbacks = list(callbacks)
    extra: dict = {}
    if trainer_options.get("enable_progress_bar") is not False and not any(
        isinstance(c, ProgressBar) for c in callbacks
    ):
        callbacks.append(MegatronProgressBar())
    if trainer_options.get("enable_model_summary") is not False and not any(
        isinstance(c, (ModelSummary, MegatronModelSummary)) for c in callbacks
    ):
        callbacks.append(MegatronModelSummary())
        extra["enable_model_summary"] = False  # Lightning's own summary: ours replaces it
    return {"callbacks": callbacks, **extra}
