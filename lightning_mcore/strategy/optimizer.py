"""mcore's optimizer and LR schedule, behind the torch Optimizer face that Lightning expects.

Lightning's automatic optimization calls `optimizer.step(closure)`; the closure runs the
training step, in which mcore's pipeline schedule has already done forward, backward and
finalize_model_grads (data-parallel reduction, per-token scaling), and the strategy has checked
the loss and gradient norm (`check_update`, which clips and, with on_nonfinite=
"stop_after_update", also updates). `step` then updates (unless done or skipped) and advances
the LR schedule by one optimizer step.

On resume the run's settings win over the checkpoint's (Megatron's
--override-opt_param-scheduler): LR schedule, and the param groups' lr bounds, betas and eps,
which loading the optimizer state would otherwise bring back from the checkpoint.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Literal, Optional

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32
from megatron.core.optimizer.optimizer import ProxyDict
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from lightning_mcore.model import te
from lightning_mcore.strategy.nonfinite import NonFiniteError, host_values_later, step_message, zero_gradient_message


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
    # A step whose loss or gradient norm is NaN/inf never updates the weights; "stop" then
    # raises NonFiniteError naming the step, "skip" goes on with the next batch. Both wait for
    # the device before each update, which keeps the GPU idle while the host launches it (4-7%
    # of a step at Qwen3-30B-A3B's shape, benchmarks/RESULTS.md). "stop_after_update" checks the
    # same values while the update runs: the step's bad update is applied, training stops, and
    # this process then refuses to save or export those weights. (on_before_optimizer_step
    # hooks then run after the update.)
    on_nonfinite: Literal["stop", "skip", "stop_after_update"] = "stop"
    # Adam's state (and its update) in CPU memory: mcore's HybridDeviceOptimizer, inside the
    # distributed optimizer (GPU; strategy/memory.py checks the layout). offload_fraction: the
    # share of the state offloaded, the rest stays on the GPU.
    cpu_offload: bool = False
    offload_fraction: float = 1.0
    # Adam keeps the fp32 master weights itself and writes the bf16 weights in its kernel (mcore's
    # precision-aware optimizer on Transformer Engine's FusedAdam): the same update, without
    # mcore's per-parameter copies on the host each step. None: on where it runs (GPU with TE,
    # Adam, the distributed optimizer, bf16), which cpu_offload needs.
    precision_aware: Optional[bool] = None

    def __post_init__(self) -> None:
        if self.lr <= 0 or self.min_lr < 0 or self.min_lr > self.lr:
            raise ValueError(f"need 0 <= min_lr ({self.min_lr}) <= lr ({self.lr}) and lr > 0.")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}.")
        if self.on_nonfinite not in ("stop", "skip", "stop_after_update"):
            raise ValueError(f"on_nonfinite must be 'stop', 'skip' or 'stop_after_update', got "
                             f"{self.on_nonfinite!r}.")
        if not 0 < self.offload_fraction <= 1:
            raise ValueError(f"offload_fraction={self.offload_fraction} must be in (0, 1]: the share "
                             f"of the optimizer state that cpu_offload moves to CPU memory.")
        if self.cpu_offload and self.optimizer != "adam":
            raise ValueError(f"cpu_offload=True works with optimizer='adam' only (mcore offloads "
                             f"through the distributed optimizer, Adam's), not {self.optimizer!r}.")
        if self.precision_aware and self.optimizer != "adam":
            raise ValueError(f"precision_aware=True works with optimizer='adam' only (Transformer "
                             f"Engine's FusedAdam holds the master weights), not {self.optimizer!r}.")
        if self.cpu_offload and self.precision_aware is False:
            raise ValueError("cpu_offload=True runs on mcore's precision-aware optimizer: leave "
                             "precision_aware unset (or True), or set cpu_offload=False.")


def uses_precision_aware(settings: OptimizerSettings, parallel, dtype: torch.dtype, on_gpu: bool) -> bool:
    """OptimizerSettings.precision_aware with None settled: on where TE's FusedAdam runs the
    distributed optimizer over bf16 weights (strategy/memory.py refuses an explicit True elsewhere)."""
    if settings.precision_aware is not None:
        return settings.precision_aware
    if settings.cpu_offload:
        return True
    return (on_gpu and settings.optimizer == "adam" and bool(parallel.use_distributed_optimizer)
            and dtype == torch.bfloat16 and te.te_available())


def optimizer_config(settings: OptimizerSettings, parallel, dtype: torch.dtype, on_gpu: bool = False):
    """mcore's OptimizerConfig for these settings under this layout and dtype."""
    # Megatron-LM's training asserts the precision-aware path with offload: the hybrid optimizer
    # reuses it (decoupled grads, fp32 main weights). mcore skips its TE check then.
    placement = dict(use_precision_aware_optimizer=uses_precision_aware(settings, parallel, dtype, on_gpu))
    if settings.cpu_offload:
        placement.update(optimizer_cpu_offload=True, optimizer_offload_fraction=settings.offload_fraction)
    elif placement["use_precision_aware_optimizer"]:
        # fp32 master weights, not bf16 weights + int16 remainders: with remainders mcore 0.19.2
        # writes the remainders as the checkpoint's fp32 'param', so checkpoints of either path
        # would not load under the other (found on GPU: NaN after such a resume).
        placement.update(store_param_remainders=False)
    return OptimizerConfig(
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
        **placement,
    )


def build_megatron_optimizer(chunks, settings: OptimizerSettings, parallel, dtype: torch.dtype,
                             on_gpu: bool):
    return get_megatron_optimizer(optimizer_config(settings, parallel, dtype, on_gpu), list(chunks))


def build_lr_scheduler(optimizer, settings: OptimizerSettings, max_steps: int):
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
        use_checkpoint_opt_param_scheduler=False,
        override_opt_param_scheduler=True,  # on resume, this run's settings win
    )


# Scheduler state keys, by the OptimizerSettings field they come from.
_SCHEDULE_FIELDS = {"max_lr": "lr", "min_lr": "min_lr", "lr_warmup_steps": "warmup_steps",
                    "lr_decay_steps": "decay_steps (max_steps if unset)",
                    "lr_decay_style": "decay_style", "end_wd": "weight_decay"}
# Param-group settings that loading an optimizer state brings back from the checkpoint.
_GROUP_FIELDS = {"betas": "adam_beta1, adam_beta2", "eps": "adam_eps", "momentum": "momentum"}
_GROUP_STATE_KEYS = ("params", "step")  # what a checkpoint's param group rightly restores


def _group_settings(groups) -> list[dict]:
    return [{k: v for k, v in g.items() if k not in _GROUP_STATE_KEYS} for g in groups]


def _differences(saved: dict, current: dict, names: dict[str, str]) -> list[str]:
    def plain(value):  # a checkpoint may bring a tuple back as a list
        return list(value) if isinstance(value, tuple) else value

    return [f"{name} {plain(saved[k])} -> {plain(current[k])}" for k, name in names.items()
            if k in saved and k in current and plain(saved[k]) != plain(current[k])]


def mcore_parts(optimizer) -> list:
    """The optimizers in mcore's chain (one per kind of parameter group: dense, experts), or
    the optimizer alone when mcore built one."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


class MegatronOptimizer(torch.optim.Optimizer):
    """Lightning-facing wrapper of an mcore optimizer plus its LR schedule."""

    def __init__(self, optimizer, scheduler, zero_grad_buffers: Callable[[], None], compat,
                 on_nonfinite: str = "stop", global_step: Callable[[], int] = lambda: 0,
                 after_update: Callable[[], None] = lambda: None) -> None:
        # torch.optim.Optimizer.__init__ is skipped on purpose: the parameters live in mcore.
        self.optimizer = optimizer
        self.scheduler = scheduler
        self._zero_grad_buffers = zero_grad_buffers
        self._compat = compat  # context for mcore calls (CUDA-on-CPU mode on CPU)
        self.on_nonfinite = on_nonfinite
        self._global_step = global_step  # the trainer's, named in non-finite errors
        self._after_update = after_update  # called once an update is applied (the strategy's)
        self.defaults = {}
        self.last_grad_norm: Optional[float] = None
        self.last_update_skipped = False
        self.warned_zero_gradient = False  # said once per run: a step whose gradients were all 0
        # True once a NaN/inf update was applied (stop_after_update): the weights are not saved
        self.applied_nonfinite = False
        # the step in flight: None (not decided yet), "apply", "skip", or "applied" (already)
        self._update: Optional[str] = None
        self._optimizer_step_pre_hooks = {}
        self._optimizer_step_post_hooks = {}

    @property
    def parts(self) -> list:
        """mcore's optimizers behind this one (mcore_parts)."""
        return mcore_parts(self.optimizer)

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        chained = getattr(self.optimizer, "chained_optimizers", None)
        if chained and any(getattr(o, "is_stub_optimizer", False) for o in chained):
            # mcore chains a stub (no torch optimizer) for a group without trainable
            # parameters, e.g. the dense one when LoRA adapts MoE experts only.

            return ProxyDict([{} if getattr(o, "is_stub_optimizer", False) else o.state for o in chained])
        return self.optimizer.state

    def zero_grad(self, set_to_none: bool = True) -> None:
        """No-op: Lightning calls it between training_step and backward, but mcore's schedule
        has already run backward inside training_step. `clear_grads` runs before the schedule."""

    def clear_grads(self) -> None:
        self._zero_grad_buffers()
        self.optimizer.zero_grad()
        self._update = None  # a new step: nothing decided yet

    def step(self, closure=None):
        loss = closure() if closure is not None else None
        if self._update is None:  # the closure did not check (a training_step of one's own)
            self.check_update(loss)
        applied = self._update == "applied" or (self._update == "apply" and self._apply())
        self._update = None
        self.last_update_skipped = not applied
        if applied:
            self.scheduler.step(increment=1)
            self._after_update()
        return loss

    # mcore's ChainedOptimizer.step (prepare grads, norm, clip by that norm, update),
    # split where the host must look: `check_update` (the strategy calls it at the end of the
    # step's schedule) reads the norm back, then `step` applies the update or not (with
    # stop_after_update `check_update` has applied it already).
    def check_update(self, loss, *extra) -> list:
        """Prepare the update, read the loss and gradient norm back with `extra` (the step's
        metrics) in one device-to-host copy, the step's one wait for the device, and decide on
        them: before any weight changes, or with on_nonfinite="stop_after_update" once the
        update is queued (applied here, so the device runs it while the host waits). Returns
        `extra` as host floats.

        The copy is queued before clipping, so the device clips while the host, released by
        the copy, goes on to launch the update. When the check then fails, the clipped
        gradients are dropped (the next step rebuilds them from mcore's buffers)."""
        grad_norm = self._grad_norm()
        read = host_values_later(loss, grad_norm, *extra)
        if grad_norm is not None:
            self._clip(grad_norm)
        late = self.on_nonfinite == "stop_after_update" and grad_norm is not None
        applied = self._apply() if late else None
        loss, grad_norm, *extra = read()
        self._decide(loss, grad_norm, applied)
        return extra

    def _apply(self) -> bool:
        with self._compat():
            return self.optimizer.step_with_ready_grads()

    def _grad_norm(self):
        """Gradients made ready and their norm, queued on the device, nothing read back: the
        norm as mcore gives it (a GPU tensor with TE, else a float), or None when
        fp16 loss scaling found inf (mcore's own skip)."""
        with self._compat():
            if self.optimizer.prepare_grads():
                return None
            return self.optimizer.get_grad_norm()

    def _decide(self, loss: Optional[float], grad_norm: Optional[float], applied: Optional[bool]) -> None:
        """Whether this step's update applies, from the loss and norm on the host (the same on
        every rank, so every rank decides alike): a NaN/inf raises NonFiniteError, or, with
        on_nonfinite="skip", leaves weights, optimizer state and LR schedule as they are.
        grad_norm None: fp16 loss scaling found inf, mcore's own skip. `applied`: None before
        the update, else whether it already ran (stop_after_update): then a NaN/inf is reported."""
        self.last_grad_norm = grad_norm
        self._update = None
        checks = [] if grad_norm is None else [("loss", loss), ("gradient norm", grad_norm)]
        bad = [(what, value) for what, value in checks if value is not None and not math.isfinite(value)]
        if bad:
            self.applied_nonfinite = self.applied_nonfinite or bool(applied)
            skip = self.on_nonfinite == "skip"
            message = step_message(*bad[0], self._global_step(), self.scheduler.max_lr, skip, bool(applied))
            if not skip:
                raise NonFiniteError(message)
            rank_zero_warn(message)
        if grad_norm == 0.0 and not self.warned_zero_gradient:
            self.warned_zero_gradient = True
            rank_zero_warn(zero_gradient_message(self._global_step()))
        if bad or grad_norm is None or applied is False:
            self._update = "skip"
        else:
            self._update = "applied" if applied else "apply"

    def _clip(self, grad_norm) -> None:
        with self._compat():
            for part in self.parts:
                if getattr(part, "is_stub_optimizer", False) or part.config.clip_grad <= 0:
                    continue
                params = part.get_parameters()
                if params:
                    decoupled = getattr(part.config, "use_precision_aware_optimizer_no_fp8_or_ds_fp8",
                                        False)
                    clip_grad_by_total_norm_fp32(params, part.config.clip_grad, grad_norm, decoupled)

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def state_dict(self):
        return {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state_dict) -> None:
        self.resume(lambda: self.optimizer.load_state_dict(state_dict["optimizer"]),
                    state_dict["scheduler"])

    def resume(self, load_optimizer: Optional[Callable[[], None]],
               schedule: Optional[dict]) -> list[str]:
        """Load a checkpoint's optimizer state (`load_optimizer`) and LR schedule position, keeping
        this run's settings; returns the settings that differ from the checkpoint's."""
        changes = []
        if load_optimizer is not None:
            mine = _group_settings(self.optimizer.param_groups)
            if schedule:
                self._match_saved_groups(schedule)
            self._load_without_moving(load_optimizer)
            saved = _group_settings(self.optimizer.param_groups)
            for group, settings in zip(self.optimizer.param_groups, mine):
                group.update(settings)
            changes += sorted({change for s, m in zip(saved, mine)
                               for change in _differences(s, m, _GROUP_FIELDS)})
        if schedule:
            ours = self.scheduler.state_dict()
            changes = _differences(schedule, ours, _SCHEDULE_FIELDS) + changes
            self.scheduler.num_steps = 0
            self.scheduler.load_state_dict(schedule)  # position from the checkpoint, values ours
        return changes

    def _load_without_moving(self, load_optimizer: Callable[[], None]) -> None:
        """mcore's HybridDeviceOptimizer (cpu_offload) allocates its state before loading by an
        Adam step on random gradients, and copies the result into the model's weights (the
        checkpoint's, by now). At lr 0 that step changes nothing; the random numbers come from
        the RNG the checkpoint restored, which is put back. `mine` in resume() restores lr."""
        for group in self.optimizer.param_groups:
            group["lr"] = 0.0
        devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
        with torch.random.fork_rng(devices=devices):
            load_optimizer()

    def _match_saved_groups(self, schedule: dict) -> None:
        """mcore pairs the saved param groups with the current ones by their settings,
        max_lr and min_lr among them: while loading, the current groups carry the checkpoint's."""
        for group in self.optimizer.param_groups:
            for key in ("max_lr", "min_lr"):
                if key in schedule and group.get(key) == getattr(self.scheduler, key):
                    group[key] = schedule[key]

    def __repr__(self) -> str:
        return f"MegatronOptimizer({type(self.optimizer).__name__})"
