"""NaN/inf in training: found before it reaches the weights, and never saved.

The loss (reduced, the same on every rank) and the gradient norm (all-reduced by mcore) are
checked between computing the norm and applying the update, read back with the step's metrics
in the step's one device-to-host copy (optimizer.py, check_update); checkpoints and HF
exports check the weights themselves, since they may come from anywhere.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class NonFiniteError(RuntimeError):
    """A loss or gradient norm is NaN/inf, or weights about to be written hold NaN/inf."""


def step_message(what: str, value: float, step: int, lr: float, skipped: bool) -> str:
    """`step`: the trainer's global_step while the step runs (optimizer steps done before it)."""
    head = f"non-finite {what} ({value}) at step {step + 1} (trainer.global_step {step})"
    if skipped:
        return f"{head}: skipped the update (weights, optimizer state and LR schedule unchanged)."
    return (f"{head}: the update was not applied and training stops. Lower the learning rate "
            f"(lr={lr:g}), keep clip_grad > 0, check this step's data, or set "
            f"on_nonfinite='skip' in the optimizer settings (the module's `optim`) to skip "
            f"such updates.")


def host_values(*values) -> list:
    """`values` (tensors of one element, numbers or None) as Python floats (None stays None),
    the tensors read back in one device-to-host copy: one wait for the device, not one each."""
    tensors = [v.detach().reshape(()).float() for v in values if torch.is_tensor(v)]
    read = iter(torch.stack([t.to(tensors[0].device) for t in tensors]).tolist() if tensors else [])
    return [next(read) if torch.is_tensor(v) else (None if v is None else float(v)) for v in values]


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
