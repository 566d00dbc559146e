"""NaN/inf in training: found before it reaches the weights (or, by choice, as it does), and
never saved.

The loss (reduced, the same on every rank) and the gradient norm (all-reduced by mcore) are
checked between computing the norm and applying the update, read back with the step's metrics
in the step's one device-to-host copy (optimizer.py, check_update); with
on_nonfinite="stop_after_update" they are read while the update runs, and the weights it wrote
are refused. Checkpoints and HF exports check the weights themselves, since they may come from
anywhere.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from lightning_mcore.refusals import RunFailure


class NonFiniteError(RunFailure, RuntimeError):
    """A loss or gradient norm is NaN/inf, or weights about to be written hold NaN/inf: the
    CLI reports it as one `error:` line from rank 0 (refusals.py), not a traceback per rank."""


def step_message(what: str, value: float, step: int, lr: float, skipped: bool, applied: bool = False) -> str:
    """`step`: the trainer's global_step while the step runs (optimizer steps done before it).
    `applied`: the update was already queued when the value was read (stop_after_update)."""
    head = f"non-finite {what} ({value}) at step {step + 1} (trainer.global_step {step})"
    if skipped:
        return f"{head}: skipped the update (weights, optimizer state and LR schedule unchanged)."
    advice = (f"Lower the learning rate (lr={lr:g}), keep clip_grad > 0, check this step's data, or "
              f"set on_nonfinite='skip' in the optimizer settings (the module's `optim`) to skip "
              f"such updates.")
    if applied:
        return (f"{head}: the update was applied (on_nonfinite='stop_after_update' checks while it "
                f"runs) and training stops; these weights will not be saved or exported, so resume "
                f"from the last checkpoint. {advice}")
    return f"{head}: the update was not applied and training stops. {advice}"


def zero_gradient_message(step: int) -> str:
    """A step whose every trained parameter got a gradient of exactly 0: nothing learns from it."""
    return (f"the gradient norm is exactly 0 at step {step + 1} (trainer.global_step {step}): no gradient "
            f"reached any trained parameter, so this update changes nothing. Check that the step's "
            f"data has tokens in its loss (loss_mask), and that something the loss depends on is "
            f"trained (frozen layers, LoRA target_modules). Said once per run.")


def host_values(*values) -> list:
    """`values` (tensors of one element, numbers or None) as Python floats (None stays None),
    the tensors read back in one device-to-host copy: one wait for the device, not one each."""
    return host_values_later(*values)()


def host_values_later(*values) -> Callable[[], list]:
    """host_values in two halves: the copy is queued now, and the returned function waits for
    it and gives the floats. Work queued in between (the update) runs on the device while the
    host waits, rather than after it."""
    tensors = [v.detach().reshape(()).float() for v in values if torch.is_tensor(v)]
    host = torch.stack([t.to(tensors[0].device) for t in tensors]) if tensors else torch.zeros(0)
    copied = None
    if host.is_cuda:
        host, device = torch.empty(host.shape, pin_memory=True), host
        host.copy_(device, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()

    def read() -> list:
        if copied is not None:
            copied.synchronize()
        floats = iter(host.tolist())
        return [next(floats) if torch.is_tensor(v) else (None if v is None else float(v)) for v in values]

    return read


@torch.no_grad()
def weights_are_finite(chunks, device: torch.device) -> bool:
    """Whether every rank's weights are finite (collective: every rank gets the same answer)."""
    flags = [torch.isfinite(p).all() for chunk in chunks for p in chunk.parameters()]
    bad = torch.zeros(1, device=device)
    if flags:
        bad += (~torch.stack(flags)).sum()
    if dist.is_initialized():
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    return bad.item() == 0


def refuse_nonfinite_weights(chunks, device: torch.device, what: str) -> None:
    """Raise before `what` (a checkpoint or export) is written from NaN/inf weights (collective)."""
    if not weights_are_finite(chunks, device):
        raise NonFiniteError(
            f"refusing to write {what}: the model's weights hold NaN/inf values (training "
            f"diverged). Resume from an earlier checkpoint with a lower learning rate."
        )
