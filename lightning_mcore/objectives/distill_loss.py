"""Per-token divergences between two models' vocab-parallel logits, never gathering the vocabulary.

Each tensor-parallel rank holds a [..., vocab / tp] slice of both models' logits (mcore's output
layer; with sequence parallelism the sequence is already gathered there). Log-softmax needs the
max and the sum of exponentials over the whole vocabulary: the max is all-reduced detached (any
shift gives the same value), the sum of exponentials with a differentiable all-reduce (group_sum.py;
backward: all-reduce of the gradients, since every rank's loss depends on every rank's logits
through the normaliser). Each rank then sums its part of the per-token divergence over its
columns and `_replicated_sum` all-reduces that forward with an identity backward (mcore's
reduce_from_tensor_model_parallel_region): the sum is the replicated loss every rank differentiates,
and each rank's gradient belongs to its own columns only.

Divergences follow trl's GKDTrainer.generalized_jsd_loss (logits divided by the temperature, no
T^2 factor):
    forward_kl  KL(teacher || student)
    reverse_kl  KL(student || teacher)
    jsd         beta KL(teacher || m) + (1 - beta) KL(student || m),  m = beta teacher + (1 - beta) student
                (beta 0 is forward_kl and beta 1 reverse_kl, as in trl)
Columns that only pad the vocabulary to a TP multiple are dropped (they are no tokens).
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.distributed as dist

from lightning_mcore.model.group_sum import sum_over_group

Divergence = Literal["forward_kl", "reverse_kl", "jsd"]


def real_columns(logits: torch.Tensor, vocab_size: int, group) -> tuple[torch.Tensor, int]:
    """This rank's logits without the vocab padding (float32), and the id of its first column."""
    width = logits.shape[-1]
    start = _rank(group) * width
    keep = max(0, min(width, vocab_size - start))
    return logits[..., :keep].float(), start


def log_softmax(logits: torch.Tensor, vocab_size: int, group, temperature: float = 1.0) -> torch.Tensor:
    """Log-probabilities of this rank's (real) columns, normalised over the whole vocabulary."""
    z, _ = real_columns(logits, vocab_size, group)
    z = z / temperature
    with torch.no_grad():
        if z.shape[-1]:
            top = z.amax(dim=-1)
        else:  # a rank holding padding only
            top = torch.full(z.shape[:-1], -math.inf, dtype=z.dtype, device=z.device)
        if _size(group) > 1:
            dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    total = torch.exp(z - top.unsqueeze(-1)).sum(dim=-1)
    if _size(group) > 1:
        total = sum_over_group(total, group)
    return z - (top + torch.log(total)).unsqueeze(-1)


def token_divergence(student_logits: torch.Tensor, teacher_logits: torch.Tensor, vocab_size: int,
                     group, divergence: Divergence = "forward_kl", beta: float = 0.5,
                     temperature: float = 1.0) -> torch.Tensor:
    """[...] per-token divergence (replicated over `group`) from [..., vocab / tp] logits; the
    teacher's carry no gradient."""
    if divergence == "jsd" and beta == 0.0:
        divergence = "forward_kl"
    if divergence == "jsd" and beta == 1.0:
        divergence = "reverse_kl"
    student = log_softmax(student_logits, vocab_size, group, temperature)
    with torch.no_grad():
        teacher = log_softmax(teacher_logits.detach(), vocab_size, group, temperature)
    if divergence == "forward_kl":
        local = _kl(teacher, student)
    elif divergence == "reverse_kl":
        local = _kl(student, teacher)
    elif divergence == "jsd":
        mixture = torch.logsumexp(torch.stack([student + math.log(1.0 - beta), teacher + math.log(beta)]), dim=0)
        local = beta * _kl(teacher, mixture) + (1.0 - beta) * _kl(student, mixture)
    else:
        raise ValueError(f"divergence must be 'forward_kl', 'reverse_kl' or 'jsd', got {divergence!r}.")
    return _replicated_sum(local, group)


def token_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int, group) -> torch.Tensor:
    """[...] per-token -log p(label) (replicated over `group`) from [..., vocab / tp] logits."""
    logp = log_softmax(logits, vocab_size, group)
    _, start = real_columns(logits, vocab_size, group)
    local_ids = labels - start
    here = (local_ids >= 0) & (local_ids < logp.shape[-1])
    picked = logp.gather(-1, local_ids.clamp(0, max(logp.shape[-1] - 1, 0)).unsqueeze(-1)).squeeze(-1) \
        if logp.shape[-1] else torch.zeros_like(labels, dtype=logp.dtype)
    return _replicated_sum(-torch.where(here, picked, torch.zeros_like(picked)), group)


def _kl(p_log: torch.Tensor, q_log: torch.Tensor) -> torch.Tensor:
    """This rank's part of KL(p || q) = sum p (log p - log q), as torch's kl_div(q, p, log_target)."""
    return (torch.exp(p_log) * (p_log - q_log)).sum(dim=-1)


class _ReplicatedSum(torch.autograd.Function):
    """Forward: all-reduce (sum) over the group; backward: identity."""

    @staticmethod
    def forward(ctx, tensor, group):
        tensor = tensor.clone()
        dist.all_reduce(tensor, group=group)
        return tensor

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _replicated_sum(tensor: torch.Tensor, group) -> torch.Tensor:
    return _ReplicatedSum.apply(tensor, group) if _size(group) > 1 else tensor


def _size(group) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def _rank(group) -> int:
    return dist.get_rank(group) if dist.is_initialized() else 0
