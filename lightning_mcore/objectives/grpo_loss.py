"""GRPO's arithmetic as pure functions (tensors in, tensors out), checkable by hand.

    A_i     = (r_i - mean_group(r)) / (std_group(r) + eps)      (scale=False: Dr. GRPO, no std)
    rho_t   = exp(logp_t - old_t)
    loss_t  = -min(rho_t A, clip(rho_t, 1 - eps_low, 1 + eps_high) A)
              + beta (exp(ref_t - logp_t) - (ref_t - logp_t) - 1)   (k3 estimate of KL, beta > 0)

GSPO (importance_level "sequence"): one ratio per completion, from its tokens' mean log-ratio,
    rho_i   = exp(sum_t m_t (logp_t - old_t) / sum_t m_t)     (m: the completion's tokens)
clipped as above and given to each of its tokens (the gradient reaches every token through the
mean), as Qwen's GSPO and trl's importance_sampling_level="sequence" compute it.

With truncated importance sampling (tis_cap > 0), the policy term of each token is weighted by
    w_t     = min(exp(old_t - rollout_t), tis_cap)    (detached; rollout_t: the sampler's log-prob)
and the gap between the rollout's policy and the trained one is measured on the completion tokens
(`rollout_mismatch`): mean |old_t - rollout_t| and the k3 estimate of KL(rollout || old),
exp(d) - d - 1 with d = old_t - rollout_t.

Normalization of the per-token losses over the completion tokens of the global batch:
"token" (DAPO): sum over all tokens / number of tokens; "sequence" (GRPO): each completion's
mean over its tokens, then the mean over completions. Both come back as (sum, count) pairs, the
reduction mcore's schedule adds over microbatches and data-parallel ranks (objectives/loss.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

NORMALIZATIONS = ("token", "sequence")
IMPORTANCE_LEVELS = ("token", "sequence")


def group_advantages(rewards: torch.Tensor, group_size: int, scale: bool = True,
                     eps: float = 1e-4) -> torch.Tensor:
    """[N] advantages of [N] rewards in consecutive groups of `group_size` (the completions of
    one prompt): reward minus the group mean, divided by the group's (unbiased) std + eps when
    `scale`. A group whose rewards are all equal gets 0 everywhere (nothing to learn from)."""
    if rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    grouped = rewards.double().reshape(-1, group_size)
    centered = grouped - grouped.mean(dim=1, keepdim=True)
    if scale:
        centered = centered / (grouped.std(dim=1, keepdim=True) + eps)
    return centered.reshape(-1).to(rewards.dtype)


@dataclass
class TokenTerms:
    """Per-token pieces of the loss, each [rows, seq]: `loss` (to normalize), `clipped` (1 where
    the clipped branch is the one taken, so the token gives no gradient), `kl` (k3; zeros when
    beta is 0)."""

    loss: torch.Tensor
    clipped: torch.Tensor
    kl: torch.Tensor


def token_terms(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                epsilon_low: float, epsilon_high: float, beta: float = 0.0,
                ref_logp: Optional[torch.Tensor] = None,
                weights: Optional[torch.Tensor] = None, level: str = "token",
                mask: Optional[torch.Tensor] = None) -> TokenTerms:
    """The clipped-ratio loss of every token: `logp`, `old_logp`, `ref_logp` [rows, seq] (the
    policy being trained, the one that sampled, the reference), `advantages` [rows]; `weights`
    [rows, seq] (truncated importance sampling) multiply the policy term, not the KL; `level`
    "sequence" (GSPO) takes one ratio per row over its `mask`ed tokens."""
    adv = advantages[:, None].to(logp.dtype)
    if level == "sequence":
        if mask is None:
            raise ValueError("a sequence-level ratio needs the mask of each row's tokens")
        m = mask.to(logp.dtype)
        ratio = torch.exp(((logp - old_logp) * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1.0))
        ratio = ratio.expand_as(logp)
    elif level == "token":
        ratio = torch.exp(logp - old_logp)
    else:
        raise ValueError(f"importance level must be one of {IMPORTANCE_LEVELS}, got {level!r}")
    clipped_ratio = torch.clamp(ratio, 1.0 - epsilon_low, 1.0 + epsilon_high)
    loss = -torch.min(ratio * adv, clipped_ratio * adv)
    if weights is not None:
        loss = loss * weights
    clipped = ((ratio < 1.0 - epsilon_low) & (adv < 0)) | ((ratio > 1.0 + epsilon_high) & (adv > 0))
    kl = torch.zeros_like(logp)
    if beta > 0:
        if ref_logp is None:
            raise ValueError("beta > 0 needs the reference model's log-probs")
        delta = ref_logp - logp
        kl = torch.exp(delta) - delta - 1.0
        loss = loss + beta * kl
    return TokenTerms(loss, clipped.to(logp.dtype), kl)


def normalized(values: torch.Tensor, mask: torch.Tensor, how: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum, count) of [rows, seq] `values` over the `mask`ed tokens: "token" sums every token
    and counts tokens; "sequence" sums each row's mean and counts rows (rows without a token
    count as none)."""
    if how not in NORMALIZATIONS:
        raise ValueError(f"loss_normalization must be one of {NORMALIZATIONS}, got {how!r}")
    mask = mask.to(values.dtype)
    per_row = (values * mask).sum(dim=-1)
    tokens = mask.sum(dim=-1)
    if how == "token":
        return per_row.sum(), tokens.sum()
    has = tokens > 0
    return (per_row[has] / tokens[has]).sum(), has.sum().to(values.dtype)


def sequence_stats(values: torch.Tensor) -> dict[str, float]:
    """mean, std (population) and max of a 1-D tensor, as floats for logging."""
    values = values.double()
    return {"mean": float(values.mean()), "std": float(values.std(unbiased=False)),
            "max": float(values.max())}


def tis_weights(old_logp: torch.Tensor, rollout_logp: torch.Tensor, cap: float) -> torch.Tensor:
    """Token-level truncated importance weights min(pi_old / pi_rollout, cap), detached."""
    return torch.exp(old_logp.detach() - rollout_logp).clamp(max=cap)


def rollout_mismatch(old_logp: torch.Tensor, rollout_logp: torch.Tensor,
                     mask: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """(sum, count) over the `mask`ed tokens of |old - rollout| ("rollout_logp_diff") and of the
    k3 estimate of KL(rollout || old) ("rollout_kl"), the rollout's samples being the draws."""
    mask = mask.to(old_logp.dtype)
    delta = (old_logp.detach() - rollout_logp) * mask
    tokens = mask.sum()
    return {"rollout_logp_diff": (delta.abs().sum(), tokens),
            "rollout_kl": (((torch.exp(delta) - delta - 1.0) * mask).sum(), tokens)}


def overlong_penalty(lengths: torch.Tensor, max_length: int, buffer: int, factor: float = 1.0) -> torch.Tensor:
    """DAPO's soft overlong punishment of completions of `lengths` [N] tokens (at most
    `max_length`): 0 up to max_length - buffer, then falling linearly to -factor at max_length,
    min(0, (max_length - buffer - length) / buffer) * factor."""
    if not 0 < buffer <= max_length:
        raise ValueError(f"the overlong buffer must be in 1..max_completion_length={max_length}, got {buffer}")
    over = (max_length - buffer - lengths.double()) / buffer
    return over.clamp(max=0.0) * factor


def varied_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """[N / group_size] bool: the groups whose rewards are not all equal (DAPO's dynamic
    sampling keeps only these: a group of equal rewards has zero advantage everywhere)."""
    grouped = rewards.reshape(-1, group_size)
    return (grouped != grouped[:, :1]).any(dim=1)
