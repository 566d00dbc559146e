"""mcore's optimizer and LR schedule, behind the torch Optimizer face that Lightning expects.

Lightning's automatic optimization calls `optimizer.step(closure)`; the closure runs the
training step, in which mcore's pipeline schedule has already done forward, backward and
finalize_model_grads (data-parallel reduction, per-token scaling). `step` then clips, updates
and advances the LR schedule by one optimizer step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal, Optional

import torch


@dataclass
class OptimizerSettings:
    """Adam(W) with warmup, then cosine / linear / constant decay to min_lr."""

    lr: float = 3e-4
    min_lr: float = 0.0
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    warmup_steps: int = 0
    decay_steps: Optional[int] = None  # None: the Trainer's max_steps
    decay_style: Literal["cosine", "linear", "constant"] = "cosine"
    optimizer: Literal["adam", "sgd"] = "adam"

    def __post_init__(self) -> None:
        if self.lr <= 0 or self.min_lr < 0 or self.min_lr > self.lr:
            raise ValueError(f"need 0 <= min_lr ({self.min_lr}) <= lr ({self.lr}) and lr > 0.")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}.")


def build_megatron_optimizer(chunks, settings: OptimizerSettings, parallel, dtype: torch.dtype):
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    config = OptimizerConfig(
        optimizer=settings.optimizer,
        lr=settings.lr,
        min_lr=settings.min_lr,
        weight_decay=settings.weight_decay,
        adam_beta1=settings.adam_beta1,
        adam_beta2=settings.adam_beta2,
        adam_eps=settings.adam_eps,
        clip_grad=settings.clip_grad,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        params_dtype=dtype,
        use_distributed_optimizer=parallel.use_distributed_optimizer,
        overlap_param_gather=parallel.overlap_param_gather,
    )
    return get_megatron_optimizer(config, list(chunks))


def build_lr_scheduler(optimizer, settings: OptimizerSettings, max_steps: int):
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    decay = settings.decay_steps or max(max_steps, settings.warmup_steps + 1)
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if settings.warmup_steps else settings.lr,
        max_lr=settings.lr,
        min_lr=settings.min_lr,
        lr_warmup_steps=settings.warmup_steps,
        lr_decay_steps=decay,
        lr_decay_style=settings.decay_style,
        start_wd=settings.weight_decay,
        end_wd=settings.weight_decay,
        wd_incr_steps=decay,
        wd_incr_style="constant",
    )


class MegatronOptimizer(torch.optim.Optimizer):
    """Lightning-facing wrapper of an mcore optimizer plus its LR schedule."""

    def __init__(self, optimizer, scheduler, zero_grad_buffers: Callable[[], None], compat) -> None:
        # torch.optim.Optimizer.__init__ is skipped on purpose: the parameters live in mcore.
        self.optimizer = optimizer
        self.scheduler = scheduler
        self._zero_grad_buffers = zero_grad_buffers
        self._compat = compat  # context for mcore calls (CUDA-on-CPU mode on CPU)
        self.defaults = {}
        self.last_grad_norm: Optional[float] = None
        self.last_update_skipped = False
        self._optimizer_step_pre_hooks = {}
        self._optimizer_step_post_hooks = {}

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    def zero_grad(self, set_to_none: bool = True) -> None:
        """No-op: Lightning calls it between training_step and backward, but mcore's schedule
        has already run backward inside training_step. `clear_grads` runs before the schedule."""

    def clear_grads(self) -> None:
        self._zero_grad_buffers()
        self.optimizer.zero_grad()

    def step(self, closure=None):
        loss = closure() if closure is not None else None
        with self._compat():
            ok, grad_norm, _ = self.optimizer.step()
        self.last_update_skipped = not ok
        self.last_grad_norm = None if grad_norm is None else float(grad_norm)
        if ok:
            self.scheduler.step(increment=1)
        return loss

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def state_dict(self):
        return {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state_dict) -> None:
        self.optimizer.load_state_dict(state_dict["optimizer"])
        self.scheduler.load_state_dict(state_dict["scheduler"])

    def __repr__(self) -> str:
        return f"MegatronOptimizer({type(self.optimizer).__name__})"
