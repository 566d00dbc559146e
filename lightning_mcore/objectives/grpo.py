"""GRPO: the policy samples groups of completions, rewards rank them within each group.

Per rollout (objectives/grpo_loss.py has the formulas):

1. the batch's prompts (PromptDataModule: ``prompt_ids``, ``prompt`` and the dataset's other
   columns), each repeated ``num_generations`` times, are continued by the current policy
   (model/generation.py, the same sharded chunks, LoRA adapters on);
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
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional, Sequence, Union

import torch
import torch.distributed as dist

from lightning_mcore import rewards as reward_lib
from lightning_mcore.data.packing import build_row
from lightning_mcore.model.config import GPTConfig
from lightning_mcore.model.lora import LoRAConfig, adapters_disabled
from lightning_mcore.model.packing import forward_packed
from lightning_mcore.objectives import grpo_loss
from lightning_mcore.objectives.base import MegatronModule
from lightning_mcore.objectives.frozen import ADAPTERS_OFF, FrozenModel, nothing_to_offload
from lightning_mcore.strategy.optimizer import OptimizerSettings
from lightning_mcore.strategy.parallel import LayoutError


@dataclass
class GRPOSampling:
    """How rollouts are sampled (model/generation.py's SamplingSettings without the length,
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
class Rollout:
    """One rank's rollout: completion `i` continues `prompt_ids[i]`; completions of a prompt are
    consecutive, `num_generations` of them. `rewards` [N] is the weighted total, `per_function`
    each function's [N] scores (for logs). The log-probs are filled in on first use."""

    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    rewards: torch.Tensor
    per_function: dict[str, torch.Tensor] = field(default_factory=dict)
    old_logps: Optional[torch.Tensor] = None
    ref_logps: Optional[torch.Tensor] = None
    steps: int = 0  # optimizer steps taken on it


class GRPOModule(MegatronModule):
    """`reward_funcs`: import paths or callables, `reward_weights` (default 1 each);
    `num_generations` completions per prompt of at most `max_completion_length` tokens, sampled
    as `sampling` says; `beta` (KL to the reference, 0: none, no reference kept); `epsilon_low`,
    `epsilon_high` (the ratio's clip range, DAPO's clip-higher when they differ);
    `loss_normalization` "token" (DAPO) or "sequence" (GRPO); `scale_advantages` (False: Dr.
    GRPO's advantages, not divided by the group's std); `num_iterations` optimizer steps per
    rollout; `offload_reference` (GPU only): the frozen reference (beta > 0, no LoRA) waits in
    CPU memory and comes to the GPU for its forward pass, once per rollout."""

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
    ) -> None:
        super().__init__(model, optim, model_overrides, lora)
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
        self._reference: Optional[FrozenModel] = None  # beta > 0, no LoRA: the starting weights
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
    def configure_model(self) -> None:
        first = self.chunks is None
        super().configure_model()
        if first and self.lora is None and self.beta > 0:
            self._reference = FrozenModel(self._build_chunks(self._strategy()), self.offload_reference)

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
        prompts and gets the same completions)."""
        from lightning_mcore.model.generation import SamplingSettings, generate_batch

        strategy = self._strategy()
        prompt_ids = [list(p) for p in batch["prompt_ids"] for _ in range(self.num_generations)]
        for ids in prompt_ids:
            self.check_prompt_length(len(ids), "a prompt of the batch")
        s = self.sampling
        stop = sorted(set(s.stop) | set(getattr(self.trainer.datamodule, "stop_token_ids", None) or ()))
        # GRPOSampling is SamplingSettings without the length: every other field passes through
        settings = SamplingSettings(**{**asdict(s), "stop": stop, "seed": s.seed + self.trainer.global_step},
                                    max_new_tokens=self.max_completion_length)
        completions = generate_batch(strategy, list(self.chunks), prompt_ids, self.model_config, settings)
        tokenizer = self.trainer.datamodule.tokenizer
        texts = [tokenizer.decode(c, skip_special_tokens=True) for c in completions]
        columns = {k: [v for v in values for _ in range(self.num_generations)]
                   for k, values in batch.items() if k not in ("prompt_ids", "prompt")}
        prompts = [p for p in batch["prompt"] for _ in range(self.num_generations)]
        return self.score_rollout(prompt_ids, completions, prompts, texts, columns)

    def score_rollout(self, prompt_ids, completion_ids, prompts: list, completions: list[str],
                      columns: dict) -> Rollout:
        """A Rollout of the given completions, scored by the reward functions (weighted sum)."""
        per_function = {}
        total = torch.zeros(len(completions), dtype=torch.float64)
        for fn, name, weight in zip(self.reward_funcs, self.reward_names, self.reward_weights):
            values = torch.tensor(reward_lib.score(fn, name, prompts, completions, columns),
                                  dtype=torch.float64)
            per_function[name] = values
            total += weight * values
        return Rollout(prompt_ids, completion_ids, total, per_function)

    def rollout_rows(self, rollout: Rollout) -> dict:
        """[N, seq_length] rows, one per completion, loss on its tokens, and [N] `advantages`."""
        seq = self.model_config.seq_length
        if len(rollout.prompt_ids) % self.num_generations:
            raise ValueError(f"a rollout of {len(rollout.prompt_ids)} completions does not hold "
                             f"whole groups of num_generations={self.num_generations}")
        rows = []
        for prompt, completion in zip(rollout.prompt_ids, rollout.completion_ids):
            completion = list(completion)
            if len(completion) > self.max_completion_length:
                raise ValueError(f"a completion of {len(completion)} tokens is longer than "
                                 f"max_completion_length={self.max_completion_length}")
            if len(prompt) + len(completion) > seq:
                raise ValueError(f"a prompt of {len(prompt)} tokens + its completion of "
                                 f"{len(completion)} exceed the model's seq_length={seq}")
            ids = list(prompt) + completion
            rows.append(build_row([(ids, [0] * len(prompt) + [1] * len(completion))], seq, 0))
        batch = {k: torch.stack([r[k] for r in rows]) for k in rows[0]}
        batch["advantages"] = grpo_loss.group_advantages(
            rollout.rewards, self.num_generations, self.scale_advantages).float()
        return batch

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
        rollout.steps += 1
        return super().training_step(batch, 0)

    def _token_logps(self, batch: dict, reference: bool) -> torch.Tensor:
        """[rows, seq] log-prob of each row's next token, by the policy or the reference."""
        seq = batch["tokens"].shape[1]

        def step(mb, chunk):
            return forward_packed(chunk, mb), lambda out: -out.float().reshape(-1, seq)

        strategy = self._strategy()
        inputs = {k: batch[k] for k in ("tokens", "labels", "position_ids", "segment_ids")}
        if reference and self.lora is not None:
            with adapters_disabled(list(self.chunks)):
                return strategy.forward_collect(inputs, step, seq, packed=True)
        if not reference:
            return strategy.forward_collect(inputs, step, seq, packed=True)
        return self._reference.forward_collect(strategy, inputs, step, seq, packed=True)

    # ------------------------------------------------------------ loss
    def forward_step(self, batch: dict, chunk):
        out = forward_packed(chunk, batch)

        def loss_fn(token_losses):
            rows, seq = batch["loss_mask"].shape
            logp = -token_losses.float().reshape(rows, seq)
            old = batch.get("old_logps")
            old = logp.detach() if old is None else old
            terms = grpo_loss.token_terms(logp, old, batch["advantages"], self.epsilon_low,
                                          self.epsilon_high, self.beta, batch.get("ref_logps"))
            mask = batch["loss_mask"]
            total, count = grpo_loss.normalized(terms.loss, mask, self.loss_normalization)
            tokens = mask.sum()
            report = {"loss": torch.stack([total.detach(), count.detach()])}
            for name, values in (("clip_fraction", terms.clipped), ("kl", terms.kl),
                                 ("entropy", -logp.detach())):
                report[name] = torch.stack([(values.detach() * mask).sum(), tokens])
            return total, count.to(torch.int), report

        return out, loss_fn

    def _log_rollout(self, rollout: Rollout, batch: dict) -> None:
        """Rewards (total and per function) and completion lengths over the data-parallel ranks."""
        lengths = batch["loss_mask"].sum(-1).double()
        series = {"reward": rollout.rewards, **{f"rewards/{k}": v for k, v in rollout.per_function.items()},
                  "completion_length": lengths}
        stats = {}
        for name, values in series.items():
            values = values.double()
            if dist.is_initialized():
                from megatron.core import parallel_state

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
