"""DAPO's additions to GRPO, each a small option of GRPOModule (GSPO's sequence-level ratio is
`importance_level` in grpo_loss.py):

- OverlongShaping: completions cut at max_completion_length get a soft penalty (a reward falling
  to -factor over the last `buffer` tokens of the allowed length), or carry no loss ("filter").
- DynamicSampling: groups whose rewards are all equal (zero advantage: no gradient) are dropped,
  and more prompts are generated for until every data-parallel rank has its batch's groups.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal

from lightning_mcore.objectives.grpo_loss import varied_groups
from lightning_mcore.objectives.rollout import Rollout


@dataclass
class OverlongShaping:
    """What GRPO does with completions that run to max_completion_length (DAPO's overlong
    reward shaping): a reward penalty, or no loss.

    `mode` "penalty": a reward of min(0, (max_completion_length - buffer - length) / buffer)
    * factor is added to every completion's (logged as rewards/overlong); "filter": completions
    cut at max_completion_length without a stop token carry no loss (their rewards still count in
    their group's advantages)."""

    mode: Literal["penalty", "filter"] = "penalty"
    buffer: int = 0
    factor: float = 1.0

    def __post_init__(self) -> None:
        if self.mode not in ("penalty", "filter"):
            raise ValueError(f"overlong.mode must be 'penalty' or 'filter', got {self.mode!r}")
        if self.mode == "penalty" and not (isinstance(self.buffer, int) and self.buffer > 0):
            raise ValueError(f"overlong.buffer must be an int > 0 for the penalty (the tokens over "
                             f"which it falls to -factor), got {self.buffer!r}")
        if not self.factor >= 0:
            raise ValueError(f"overlong.factor must be >= 0, got {self.factor!r}")


@dataclass
class DynamicSampling:
    """Generate at most `max_rounds` times per rollout (the first included) until every
    data-parallel rank holds its batch's number of groups with unequal rewards; extra prompts
    are drawn at random from the prompt data (PromptDataModule.sample_prompts, seeded by the step
    and the round: a resumed run draws alike). Short after the last round, groups of equal rewards
    fill the batch (logged: train/groups_equal_trained)."""

    max_rounds: int = 4

    def __post_init__(self) -> None:
        if not isinstance(self.max_rounds, int) or self.max_rounds < 1:
            raise ValueError(f"dynamic_sampling.max_rounds must be an int >= 1, got {self.max_rounds!r}")


def fill_with_varied_groups(first: Rollout, more: Callable[[int], Rollout], group_size: int,
                            max_rounds: int, any_rank_short: Callable[[bool], bool]) -> tuple[Rollout, dict]:
    """`first`'s number of groups, those with unequal rewards first: from `first`, then from
    `more(round)` (round 1, 2, ...) while `any_rank_short` (collective: every rank generates as
    long as one still lacks groups) and fewer than `max_rounds` generations were made. Returns the
    rollout and its numbers for the logs."""
    need = len(first.prompt_ids) // group_size
    varied, equal = [], []

    def sort(rollout: Rollout) -> int:
        flags = varied_groups(rollout.rewards, group_size).tolist()
        for g, ok in enumerate(flags):
            (varied if ok else equal).append(rollout.take(range(g * group_size, (g + 1) * group_size)))
        return len(flags)

    generated, rounds = sort(first), 1
    while rounds < max_rounds and any_rank_short(len(varied) < need):
        generated += sort(more(rounds))
        rounds += 1
    chosen = (varied + equal)[:need]
    stats = {"dynamic_sampling_rounds": float(rounds), "groups_varied": len(varied) / generated,
             "groups_equal_trained": float(max(need - len(varied), 0))}
    return Rollout.join(chosen), stats
