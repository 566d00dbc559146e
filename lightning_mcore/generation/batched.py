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

import contextlib
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from lightning_mcore.generation.kv_cache import next_token_logits
from lightning_mcore.model import routing_replay


@dataclass
class SamplingSettings:
    max_new_tokens: int = 64
    greedy: bool = False  # True: argmax (temperature/top_p/top_k ignored)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    stop: list[int] = field(default_factory=list)  # stop token ids (kept in the completion)
    seed: int = 0
    # GPU: decode steps replay CUDA graphs kept between calls with the same number of prompts
    # (generation/decode_graphs.py); their KV cache then stays allocated between calls
    cuda_graphs: bool = True
    # of the GPU's memory, what the kept graphs may hold; later positions decode eagerly. At TP>1
    # each position's graph keeps its collectives' tensors (the 8B recipe at TP=2, 64 rows: ~57 MiB)
    graph_memory_fraction: float = 0.1

    def __post_init__(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 0:
            raise ValueError(f"SamplingSettings: max_new_tokens must be an int >= 0, "
                             f"got {self.max_new_tokens!r}.")
        if not self.greedy and not self.temperature > 0:
            raise ValueError(f"SamplingSettings: temperature must be > 0, got {self.temperature!r} "
                             f"(use greedy=True for argmax).")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingSettings: top_p must be in (0, 1], got {self.top_p!r}.")
        if not 0 <= self.graph_memory_fraction <= 1:
            raise ValueError(f"SamplingSettings: graph_memory_fraction must be in [0, 1], got "
                             f"{self.graph_memory_fraction!r}.")
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
                  uniform: torch.Tensor) -> torch.Tensor:
    """Next token of each row of `logits` [rows, vocab]: argmax, or a draw from the
    temperature/top-k/top-p distribution by inverse CDF of the row's number in `uniform` [rows]
    (drawn on the CPU, so every rank and layout draws alike); float64 on the logits' device."""
    logits = logits.detach().double()
    if not torch.isfinite(logits).all():
        raise FloatingPointError("generate: the model's logits are not finite (NaN/inf).")
    uniform = uniform.double().to(logits.device)
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
    """Collective (tensor- and pipeline-parallel peers call with the same prompts and get the
    same result): the completion
    (new tokens only) of each prompt, with a KV cache (`strategy`: a MegatronStrategy or a
    callable giving one; `cfg`: the GPTConfig). Data-parallel ranks may pass different prompts
    (GRPO's rollouts); tensor- and pipeline-parallel peers pass the same."""
    return generate_traced(strategy, chunks, prompts, cfg, sampling, logps=False).completions


def generate(strategy, chunks, prompt: list[int], max_new_tokens: int, cfg,
             stop: Optional[list[int]] = None) -> list[int]:
    """Greedy continuation of one prompt; stops after any token in `stop` (kept)."""
    sampling = SamplingSettings(max_new_tokens=max_new_tokens, greedy=True, stop=list(stop or []))
    return generate_batch(strategy, chunks, [list(prompt)], cfg, sampling)[0]


@dataclass
class Generated:
    """What generate_traced gives: each prompt's `completions` (new tokens), the `logps` of
    those tokens under the model (log-softmax of its logits at temperature 1, float64, whatever
    the sampling settings; empty lists unless asked for), and with `routing`, for each prompt,
    the experts every position fed to the model chose: [len(prompt) + len(completion) - 1, MoE
    layers of this rank, topk] (the last new token is never fed)."""

    completions: list[list[int]]
    logps: list[list[float]]
    routing: Optional[list[torch.Tensor]] = None

    def rows(self, start: int, count: int) -> "Generated":
        part = slice(start, start + count)
        routing = None if self.routing is None else self.routing[part]
        return Generated(self.completions[part], self.logps[part], routing)


@torch.no_grad()
def generate_traced(strategy, chunks, prompts: list[list[int]], cfg, sampling: SamplingSettings,
                    routing: bool = False, logps: bool = True) -> Generated:
    """generate_batch, with each new token's log-prob and, with `routing`, every MoE layer's
    choice of experts for every position fed (model/routing_replay.py; in decode CUDA graphs
    too, through static buffers)."""
    refuse_too_long(prompts, sampling.max_new_tokens, cfg.seq_length)
    strategy = strategy() if callable(strategy) else strategy
    strategy.refuse_context_parallel("generate")
    strategy.sync_weights()  # the last update on every rank (overlap_param_gather), decode graphs included
    shared = _expert_parallel_share(prompts, cfg)
    if shared is not None:  # every data-parallel rank generates all ranks' prompts
        parts, start = shared
        everyone = [p for part in parts for p in part]
        out = generate_columns(strategy, chunks, everyone, cfg, sampling, [len(part) for part in parts],
                               routing=routing, logps=logps)
        return out.rows(start, len(prompts))
    return generate_columns(strategy, chunks, prompts, cfg, sampling, [len(prompts)], routing=routing,
                            logps=logps)


def _expert_parallel_share(prompts: list[list[int]], cfg) -> Optional[tuple[list, int]]:
    """With expert parallelism the experts' all-to-all spans data-parallel ranks, which then must
    run the same forward calls; their own prompts (other counts, other lengths) would give each
    rank its own number of steps and hang the all-to-all. So each generates the prompts of all
    data-parallel ranks: returns (each rank's prompts, where this rank's begin among all), or None
    when not needed."""
    if not cfg.num_moe_experts or (ps.get_expert_model_parallel_world_size() or 1) == 1:
        return None
    group = ps.get_data_parallel_group()
    size = dist.get_world_size(group) if dist.is_initialized() else 1
    if size == 1:
        return None
    parts: list = [None] * size
    dist.all_gather_object(parts, prompts, group=group)
    start = sum(len(p) for p in parts[:dist.get_rank(group)])
    return parts, start


def _uniforms(seed: int, position: int, groups: list[int]) -> torch.Tensor:
    """One uniform per row for the token at `position`, from a stream keyed by (seed, position)
    that restarts for each group of rows (a data-parallel rank's prompts): a row draws the same
    number whatever else is in the batch, so sampling is the same when ranks share a batch."""
    gen = [torch.Generator().manual_seed((seed * 1_000_003 + position) % 2**63) for _ in groups]
    return torch.cat([torch.rand(n, generator=g, dtype=torch.float64) for n, g in zip(groups, gen)])


def generate_columns(strategy, chunks, prompts: list[list[int]], cfg, sampling: SamplingSettings,
                     groups: list[int], inputs=None, routing: bool = False,
                     logps: bool = False) -> Generated:
    """The completions of `prompts` through the cache, one column per step; `groups`: the row
    counts that draw their numbers from one stream (_uniforms); `inputs`: what a step feeds the
    model (generation/kv_cache.py; default token ids); `routing`: record the experts' choices;
    `logps`: keep each new token's log-prob (a log-softmax over the vocabulary per step)."""
    if not prompts or sampling.max_new_tokens == 0:
        return Generated([[] for _ in prompts], [[] for _ in prompts],
                         [torch.zeros(0) for _ in prompts] if routing else None)
    rows, lengths = len(prompts), [len(p) for p in prompts]
    total = max(n + sampling.max_new_tokens for n in lengths)
    stop = set(sampling.stop)
    completions: list[list[int]] = [[] for _ in prompts]
    kept: list[list[float]] = [[] for _ in prompts]
    done = [False] * rows
    columns: list[torch.Tensor] = []  # routing of each call: [n, rows, layers, topk]
    record = routing_replay.recording(chunks) if routing else contextlib.nullcontext()

    with record as recorder, next_token_logits(strategy, chunks, cfg, rows, total, sampling.cuda_graphs,
                                               inputs, recording=routing,
                                               graph_memory_fraction=sampling.graph_memory_fraction) as forward:

        def step(column: torch.Tensor) -> torch.Tensor:
            logits = forward(column)
            if routing:
                calls = recorder.take()  # from a graph: only what its capture recorded, stale
                graphed = forward.graph_routing()
                if graphed is not None:
                    calls = [[buffer.clone()] for buffer in graphed]
                columns.append(_call_routing(calls, column.shape[1], rows))
            return logits

        position = min(lengths)
        logits = step(torch.tensor([p[:position] for p in prompts]))
        while True:
            chosen = choose_tokens(logits, sampling, _uniforms(sampling.seed, position, groups))
            if logps:
                chosen_logp = torch.log_softmax(logits.detach().double(), -1).gather(
                    -1, chosen.to(logits.device)[:, None])[:, 0].tolist()
            chosen = chosen.tolist()
            column = []
            for i, prompt in enumerate(prompts):
                if position < lengths[i]:
                    column.append(prompt[position])
                    continue
                token = chosen[i]
                if not done[i]:
                    completions[i].append(token)
                    if logps:
                        kept[i].append(chosen_logp[i])
                    done[i] = token in stop or len(completions[i]) == sampling.max_new_tokens
                column.append(token)
            if all(done):
                break
            logits = step(torch.tensor(column).unsqueeze(1))
            position += 1
    if not routing:
        return Generated(completions, kept)
    fed = torch.cat(columns)  # [positions, rows, layers, topk]
    return Generated(completions, kept, [fed[: lengths[i] + len(completions[i]) - 1, i].cpu()
                                          for i in range(rows)])


def _call_routing(calls: list[list[torch.Tensor]], n: int, rows: int) -> torch.Tensor:
    """[n, rows, layers, topk] from one cached forward call's records (one per router of this
    rank, tokens s-major: column-by-column of the rows)."""
    per_router = []
    for records in calls:
        (chosen,) = records  # one microbatch per cached call
        per_router.append(chosen.reshape(n, rows, -1).to(torch.int16))  # expert ids fit; 1/4 of int64
    if not per_router:  # a pipeline stage of dense layers only (DeepSeek's first layers)
        return torch.zeros(n, rows, 0, 0, dtype=torch.int16)
    return torch.stack(per_router, dim=2)
