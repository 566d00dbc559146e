"""Batched generation (greedy or sampled) from the mcore chunks, with a KV cache.

Prompts of different lengths are handled per row, as Megatron-Core's static engine does, with
no padding at all: the prefill runs the shortest prompt's length for every row; then each step
appends one column, in which a row still inside its prompt takes its next prompt token and the
others their new token. Every row thus sees exactly its own tokens at their own positions.

Sampling draws on the full-vocabulary logits (gathered over tensor-parallel ranks) with a
torch.Generator seeded from `seed` on every rank alike, never from per-rank RNG state: the same
seed gives the same tokens on every rank and at any layout (up to ties in the float logits).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class SamplingSettings:
    max_new_tokens: int = 64
    greedy: bool = False  # True: argmax (temperature/top_p/top_k ignored)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    stop: list[int] = field(default_factory=list)  # stop token ids (kept in the completion)
    seed: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 0:
            raise ValueError(f"SamplingSettings: max_new_tokens must be an int >= 0, "
                             f"got {self.max_new_tokens!r}.")
        if not self.greedy and not self.temperature > 0:
            raise ValueError(f"SamplingSettings: temperature must be > 0, got {self.temperature!r} "
                             f"(use greedy=True for argmax).")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingSettings: top_p must be in (0, 1], got {self.top_p!r}.")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"SamplingSettings: top_k must be an int >= 0 (0: off), got {self.top_k!r}.")


def refuse_too_long(prompts: list[list[int]], max_new_tokens: int, seq_length: int) -> None:
    """Prompts + new tokens must fit in the model's seq_length (positions past it were never trained)."""
    for i, prompt in enumerate(prompts):
        name = "prompt" if len(prompts) == 1 else f"prompt {i}"
        if not prompt:
            raise ValueError(f"generate: {name} is empty; give at least one token.")
        if len(prompt) + max_new_tokens > seq_length:
            raise ValueError(
                f"generate: {name} ({len(prompt)} tokens) + max_new_tokens ({max_new_tokens}) is "
                f"longer than the model's seq_length={seq_length}; use at most "
                f"{max(seq_length - len(prompt), 0)} new tokens or a shorter prompt."
            )


def choose_tokens(logits: torch.Tensor, sampling: SamplingSettings,
                  generator: torch.Generator) -> torch.Tensor:
    """Next token of each row of `logits` [rows, vocab]: argmax, or a draw from the
    temperature/top-k/top-p distribution by inverse CDF of one uniform per row, drawn from
    `generator` (a CPU one, so every rank and layout draws alike); float64 on the logits' device."""
    logits = logits.detach().double()
    if not torch.isfinite(logits).all():
        raise FloatingPointError("generate: the model's logits are not finite (NaN/inf).")
    uniform = torch.rand(logits.shape[0], generator=generator, dtype=torch.float64).to(logits.device)
    if sampling.greedy:
        return logits.argmax(-1).cpu()
    logits = logits / sampling.temperature
    if sampling.top_k:
        kth = logits.topk(min(sampling.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(-1)
    if sampling.top_p < 1:
        sorted_probs, order = probs.sort(-1, descending=True)
        before = sorted_probs.cumsum(-1) - sorted_probs  # mass of the more likely tokens
        sorted_probs = sorted_probs.masked_fill(before >= sampling.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    cdf = probs.cumsum(-1)
    picks = torch.searchsorted(cdf, (uniform * cdf[:, -1]).unsqueeze(-1)).squeeze(-1)
    return picks.clamp(max=logits.shape[-1] - 1).cpu()


@torch.no_grad()
def generate_batch(strategy, chunks, prompts: list[list[int]], cfg,
                   sampling: SamplingSettings) -> list[list[int]]:
    """Collective (every rank calls with the same prompts, gets the same result): the completion
    (new tokens only) of each prompt, with a KV cache (`strategy`: a MegatronStrategy or a
    callable giving one; `cfg`: the GPTConfig)."""
    from lightning_mcore.model.kv_cache import next_token_logits

    refuse_too_long(prompts, sampling.max_new_tokens, cfg.seq_length)
    strategy = strategy() if callable(strategy) else strategy
    strategy.refuse_context_parallel("generate")
    if not prompts or sampling.max_new_tokens == 0:
        return [[] for _ in prompts]
    rows, lengths = len(prompts), [len(p) for p in prompts]
    total = max(n + sampling.max_new_tokens for n in lengths)
    generator = torch.Generator().manual_seed(sampling.seed)
    stop = set(sampling.stop)
    completions: list[list[int]] = [[] for _ in prompts]
    done = [False] * rows

    with next_token_logits(strategy, chunks, cfg, rows, total) as forward:
        position = min(lengths)
        logits = forward(torch.tensor([p[:position] for p in prompts]))
        while True:
            chosen = choose_tokens(logits, sampling, generator)
            column = []
            for i, prompt in enumerate(prompts):
                if position < lengths[i]:
                    column.append(prompt[position])
                    continue
                token = int(chosen[i])
                if not done[i]:
                    completions[i].append(token)
                    done[i] = token in stop or len(completions[i]) == sampling.max_new_tokens
                column.append(token)
            if all(done):
                return completions
            logits = forward(torch.tensor(column).unsqueeze(1))
            position += 1
