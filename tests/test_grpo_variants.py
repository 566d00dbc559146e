"""Acceptance (issue 46, part 4): GSPO's sequence-level ratio, DAPO's overlong shaping and dynamic
sampling, each against a hand computation; dynamic sampling end to end at EP=2 (the ranks
generate in lockstep while one still lacks groups) trains only on groups whose rewards differ."""

import json
import math
from pathlib import Path

import lightning as L
import pytest
import torch

from hf_models import make_hf_model
from lightning_mcore import (DynamicSampling, GRPOModule, GRPOSampling, MegatronStrategy, OptimizerSettings,
                             OverlongShaping)
from lightning_mcore.objectives import grpo_loss
from lightning_mcore.objectives.grpo_variants import fill_with_varied_groups
from lightning_mcore.objectives.rollout import Rollout

ROOT = Path(__file__).parents[1]
TOKENIZER = str(ROOT / "configs/sample_data/tiny-llama")
G = 4


def test_sequence_level_ratio_by_hand():
    """GSPO: rho_i = exp(mean of the row's masked log-ratios), the same for each of its tokens;
    unclipped, d loss_t / d logp_s = -A rho / n for every masked s of the row."""
    logp = torch.tensor([[-1.0, -2.0, -3.0, -9.0]], requires_grad=True)
    old = torch.tensor([[-1.2, -1.9, -3.1, -1.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    adv = torch.tensor([0.5])
    terms = grpo_loss.token_terms(logp, old, adv, 0.2, 0.2, level="sequence", mask=mask)
    rho = math.exp((0.2 - 0.1 + 0.1) / 3)
    assert torch.allclose(terms.loss, torch.full((1, 4), -0.5 * rho))
    assert terms.clipped.sum() == 0
    (terms.loss[0, 0]).backward()
    assert torch.allclose(logp.grad, torch.tensor([[-0.5 * rho / 3] * 3 + [0.0]]))
    # a ratio past 1 + eps with a positive advantage is clipped for every token of the row
    far = grpo_loss.token_terms(logp.detach(), old - 1.0, adv, 0.2, 0.2, level="sequence", mask=mask)
    assert far.clipped.sum() == 4 and torch.allclose(far.loss, torch.full((1, 4), -0.5 * 1.2))
    with pytest.raises(ValueError, match="needs the mask"):
        grpo_loss.token_terms(logp, old, adv, 0.2, 0.2, level="sequence")


def test_overlong_penalty_and_varied_groups_by_hand():
    lengths = torch.tensor([10, 12, 13, 15, 16])
    # max 16, buffer 4: 0 up to 12, then (12 - L) / 4
    assert grpo_loss.overlong_penalty(lengths, 16, 4, factor=2.0).tolist() == [0.0, 0.0, -0.5, -1.5, -2.0]
    with pytest.raises(ValueError, match="buffer must be in 1..max_completion_length=16"):
        grpo_loss.overlong_penalty(lengths, 16, 0)
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 2.0, 2.0])
    assert grpo_loss.varied_groups(rewards, 2).tolist() == [False, True, False]


def rollout_of(rewards: list[float], tag: int) -> Rollout:
    """Completions named by (tag, index) so that where each came from shows."""
    n = len(rewards)
    return Rollout([[tag]] * n, [[tag, i] for i in range(n)], torch.tensor(rewards, dtype=torch.float64),
                   {"f": torch.tensor(rewards, dtype=torch.float64)}, [[0.0, 0.0]] * n,
                   truncated=[False] * n)


def test_dynamic_sampling_keeps_varied_groups_and_refills():
    first = rollout_of([1, 1, 0, 1, 2, 2], tag=0)  # groups of 2: equal, varied, equal
    extra = {1: rollout_of([3, 3, 3, 3, 3, 3], tag=1), 2: rollout_of([0, 1, 5, 5, 1, 0], tag=2)}
    asked = []

    def more(round_):
        asked.append(round_)
        return extra[round_]

    got, stats = fill_with_varied_groups(first, more, 2, max_rounds=4, any_rank_short=lambda short: short)
    assert asked == [1, 2]
    assert got.completion_ids == [[0, 2], [0, 3], [2, 0], [2, 1], [2, 4]][:3] + [] or True
    # varied groups in the order found: first's (2, 3), round 2's (0, 1) and (4, 5)
    assert got.completion_ids == [[0, 2], [0, 3], [2, 0], [2, 1], [2, 4], [2, 5]]
    assert got.rewards.tolist() == [0, 1, 0, 1, 1, 0] and got.per_function["f"].tolist() == [0, 1, 0, 1, 1, 0]
    assert stats == {"dynamic_sampling_rounds": 3.0, "groups_varied": 3 / 9, "groups_equal_trained": 0.0}
    # out of rounds: groups of equal rewards fill the batch
    got, stats = fill_with_varied_groups(first, more, 2, max_rounds=2, any_rank_short=lambda short: short)
    assert got.completion_ids == [[0, 2], [0, 3], [0, 0], [0, 1], [0, 4], [0, 5]]
    assert stats["groups_equal_trained"] == 2.0 and stats["dynamic_sampling_rounds"] == 2.0
    # another rank still short: this one generates too, and keeps its own first groups
    got, stats = fill_with_varied_groups(rollout_of([0, 1, 1, 0, 2, 3], 0), lambda r: extra[r], 2,
                                         max_rounds=2, any_rank_short=lambda short: True)
    assert stats["dynamic_sampling_rounds"] == 2.0 and got.completion_ids[0] == [0, 0]


def test_overlong_shaping_in_rewards_and_rows():
    module = GRPOModule(TOKENIZER, num_generations=2, max_completion_length=8, reward_funcs=[lambda p, c, **_: [1.0] * len(c)],
                        model_overrides={"seq_length": 64}, overlong=OverlongShaping("penalty", buffer=4, factor=1.0))
    scored = module.score_rollout([[1, 2]] * 2, [[5] * 3, [5] * 6], ["p", "p"], ["a", "b"], {})
    assert scored.rewards.tolist() == [1.0, 1.0 - 0.5]  # 6 tokens: (8 - 4 - 6) / 4
    assert scored.per_function["overlong"].tolist() == [0.0, -0.5]
    module = GRPOModule(TOKENIZER, num_generations=2, max_completion_length=8, model_overrides={"seq_length": 64},
                        overlong=OverlongShaping("filter"))
    rollout = Rollout([[1, 2, 3]] * 2, [[5] * 8, [5] * 3], torch.tensor([1.0, 0.0]), truncated=[True, False])
    rows = module.rollout_rows(rollout)
    assert rows["loss_mask"].sum(-1).tolist() == [0.0, 3.0]  # the cut completion carries no loss
    assert rows["advantages"].tolist() != [0.0, 0.0]  # its reward still counts in the group
    with pytest.raises(ValueError, match="overlong.buffer must be an int > 0"):
        OverlongShaping("penalty")
    with pytest.raises(ValueError, match="importance_level must be one of"):
        GRPOModule(TOKENIZER, importance_level="group")
    with pytest.raises(ValueError, match="max_rounds must be an int >= 1"):
        DynamicSampling(max_rounds=0)


def parity_reward(prompts, completions, n, **_):
    """Prompts with an even number: 1 for every completion (a group of equal rewards); odd: the
    parity of the completion's character codes (varied, mostly)."""
    return [1.0 if int(k) % 2 == 0 else float(sum(map(ord, c)) % 2) for k, c in zip(n, completions)]


class Trained(GRPOModule):
    def train_on_rollout(self, rollout):
        if rollout.steps == 0:
            groups = rollout.rewards.reshape(-1, self.num_generations)
            self.seen = {"varied": bool((groups != groups[:, :1]).any(-1).all()),
                         "routing": len(rollout.routing), "rows": len(rollout.prompt_ids)}
        return super().train_on_rollout(rollout)


class Metrics(L.Callback):
    def __init__(self, out):
        self.out = out

    def on_train_batch_end(self, trainer, pl_module, *args):
        got = {k: float(v) for k, v in trainer.callback_metrics.items()}
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps({"metrics": got, **pl_module.seen}))


@pytest.mark.distributed
def test_dynamic_sampling_at_ep2_trains_on_varied_groups(tmp_path):
    from lightning_mcore.data import PromptDataModule

    source = tmp_path / "qwen3_moe"
    make_hf_model("qwen3_moe", source, num_hidden_layers=2, vocab_size=512)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Say {n}.", "n": n}) + "\n" for n in range(8)))
    trainer = L.Trainer(
        accelerator="cpu", devices=2, max_steps=1, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, callbacks=[Metrics(tmp_path)],
        strategy=MegatronStrategy(expert_model_parallel_size=2, global_batch_size=4 * G, micro_batch_size=G,
                                  start_method="fork"),
    )
    module = Trained(str(source), OptimizerSettings(lr=1e-3), model_overrides={"seq_length": 64},
                     num_generations=G, max_completion_length=6, sampling=GRPOSampling(seed=5),
                     reward_funcs=[parity_reward], dynamic_sampling=DynamicSampling(max_rounds=8))
    # unshuffled, the ranks' first batches hold prompts 0-3: groups of equal rewards to replace
    data = PromptDataModule(str(prompts), TOKENIZER, 48, chat_template="chatml", shuffle=False)
    trainer.fit(module, data)
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for rank in got:
        assert rank["varied"] and rank["rows"] == 2 * G and rank["routing"] == 2 * G, rank
        metrics = rank["metrics"]
        assert metrics["train/groups_equal_trained"] == 0.0, metrics
        assert metrics["train/dynamic_sampling_rounds"] >= 2 and metrics["train/groups_varied"] < 1, metrics
    assert got[0]["metrics"]["train/dynamic_sampling_rounds"] == got[1]["metrics"]["train/dynamic_sampling_rounds"]
