"""A GRPO rollout: prompts, their sampled completions, rewards, and what generation saw."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch


@dataclass
class Rollout:
    """One rank's rollout: completion `i` continues `prompt_ids[i]`; completions of a prompt are
    consecutive, `num_generations` of them. `rewards` [N] is the weighted total, `per_function`
    each function's [N] scores (for logs). The log-probs are filled in on first use."""

    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    rewards: torch.Tensor
    per_function: dict[str, torch.Tensor] = field(default_factory=dict)
    # what generation saw (None for a rollout given from elsewhere): each completion token's
    # log-prob, and on MoE models [len(prompt) + len(completion) - 1, layers, topk] experts
    sampled_logps: Optional[list[list[float]]] = None
    routing: Optional[list[torch.Tensor]] = None
    # completions cut at max_completion_length without a stop token (None: not known)
    truncated: Optional[list[bool]] = None
    old_logps: Optional[torch.Tensor] = None
    ref_logps: Optional[torch.Tensor] = None
    steps: int = 0  # optimizer steps taken on it

    def take(self, rows: Sequence[int]) -> "Rollout":
        """The completions `rows`, in that order (before any log-prob is taken)."""
        rows = list(rows)

        def pick(values):
            return None if values is None else [values[i] for i in rows]

        index = torch.tensor(rows, dtype=torch.long)
        return Rollout(pick(self.prompt_ids), pick(self.completion_ids), self.rewards[index],
                       {k: v[index] for k, v in self.per_function.items()},
                       pick(self.sampled_logps), pick(self.routing), pick(self.truncated))

    @staticmethod
    def join(parts: Sequence["Rollout"]) -> "Rollout":
        """One rollout of `parts`' completions, in order (fields all parts have)."""

        def cat(values):
            return None if any(v is None for v in values) else [x for v in values for x in v]

        names = set.intersection(*(set(p.per_function) for p in parts))
        return Rollout(cat([p.prompt_ids for p in parts]), cat([p.completion_ids for p in parts]),
                       torch.cat([p.rewards for p in parts]),
                       {k: torch.cat([p.per_function[k] for p in parts]) for k in sorted(names)},
                       cat([p.sampled_logps for p in parts]), cat([p.routing for p in parts]),
                       cat([p.truncated for p in parts]))
