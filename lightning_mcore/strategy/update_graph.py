"""The optimizer's update recorded as a CUDA graph before the NaN/inf check, launched after it.

The check (optimizer.py, check_update) reads the step's loss and gradient norm back before any
weight changes, so the host waits there for the GPU to finish backward. Launching the update
only then leaves the GPU idle while the host works through it: Transformer Engine's FusedAdam
builds its per-parameter lists in Python (20-50 ms a step over the ~1,000 expert weights of 4
Qwen3-30B-A3B layers, benchmarks/RESULTS.md). Capturing the update records those launches
without running them, while the GPU still computes gradients; after the check the graph goes
in one launch, or is dropped (skip, stop) and what the capture advanced on the host, Adam's
step count, is put back. Same kernels with the same arguments: the same weights, bit for bit
(tests/test_gpu_update_graph.py).

    host:  forward+backward queued | capture update | wait for loss, norm | check | launch graph
    GPU:   ..... forward ..... backward ..... norm, clip ......................| update

Captured only where the update keeps no other state on the host and calls no collective
across ranks (update_obstacle): mcore's parts over TE's FusedAdam, its state made by a first
eager update, parameters all-gathered in the update only within one rank (or in the next
forward, overlap_param_gather).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch


def _inner(parts) -> list:
    return [part.optimizer for part in parts if not getattr(part, "is_stub_optimizer", False)]


def _gathers_across_ranks(part) -> bool:
    """mcore's distributed optimizer all-gathers the updated parameters inside its update unless
    overlap_param_gather defers that to the next forward."""
    ddp, group = getattr(part, "ddp_config", None), getattr(part, "data_parallel_group", None)
    return ddp is not None and group is not None and not ddp.overlap_param_gather and group.size() > 1


def update_obstacle(parts) -> Optional[str]:
    """Why the update of mcore's optimizer `parts` cannot be captured now, or None."""
    inners = _inner(parts)
    if not inners:
        return "no parameters to update"
    for part in parts:
        config = getattr(part, "config", None)
        if getattr(config, "overlap_param_gather_with_optimizer_step", False) or \
                getattr(config, "reuse_grad_buf_for_mxfp8_param_ag", False):
            return "mcore starts the parameter all-gather from inside the update"
        if _gathers_across_ranks(part):
            return "the update all-gathers parameters across data-parallel ranks (overlap_param_gather=False)"
    for inner in inners:
        kind = type(inner)
        if kind.__name__ != "FusedAdam" or not kind.__module__.startswith("transformer_engine"):
            return f"the optimizer is {kind.__module__}.{kind.__name__}, not Transformer Engine's FusedAdam"
        if inner.capturable:
            return "FusedAdam(capturable=True) keeps its learning rate on the GPU"
        params = [p for group in inner.param_groups for p in group["params"]]
        if not all(p.is_cuda for p in params):
            return "parameters off the GPU"
        if any(len(inner.state[p]) == 0 for p in params):
            return "Adam's state is made by the first update"  # allocations: not in a graph
    return None


class CapturedUpdate:
    """One step's update, recorded: `launch` it or `drop` it (then the host state it advanced
    is restored). Keep it referenced until its launch has run (the next capture replaces it)."""

    def __init__(self, graph: "torch.cuda.CUDAGraph", inners: list, steps: list, settings: list) -> None:
        self.graph, self._inners, self._steps, self._settings = graph, inners, steps, settings

    def settings_changed(self) -> bool:
        """A hook between capture and launch changed a learning rate, beta, eps or weight decay:
        the graph holds the old values."""
        return _settings(self._inners) != self._settings

    def launch(self) -> None:
        self.graph.replay()  # on the current stream, after the step's backward, norm and clip

    def drop(self) -> None:
        _restore_steps(self._inners, self._steps)


def _settings(inners) -> list:
    return [(g["lr"], g["weight_decay"], tuple(g["betas"]), g["eps"], g.get("bias_correction"))
            for inner in inners for g in inner.param_groups]


def _steps(inners) -> list:
    return [(g, "step" in g, g.get("step")) for inner in inners for g in inner.param_groups]


def _restore_steps(inners, steps) -> None:
    for group, had, value in steps:
        if had:
            group["step"] = value
        else:
            group.pop("step", None)


class UpdateGraphError(RuntimeError):
    """The update could not be recorded. torch's RNG is left mid-capture then (torch 2.11), so
    training cannot go on in this process: the error names the setting that avoids it."""


def capture_update(update: Callable[[], object], parts, stream: "torch.cuda.Stream") -> CapturedUpdate:
    """Record `update` (mcore's step_with_ready_grads over `parts`) on `stream` without running
    it. Each graph has its own (empty) memory pool: a pool shared by graphs is freed with the last
    of them, and a later capture into its handle fails (torch 2.11)."""
    inners = _inner(parts)
    steps, settings = _steps(inners), _settings(inners)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.stream(stream):
            # thread_local: the DataLoader's pin-memory thread may allocate pinned memory meanwhile
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                update()
            except BaseException:
                try:
                    graph.capture_end()
                except Exception:  # the capture is invalid already: the first error says why
                    pass
                raise
            graph.capture_end()
    except Exception as error:
        _restore_steps(inners, steps)
        raise UpdateGraphError(f"the optimizer's update could not be recorded as a CUDA graph ({error}). "
                               f"Set update_graph=False in the optimizer settings (the module's `optim`) "
                               f"to launch it after the NaN/inf check instead.") from error
    return CapturedUpdate(graph, inners, steps, settings)
