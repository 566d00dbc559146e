"""GRPO: the policy samples groups of completions, rewards rank them within each group.

Per rollout (objectives/grpo_loss.py has the formulas):

1. the batch's prompts (PromptDataModule: ``prompt_ids``, ``prompt`` and the dataset's other
   columns), each repeated ``num_generations`` times, are continued by the current policy
   (generation/batched.py, the same sharded chunks, LoRA adapters on);
2. reward functions score the decoded completions; their weighted sum, normalized within each
   prompt's group, is every completion's advantage;
3. one row per completion (prompt + completion, loss on the completion's tokens, packed THD
   rows as SFT/DPO send them) goes through the normal training step.

``num_iterations`` > 1 reuses a rollout for that many optimizer steps: the module keeps it and
the log-probs of the policy that sampled it (``old``, taken before its first step), and later
steps' batches only say that a step happens (their prompts are not generated for; the prompt
data module hands out each batch ``num_iterations`` times, so none is skipped). With one
iteration ``old`` is the current policy's log-probs, detached (ratio 1), as in trl.

The reference (``beta`` > 0) is the LoRA base with adapters off, or a frozen copy of the
starting weights sharded like the policy, as in DPO; its log-probs are taken once per rollout
(``offload_reference``: the copy waits in CPU memory between those passes).
``train_on_rollout`` is the seam below generation: a given rollout, one optimizer step.

The rollout keeps what generation saw: each sampled token's log-prob, and on MoE models every
layer's choice of experts for each position (model/routing_replay.py). Every step logs how far
the training forward is from it (``train/rollout_logp_diff``, ``train/rollout_kl``, and on MoE
``train/routing_mismatch``: the fraction of (token, MoE layer) pairs whose experts differ, with
replay off); ``correction`` can replay the routing (R3) and weight tokens by truncated importance
sampling.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Callable, Literal, Optional, Sequence, Union

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from lightning_mcore import rewards as reward_lib
from lightning_mcore.data.packing import build_row
from lightning_mcore.generation.batched import SamplingSettings, generate_traced
from lightning_mcore.lora.config import LoRAConfig
from lightning_mcore.model import routing_replay
from lightning_mcore.model.config import GPTConfig
from lightning_mcore.objectives import grpo_loss
from lightning_mcore.objectives.base import MegatronModule
from lightning_mcore.objectives.frozen import ADAPTERS_OFF, WithFrozenModel, nothing_to_offload
from lightning_mcore.objectives.grpo_variants import DynamicSampling, OverlongShaping, fill_with_varied_groups
from lightning_mcore.objectives.rollout import Rollout
from lightning_mcore.sequence.packing import forward_packed
from lightning_mcore.strategy.optimizer import OptimizerSettings
from lightning_mcore.strategy.parallel import LayoutError


@dataclass
class GRPOSampling:
    """How rollouts are sampled (generation/batched.py's SamplingSettings without the length,
    which is GRPOModule's max_completion_length). `stop`: token ids that end a completion, besides
    the prompt data's own (its tokenizer's end-of-sequence and end-of-turn tokens). `seed` is
    offset by the step, so that every rollout draws new samples."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    greedy: bool = False
    stop: list[int] = field(default_factory=list)
    seed: int = 0
    cuda_graphs: bool = True


@dataclass
class RolloutCorrection:
    """How training treats the gap between the policy that generated a rollout and the forward
    pass that trains on it. `routing_replay`: "r3" (MoE models): every forward pass on the
    rollout routes each token to the experts it was routed to while generating; "off": the
    routers choose again. `tis_cap` > 0: token-level truncated importance sampling, each token's
    policy loss weighted by min(pi_old / pi_rollout, tis_cap) (for rollouts sampled in another
    precision or engine); 0: off. `fp32_logits`: the LM head's logits kept in fp32 in every pass
    (generation, log-probs, training; model/fp32_logits.py), not rounded to bf16, which moves a
    log-prob by a rounding step wherever two passes differ in a last bit: the larger the logits,
    the larger the step (MiniMax-M1's fix). Off by default: on the random-weight Qwen3-30B-A3B
    shape it changed the mismatch by 1% at 12% more training time (benchmarks/RESULTS.md)."""

    routing_replay: Literal["off", "r3"] = "off"
    tis_cap: float = 0.0
    fp32_logits: bool = False

    def __post_init__(self) -> None:
        if self.routing_replay not in ("off", "r3"):
            raise ValueError(f"correction.routing_replay must be 'off' or 'r3', got {self.routing_replay!r}")
        if not self.tis_cap >= 0:
            raise ValueError(f"correction.tis_cap must be >= 0 (0: off), got {self.tis_cap!r}")


class GRPOModule(WithFrozenModel, MegatronModule):
    """GRPO reinforcement learning on prompts (PromptDataModule): the model generates a group of
    completions per prompt, reward functions score them, and each is trained on its reward
    relative to its group's.

    `reward_funcs`: import paths or callables, `reward_weights` (default 1 each);
    `num_generations` completions per prompt of at most `max_completion_length` tokens, sampled
    as `sampling` says; `beta` (KL to the reference, 0: none, no reference kept); `epsilon_low`,
    `epsilon_high` (the ratio's clip range, DAPO's clip-higher when they differ);
    `loss_normalization` "token" (DAPO) or "sequence" (GRPO); `scale_advantages` (False: Dr.
    GRPO's advantages, not divided by the group's std); `num_iterations` optimizer steps per
    rollout; `offload_reference` (GPU only): the frozen reference (beta > 0, no LoRA) waits in
    CPU memory and comes to the GPU for its forward pass, once per rollout; `correction`:
    routing replay and truncated importance sampling (RolloutCorrection); `importance_level`
    "token" or "sequence" (GSPO: one clipped ratio per completion, Qwen's choice for MoE, with
    epsilons of a few 1e-4); DAPO's `overlong` shaping and `dynamic_sampling`
    (objectives/grpo_variants.py)."""

    packed_sequences = True

    def __init__(
        self,
        model: Union[GPTConfig, str],
        optim: Optional[OptimizerSettings] = None,
        model_overrides: Optional[dict] = None,
        lora: Optional[LoRAConfig] = None,
        reward_funcs: Sequence[Union[str, Callable]] = ("lightning_mcore.rewards.boxed_answer",),
        reward_weights: Optional[list[float]] = None,
        num_generations: int = 8,
        max_completion_length: int = 64,
        sampling: Optional[GRPOSampling] = None,
        beta: float = 0.0,
        epsilon_low: float = 0.2,
        epsilon_high: float = 0.2,
        loss_normalization: str = "token",
        scale_advantages: bool = True,
        num_iterations: int = 1,
        offload_reference: bool = False,
        correction: Optional[RolloutCorrection] = None,
        importance_level: Literal["token", "sequence"] = "token",
        overlong: Optional[OverlongShaping] = None,
        dynamic_sampling: Optional[DynamicSampling] = None,
    ) -> None:
        super().__init__(model, optim, model_overrides, lora)
        self.correction = correction or RolloutCorrection()
        self.model_config = replace(self.model_config, fp32_logits=self.correction.fp32_logits)
        if self.model_config.num_moe_experts:  # routers that record (mismatch) and replay
            self.model_config = replace(self.model_config, moe_routing_replay=True)
        elif self.correction.routing_replay != "off":
            raise ValueError("correction.routing_replay='r3' replays the experts of MoE layers; this "
                             "model has none: use routing_replay: off")
        if self.correction.routing_replay != "off" and self.model_config.recompute_granularity:
            raise ValueError(f"correction.routing_replay='r3' with recompute_granularity="
                             f"{self.model_config.recompute_granularity!r} is not supported yet (the "
                             "recomputed forward would route anew): turn recompute off")
        if isinstance(reward_funcs, (str, bytes)) or callable(reward_funcs):
            reward_funcs = [reward_funcs]
        if not reward_funcs:
            raise ValueError("reward_funcs is empty: give at least one reward function")
        self.reward_funcs = [reward_lib.resolve_reward(spec) for spec in reward_funcs]
        self.reward_names = [spec if isinstance(spec, str) else reward_lib.reward_name(spec)
                             for spec in reward_funcs]
        weights = [1.0] * len(self.reward_funcs) if reward_weights is None else list(reward_weights)
        if len(weights) != len(self.reward_funcs):
            raise ValueError(f"reward_weights has {len(weights)} weights for "
                             f"{len(self.reward_funcs)} reward_funcs: give one per function")
        self.reward_weights = [float(w) for w in weights]
        if not isinstance(num_generations, int) or num_generations < 2:
            raise ValueError(f"num_generations must be >= 2, got {num_generations}: advantages are "
                             "normalized within each prompt's group of completions, and a group of "
                             "one has nothing to compare with")
        seq = self.model_config.seq_length
        if not isinstance(max_completion_length, int) or not 0 < max_completion_length < seq:
            raise ValueError(f"max_completion_length={max_completion_length} leaves no room for a "
                             f"prompt in the model's seq_length={seq}: use 1..{seq - 1}, or raise "
                             "seq_length (model_overrides.seq_length)")
        if beta < 0:
            raise ValueError(f"beta must be >= 0, got {beta}")
        if not (0 <= epsilon_low < 1 and epsilon_high >= 0):
            raise ValueError(f"need 0 <= epsilon_low < 1 and epsilon_high >= 0, got "
                             f"epsilon_low={epsilon_low}, epsilon_high={epsilon_high}")
        if loss_normalization not in grpo_loss.NORMALIZATIONS:
            raise ValueError(f"loss_normalization must be one of {grpo_loss.NORMALIZATIONS}, "
                             f"got {loss_normalization!r}")
        if importance_level not in grpo_loss.IMPORTANCE_LEVELS:
            raise ValueError(f"importance_level must be one of {grpo_loss.IMPORTANCE_LEVELS}, "
                             f"got {importance_level!r}")
        if overlong is not None and overlong.mode == "penalty" and overlong.buffer > max_completion_length:
            raise ValueError(f"overlong.buffer={overlong.buffer} is longer than max_completion_length="
                             f"{max_completion_length}: the penalty falls over the last buffer tokens "
                             f"of the allowed length")
        if not isinstance(num_iterations, int) or num_iterations < 1:
            raise ValueError(f"num_iterations must be an int >= 1, got {num_iterations}")
        if offload_reference and (beta == 0 or lora is not None):
            why = "beta=0 keeps no reference model (no KL term)" if beta == 0 else f"with lora {ADAPTERS_OFF}"
            raise nothing_to_offload(f": {why}")
        self.num_generations, self.max_completion_length = num_generations, max_completion_length
        self.sampling = sampling or GRPOSampling()
        self.beta, self.epsilon_low, self.epsilon_high = float(beta), epsilon_low, epsilon_high
        self.loss_normalization, self.scale_advantages = loss_normalization, scale_advantages
        self.num_iterations, self.offload_reference = num_iterations, offload_reference
        self.importance_level, self.overlong, self.dynamic_sampling = importance_level, overlong, dynamic_sampling
        self._routing_counts: Optional[torch.Tensor] = None  # (differing, all) during a counted step
        self._routers: Optional[dict] = None  # routing_replay.routers_by_chunk, on first use
        self._rollout: Optional[Rollout] = None

    # ------------------------------------------------------------ checks before launch
    def check_layout(self, strategy) -> None:
        """Every rank's rows must hold whole groups (called by MegatronStrategy.validate_module,
        before any process starts)."""
        rows = strategy.data_parallel_batch_size
        dp = strategy.data_parallel_size
        if rows % self.num_generations:
            raise LayoutError(
                f"global_batch_size={strategy.batch.global_batch_size} gives each of the {dp} "
                f"data-parallel rank(s) {rows} completions, not a multiple of num_generations="
                f"{self.num_generations} (a prompt's group must stay on one rank): use a "
                f"global_batch_size divisible by {self.num_generations * dp}",
                options=("global_batch_size",), devices=dp > 1)

    def check_prompt_length(self, max_prompt_length: int, what: str) -> None:
        """Refuse prompts that, with a full completion, would not fit the model's rows."""
        seq = self.model_config.seq_length
        if max_prompt_length + self.max_completion_length > seq:
            raise ValueError(
                f"{what}: prompts of up to {max_prompt_length} tokens + max_completion_length="
                f"{self.max_completion_length} exceed the model's seq_length={seq}, leaving no room "
                f"for completions: lower one of them to fit {seq} tokens, or raise seq_length")

    # ------------------------------------------------------------ model
    def _frozen_source(self):
        """beta > 0, no LoRA: a frozen copy of the starting weights (beta = 0: no reference)."""
        return self if self.lora is None and self.beta > 0 else None

    def setup(self, stage: str) -> None:
        super().setup(stage)
        datamodule = getattr(self.trainer, "datamodule", None)
        if hasattr(datamodule, "max_prompt_length"):
            self.check_prompt_length(datamodule.max_prompt_length, type(datamodule).__name__)

    # ------------------------------------------------------------ rollouts
    def training_step(self, batch, batch_idx: int):
        if self._rollout is None or self._rollout.steps >= self.num_iterations:
            start = time.perf_counter()
            self._rollout = self.make_rollout(batch)
            seconds = time.perf_counter() - start
            tokens = sum(len(c) for c in self._rollout.completion_ids)
            self.log_dict({"train/rollout_s": seconds,
                           "train/rollout_tokens_per_s": tokens / max(seconds, 1e-9)}, batch_size=1)
        start = time.perf_counter()
        loss = self.train_on_rollout(self._rollout)
        self.log("train/train_step_s", time.perf_counter() - start, batch_size=1)
        return loss

    def make_rollout(self, batch: dict) -> Rollout:
        """Generate `num_generations` completions for each prompt of `batch` with the current
        policy and score them (collective: every rank of a model-parallel group holds the same
        prompts and gets the same completions); with dynamic sampling, refill groups of equal
        rewards from more prompts."""
        rollout = self.generate_rollout(batch)
        if self.dynamic_sampling is None:
            return rollout
        data = self.trainer.datamodule
        if not hasattr(data, "sample_prompts"):
            raise ValueError(f"dynamic_sampling draws more prompts with the data module's sample_prompts; "
                             f"{type(data).__name__} has none (PromptDataModule has)")
        step = self.trainer.global_step

        def more(round_: int) -> Rollout:
            extra = data.sample_prompts(len(batch["prompt_ids"]), seed=step * 1_000 + round_)
            return self.generate_rollout(extra, round_)

        rollout, stats = fill_with_varied_groups(rollout, more, self.num_generations,
                                                 self.dynamic_sampling.max_rounds, self._any_rank)
        self.log_dict({f"train/{k}": v for k, v in stats.items()}, batch_size=1)
        return rollout

    def _any_rank(self, flag: bool) -> bool:
        """Whether `flag` holds on any rank (collective)."""
        if not dist.is_initialized():
            return flag
        value = torch.tensor([float(flag)], device=self._strategy().root_device)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return bool(value.item())

    def generate_rollout(self, batch: dict, round_: int = 0) -> Rollout:
        """`num_generations` completions of each prompt of `batch`, scored; `round_` > 0 (dynamic
        sampling's extra generations) draws with another seed."""
        strategy = self._strategy()
        prompt_ids = [list(p) for p in batch["prompt_ids"] for _ in range(self.num_generations)]
        for ids in prompt_ids:
            self.check_prompt_length(len(ids), "a prompt of the batch")
        s = self.sampling
        stop = sorted(set(s.stop) | set(getattr(self.trainer.datamodule, "stop_token_ids", None) or ()))
        # GRPOSampling is SamplingSettings without the length: every other field passes through
        seed = s.seed + self.trainer.global_step + round_ * 1_000_003
        settings = SamplingSettings(**{**asdict(s), "stop": stop, "seed": seed},
                                    max_new_tokens=self.max_completion_length)
        generated = generate_traced(strategy, list(self.chunks), prompt_ids, self.model_config, settings,
                                    routing=bool(self.model_config.num_moe_experts))
        completions = generated.completions
        tokenizer = self.trainer.datamodule.tokenizer
        texts = [tokenizer.decode(c, skip_special_tokens=True) for c in completions]
        columns = {k: [v for v in values for _ in range(self.num_generations)]
                   for k, values in batch.items() if k not in ("prompt_ids", "prompt")}
        prompts = [p for p in batch["prompt"] for _ in range(self.num_generations)]
        rollout = self.score_rollout(prompt_ids, completions, prompts, texts, columns)
        rollout.sampled_logps, rollout.routing = generated.logps, generated.routing
        rollout.truncated = [len(c) == self.max_completion_length and c[-1] not in stop for c in completions]
        return rollout

    def score_rollout(self, prompt_ids, completion_ids, prompts: list, completions: list[str],
                      columns: dict) -> Rollout:
        """A Rollout of the given completions, scored by the reward functions (weighted sum) and
        the overlong penalty (OverlongShaping "penalty")."""
        per_function = {}
        total = torch.zeros(len(completions), dtype=torch.float64)
        for fn, name, weight in zip(self.reward_funcs, self.reward_names, self.reward_weights):
            values = torch.tensor(reward_lib.score(fn, name, prompts, completions, columns),
                                  dtype=torch.float64)
            per_function[name] = values
            total += weight * values
        if self.overlong is not None and self.overlong.mode == "penalty":
            lengths = torch.tensor([len(c) for c in completion_ids], dtype=torch.float64)
            per_function["overlong"] = grpo_loss.overlong_penalty(
                lengths, self.max_completion_length, self.overlong.buffer, self.overlong.factor)
            total += per_function["overlong"]
        return Rollout(prompt_ids, completion_ids, total, per_function)

    def rollout_rows(self, rollout: Rollout) -> dict:
        """[N, seq_length] rows, one per completion, loss on its tokens, and [N] `advantages`."""
        seq = self.model_config.seq_length
        if len(rollout.prompt_ids) % self.num_generations:
            raise ValueError(f"a rollout of {len(rollout.prompt_ids)} completions does not hold "
                             f"whole groups of num_generations={self.num_generations}")
        rows = []
        filtered = [False] * len(rollout.prompt_ids)
        if self.overlong is not None and self.overlong.mode == "filter" and rollout.truncated is not None:
            filtered = rollout.truncated
        for prompt, completion, drop in zip(rollout.prompt_ids, rollout.completion_ids, filtered):
            completion = list(completion)
            if len(completion) > self.max_completion_length:
                raise ValueError(f"a completion of {len(completion)} tokens is longer than "
                                 f"max_completion_length={self.max_completion_length}")
            if len(prompt) + len(completion) > seq:
                raise ValueError(f"a prompt of {len(prompt)} tokens + its completion of "
                                 f"{len(completion)} exceed the model's seq_length={seq}")
            ids = list(prompt) + completion
            # a filtered (overlong) completion is in the row but carries no loss
            rows.append(build_row([(ids, [0] * len(prompt) + [int(not drop)] * len(completion))], seq, 0))
        batch = {k: torch.stack([r[k] for r in rows]) for k in rows[0]}
        if rollout.sampled_logps is not None:
            batch["rollout_logps"] = self._rollout_logps(rollout, seq)
        if rollout.routing is not None:
            batch["routing"], batch["routing_fed"] = _routing_rows(
                rollout.routing, seq, self.model_config.moe_router_topk)
        batch["advantages"] = grpo_loss.group_advantages(
            rollout.rewards, self.num_generations, self.scale_advantages).float()
        return batch

    @staticmethod
    def _rollout_logps(rollout: Rollout, seq: int) -> torch.Tensor:
        """[N, seq]: completion token j's sampled log-prob where the row's loss sees it (the
        position before it, P - 1 + j), zeros elsewhere."""
        out = torch.zeros(len(rollout.prompt_ids), seq)
        for i, (prompt, logps) in enumerate(zip(rollout.prompt_ids, rollout.sampled_logps)):
            if len(logps) != len(rollout.completion_ids[i]):
                raise ValueError(f"completion {i}: {len(logps)} sampled log-probs for "
                                 f"{len(rollout.completion_ids[i])} tokens")
            out[i, len(prompt) - 1:len(prompt) - 1 + len(logps)] = torch.tensor(logps, dtype=torch.float64)
        return out

    def train_on_rollout(self, rollout: Rollout):
        """One optimizer step on `rollout` (the old and reference log-probs taken first if this
        is its first step); logs the loss, its terms and the rollout's rewards."""
        batch = self.rollout_rows(rollout)
        if self.num_iterations > 1 and rollout.old_logps is None:
            rollout.old_logps = self._token_logps(batch, reference=False)
        if self.beta > 0 and rollout.ref_logps is None:
            rollout.ref_logps = self._token_logps(batch, reference=True)
        for name in ("old_logps", "ref_logps"):
            if getattr(rollout, name) is not None:
                batch[name] = getattr(rollout, name)
        if rollout.steps == 0:
            self._log_rollout(rollout, batch)
        # the routers' mismatch is measured on the rollout's first step (later steps drift by design)
        self._routing_counts = (torch.zeros(2, dtype=torch.float64)
                                if rollout.steps == 0 and "routing" in batch and self._replay_off else None)
        rollout.steps += 1
        try:
            loss = super().training_step(batch, 0)
            if self._routing_counts is not None:
                self._log_routing_mismatch(self._routing_counts)
        finally:
            self._routing_counts = None  # counted in this step's forward passes only
        return loss

    @property
    def _replay_off(self) -> bool:
        return self.correction.routing_replay == "off"

    def _log_routing_mismatch(self, counts: torch.Tensor) -> None:
        """Fraction of (token, MoE layer) pairs routed elsewhere than in the rollout, over all
        ranks (stages hold other layers, data-parallel ranks other rows)."""
        if dist.is_initialized():
            counts = counts.to(self._strategy().root_device)
            dist.all_reduce(counts)
        differ, total = counts.tolist()
        self.log("train/routing_mismatch", differ / max(total, 1.0), batch_size=1)

    def _token_logps(self, batch: dict, reference: bool) -> torch.Tensor:
        """[rows, seq] log-prob of each row's next token, by the policy or the reference."""
        seq = batch["tokens"].shape[1]

        def step(mb, chunk):
            with self._routed(mb, chunk, replay=not reference):
                out = forward_packed(chunk, mb)
            return out, lambda out: -out.float().reshape(-1, seq)

        inputs = {k: batch[k] for k in ("tokens", "labels", "position_ids", "segment_ids", "routing")
                  if k in batch}
        if reference:
            return self._frozen_collect(inputs, step, seq)
        return self._strategy().forward_collect(inputs, step, seq, packed=True)

    # ------------------------------------------------------------ loss
    def _routed(self, mb: dict, chunk, replay: bool):
        """Around one forward pass of `chunk` on a rollout's microbatch: replay its routing (R3),
        or record the routers' choices to count how many differ from it (replay off, the
        rollout's first step); nothing for rows without routing or for the reference."""
        routing = mb.get("routing")
        if routing is None or not replay:
            return contextlib.nullcontext()
        if self._routers is None:  # the chunks are built once (configure_model)
            self._routers = routing_replay.routers_by_chunk(self.chunks)
        routers = self._routers.get(id(chunk), [])
        if not routers:  # a pipeline stage of dense layers
            return contextlib.nullcontext()
        flat = routing.flatten(0, 1)  # [rows * seq, layers, topk]: a THD row's token order
        sp = self._strategy().parallel.sequence_parallel
        if not self._replay_off:
            return routing_replay.replaying(routers, flat, sp)
        if self._routing_counts is None:
            return contextlib.nullcontext()
        return self._counting(routers, flat, sp, mb["routing_fed"])

    @contextlib.contextmanager
    def _counting(self, routers, flat: torch.Tensor, sp: bool, fed: torch.Tensor):
        """Record a chunk's `routers` in one forward pass, count the positions fed while
        generating whose experts differ from the rollout's."""
        with routing_replay.recording_chunk(routers) as chosen:
            yield
        local = routing_replay.local_tokens(flat, sp)
        where = routing_replay.local_tokens(fed.reshape(-1), sp)
        for column, got in chosen.items():
            differ = routing_replay.differing(got, local[:, column])[where.to(got.device)]
            # summed on the device: no wait for it per layer (read once, after the step)
            counts = torch.stack([differ.sum(), differ.new_tensor(differ.numel(), dtype=torch.long)])
            self._routing_counts = self._routing_counts.to(got.device) + counts.double()

    def forward_step(self, batch: dict, chunk):
        with self._routed(batch, chunk, replay=True):
            out = forward_packed(chunk, batch)

        def loss_fn(token_losses):
            rows, seq = batch["loss_mask"].shape
            logp = -token_losses.float().reshape(rows, seq)
            old = batch.get("old_logps")
            old = logp.detach() if old is None else old
            mask = batch["loss_mask"]
            sampled = batch.get("rollout_logps")
            weights = None
            if sampled is not None and self.correction.tis_cap > 0:
                weights = grpo_loss.tis_weights(old, sampled, self.correction.tis_cap)
            terms = grpo_loss.token_terms(logp, old, batch["advantages"], self.epsilon_low,
                                          self.epsilon_high, self.beta, batch.get("ref_logps"), weights,
                                          self.importance_level, mask)
            total, count = grpo_loss.normalized(terms.loss, mask, self.loss_normalization)
            tokens = mask.sum()
            report = {"loss": torch.stack([total.detach(), count.detach()])}
            for name, values in (("clip_fraction", terms.clipped), ("kl", terms.kl),
                                 ("entropy", -logp.detach())):
                report[name] = torch.stack([(values.detach() * mask).sum(), tokens])
            if sampled is not None:
                for name, (value, n) in grpo_loss.rollout_mismatch(old, sampled, mask).items():
                    report[name] = torch.stack([value, n])
            return total, count.to(torch.int), report

        return out, loss_fn

    def _log_rollout(self, rollout: Rollout, batch: dict) -> None:
        """Rewards (total and per function) and completion lengths over the data-parallel ranks."""
        lengths = torch.tensor([len(c) for c in rollout.completion_ids], dtype=torch.float64)
        series = {"reward": rollout.rewards, **{f"rewards/{k}": v for k, v in rollout.per_function.items()},
                  "completion_length": lengths}
        stats = {}
        for name, values in series.items():
            values = values.double()
            if dist.is_initialized():
                group = parallel_state.get_data_parallel_group()
                if dist.get_world_size(group) > 1:
                    values = values.to(self._strategy().root_device)
                    gathered = [torch.empty_like(values) for _ in range(dist.get_world_size(group))]
                    dist.all_gather(gathered, values, group=group)
                    values = torch.cat(gathered)
            summary = grpo_loss.sequence_stats(values)
            stats[f"train/{name}"] = summary["mean"]
            stats[f"train/{name}_{'max' if name == 'completion_length' else 'std'}"] = \
                summary["max" if name == "completion_length" else "std"]
        self.log_dict(stats, batch_size=1)
        self.last_rollout_stats = stats


def _routing_rows(routing: list[torch.Tensor], seq: int, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, seq, layers, topk] experts per row position: the rollout's where a position was fed
    while generating; elsewhere (the last token, padding: positions whose output no loss reads)
    experts 0..topk-1. And [N, seq] bool: where the rollout's."""
    layers = next((r.shape[1] for r in routing if r.numel()), 0)
    out = torch.arange(topk, dtype=torch.int16).expand(len(routing), seq, layers, topk).clone()
    fed = torch.zeros(len(routing), seq, dtype=torch.bool)
    for i, chosen in enumerate(routing):
        if chosen.numel():
            out[i, :chosen.shape[0]] = chosen
            fed[i, :chosen.shape[0]] = True
    return out, fed
