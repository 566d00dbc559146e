"""What a run of these modules shows on the console: progress in optimizer steps, and the whole
model's size.

Lightning's defaults assume an epoch-bounded run of a model that lives in one process. Under
`max_steps` its bar reads `Epoch 4/-2` and shows the logger's version as `v_num`; its summary
counts one rank's tensor-parallel shard and prints `Total FLOPs: 0` (it would need an example
input that our chunks cannot take). A Python run gets these two in place of Lightning's through
MegatronModule.configure_callbacks (`replacing_defaults`); the CLI puts them in place itself
(callbacks/console.py).
"""

from __future__ import annotations

from typing import Sequence

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelSummary, RichModelSummary, RichProgressBar, TQDMProgressBar
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from megatron.core import parallel_state as ps

from lightning_mcore.model.flops import training_flops_per_token


class _StepsOfMaxSteps:
    """A Lightning bar's metrics with `step=done/max_steps` in place of the logger's `v_num`."""

    def get_metrics(self, trainer, pl_module) -> dict:
        items = super().get_metrics(trainer, pl_module)
        items.pop("v_num", None)
        if trainer.max_steps and trainer.max_steps > 0:
            items = {"step": f"{trainer.global_step}/{trainer.max_steps}", **items}
        return items


class MegatronProgressBar(_StepsOfMaxSteps, TQDMProgressBar):
    """TQDM's bar ("Epoch N" per epoch), with `step=done/max_steps` in place of `v_num`."""


class MegatronRichProgressBar(_StepsOfMaxSteps, RichProgressBar):
    """Rich's bar (Lightning's default where rich is installed), the same way; "Epoch N" without
    the "/-2" Rich adds for a run bounded by max_steps."""

    def _get_train_description(self, current_epoch: int) -> str:
        if self.trainer.max_epochs is not None and self.trainer.max_epochs < 0:
            return f"{'Epoch ' + str(current_epoch):{len(self.validation_description)}}"
        return super()._get_train_description(current_epoch)


class MegatronModelSummary(ModelSummary):
    """At the start of fit, two lines from rank 0: the model's shape and parameters (every
    tensor-parallel shard and pipeline stage counted once), and its training FLOPs per token
    (model/flops.py: Megatron's convention, 3 x forward; 2 x with a frozen LoRA base)."""

    def on_fit_start(self, trainer, pl_module) -> None:
        cfg = getattr(pl_module, "model_config", None)
        if cfg is None or pl_module.chunks is None:
            return
        total = count_parameters(pl_module.chunks)  # collective: every rank
        trainable = count_parameters(pl_module.chunks, trainable_only=True)
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


class MegatronRichModelSummary(MegatronModelSummary, RichModelSummary):
    """Ours, in place of Lightning's Rich summary (its default where rich is installed)."""


# Lightning's default bar and summary (TQDM's or Rich's): ours for each, a subclass of it, which
# is how Lightning swaps in a callback that a module's configure_callbacks returns.
OURS = {TQDMProgressBar: MegatronProgressBar, RichProgressBar: MegatronRichProgressBar,
        ModelSummary: MegatronModelSummary, RichModelSummary: MegatronRichModelSummary}


def replacing_defaults(callbacks: Sequence[L.Callback]) -> list[L.Callback]:
    """Ours for each of Lightning's own bar and summary the Trainer holds (those exact types: a
    subclass the user chose, ours among them, stays). Each carries the replaced one's settings
    (a user's `TQDMProgressBar(refresh_rate=10)` or `ModelSummary(max_depth=3)` keeps them):
    ours are subclasses that add no state, so the instance's attributes pass over whole."""
    replaced = []
    for callback in callbacks:
        if type(callback) in OURS:
            ours = OURS[type(callback)].__new__(OURS[type(callback)])
            ours.__dict__.update(vars(callback))
            replaced.append(ours)
    return replaced


def count_parameters(chunks, trainable_only: bool = False) -> int:
    """Parameters of the whole model: TP shards summed, TP-replicated tensors counted once,
    stages summed over the pipeline (a tied output layer on the last stage counts again);
    MoE expert weights (`allreduce=False`) summed over EP, counted once per expert-TP group."""
    ranks = {False: ps.get_tensor_model_parallel_rank(), True: ps.get_expert_tensor_parallel_rank()}
    mine = [0, 0]  # dense, expert
    for p in (p for c in chunks for p in c.parameters()):
        expert = not getattr(p, "allreduce", True)
        if (p.requires_grad or not trainable_only) and (
                ranks[expert] == 0 or getattr(p, "tensor_model_parallel", False)
                or getattr(p, "lora_sharded", False)):
            mine[expert] += p.numel()
    device = next(p for c in chunks for p in c.parameters()).device  # NCCL needs it on the GPU
    dense, expert = (torch.tensor(n, dtype=torch.int64, device=device) for n in mine)
    if dist.is_initialized():
        dist.all_reduce(dense, group=ps.get_tensor_model_parallel_group())
        dist.all_reduce(expert, group=ps.get_expert_tensor_and_model_parallel_group())
        dense += expert
        dist.all_reduce(dense, group=ps.get_pipeline_model_parallel_group())
        return int(dense.item())
    return int((dense + expert).item())
