"""Acceptance (issue 46, parts 2 and 3): GRPO on a Qwen3-MoE at EP=2 (and at TP=2+SP and PP=2,
and a DeepSeek-V3 at PP=2), fp32 on CPU, generating its own rollouts. Generation keeps each
sampled token's log-prob and every MoE layer's experts;

- with routing replay (R3) the training forward's per-token log-probs equal the rollout's
  (1e-6), and replaying other experts changes them (the replay is what decides);
- with replay off and the same weights, the logged mismatch is nil: no (token, layer) pair routed
  elsewhere, log-probs within 1e-6 (the recorded experts sit at the right tokens);
- with the rollout sampled by routers a little off (as by another precision), replay off logs
  the mismatch (pairs routed elsewhere, a log-prob gap), and replay brings the gap down;
- truncated importance sampling and the mismatch formulas against a hand computation."""

import json
import math
from pathlib import Path

import lightning as L
import pytest
import torch

from hf_models import make_hf_model
from lightning_mcore import GRPOModule, GRPOSampling, MegatronStrategy, OptimizerSettings, RolloutCorrection
from lightning_mcore.model import routing_replay
from lightning_mcore.objectives import grpo_loss

ROOT = Path(__file__).parents[1]
TOKENIZER = str(ROOT / "configs/sample_data/tiny-llama")
G = 4


class Probed(GRPOModule):
    """GRPO whose rollouts may come from routers nudged by `nudge` (std of noise added to their
    weights while generating); before its first step on a rollout it measures, per completion
    token, |training log-prob - rollout log-prob| with replay off, with R3, and with R3 of other
    experts."""

    def __init__(self, *args, nudge: float = 0.0, out: Path, **kwargs):
        super().__init__(*args, **kwargs)
        self.nudge, self.out = nudge, out

    def make_rollout(self, batch):
        routers = routing_replay.moe_routers(self.chunks)
        saved = [r.weight.detach().clone() for r in routers]
        gen = torch.Generator().manual_seed(11)  # the same noise on every rank
        with torch.no_grad():
            for r in routers:
                r.weight.add_(torch.randn(r.weight.shape, generator=gen) * self.nudge)
        try:
            return super().make_rollout(batch)
        finally:
            with torch.no_grad():
                for r, w in zip(routers, saved):
                    r.weight.copy_(w)

    def train_on_rollout(self, rollout):
        if rollout.steps == 0:
            batch = self.rollout_rows(rollout)
            mask = batch["loss_mask"].bool()
            experts = self.model_config.num_moe_experts
            chosen = self.correction
            gaps = {}
            for name, replay, routing in (("off", "off", batch["routing"]), ("r3", "r3", batch["routing"]),
                                          ("r3_other", "r3", (batch["routing"] + 1) % experts)):
                self.correction = RolloutCorrection(routing_replay=replay)
                logps = self._token_logps({**batch, "routing": routing}, reference=False)
                gaps[name] = float((logps - batch["rollout_logps"])[mask].abs().max())
            self.correction = chosen
            gaps["tokens"] = int(mask.sum())
            gaps["routing_shape"] = list(batch["routing"].shape)
            self.gaps = gaps
        return super().train_on_rollout(rollout)


class Metrics(L.Callback):
    def on_train_batch_end(self, trainer, pl_module, *args):
        if trainer.global_rank == 0:
            got = {k: float(v) for k, v in trainer.callback_metrics.items()}
            pl_module.out.write_text(json.dumps({"metrics": got, "gaps": pl_module.gaps}))


def run(tmp_path, name: str, nudge: float, replay: str = "off", family: str = "qwen3_moe", **parallel) -> dict:
    from lightning_mcore.data import PromptDataModule

    source = tmp_path / family
    if not source.exists():
        make_hf_model(family, source, num_hidden_layers=2, vocab_size=512)
    out = tmp_path / f"{name}.json"
    trainer = L.Trainer(
        accelerator="cpu", devices=2, max_steps=1, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, callbacks=[Metrics()],
        strategy=MegatronStrategy(**(parallel or dict(expert_model_parallel_size=2)),
                                  global_batch_size=(1 if parallel else 2) * G, micro_batch_size=G,
                                  start_method="fork"),
    )
    module = Probed(str(source), OptimizerSettings(lr=1e-3), model_overrides={"seq_length": 64},
                    num_generations=G, max_completion_length=8, sampling=GRPOSampling(seed=3),
                    correction=RolloutCorrection(routing_replay=replay), nudge=nudge, out=out)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Say {n}.", "answer": str(n)}) + "\n" for n in range(2)))
    data = PromptDataModule(str(prompts), TOKENIZER, 48, chat_template="chatml", shuffle=False)
    trainer.fit(module, data)
    return json.loads(out.read_text())


@pytest.mark.distributed
def test_routing_replay_makes_training_log_probs_those_of_the_rollout(tmp_path):
    same = run(tmp_path, "same", nudge=0.0)
    gaps, metrics = same["gaps"], same["metrics"]
    assert gaps["tokens"] > 10 and gaps["routing_shape"][2:] == [2, 2], gaps  # 2 MoE layers, top-2
    assert gaps["r3"] <= 1e-6 and gaps["off"] <= 1e-6, gaps
    assert gaps["r3_other"] > 1e-2, gaps  # the replayed experts are the ones used
    assert metrics["train/routing_mismatch"] == 0.0, metrics
    assert metrics["train/rollout_logp_diff"] <= 1e-6 and abs(metrics["train/rollout_kl"]) <= 1e-6, metrics

    nudged = run(tmp_path, "nudged", nudge=0.01)
    gaps, metrics = nudged["gaps"], nudged["metrics"]
    assert 0.0 < metrics["train/routing_mismatch"] < 1.0, metrics
    assert metrics["train/rollout_logp_diff"] > 1e-4 and metrics["train/rollout_kl"] > 0, metrics
    assert gaps["r3"] < gaps["off"], gaps  # replay removes the part of the gap that routing made

    replayed = run(tmp_path, "replayed", nudge=0.01, replay="r3")
    assert "train/routing_mismatch" not in replayed["metrics"]  # nothing to count under replay
    assert replayed["metrics"]["train/rollout_logp_diff"] < metrics["train/rollout_logp_diff"]


def test_truncated_importance_weights_and_mismatch_by_hand():
    old = torch.tensor([[-1.0, -2.0, -0.5, -3.0]])
    rollout = torch.tensor([[-1.5, -1.0, -0.5, -3.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    weights = grpo_loss.tis_weights(old, rollout, cap=1.5)
    # exp(0.5) = 1.65 capped at 1.5, exp(-1) = 0.37, exp(0) = 1
    assert torch.allclose(weights, torch.tensor([[1.5, math.exp(-1.0), 1.0, 1.0]]))
    got = grpo_loss.rollout_mismatch(old, rollout, mask)
    assert got["rollout_logp_diff"][0].item() == pytest.approx(0.5 + 1.0 + 0.0)
    assert got["rollout_logp_diff"][1].item() == 3
    k3 = (math.exp(0.5) - 0.5 - 1) + (math.exp(-1.0) + 1.0 - 1)
    assert got["rollout_kl"][0].item() == pytest.approx(k3)
    # the weights scale the policy term of each token, not the KL
    logp, adv, ref = old.clone(), torch.tensor([2.0]), torch.tensor([[-1.0, -1.0, -1.0, -1.0]])
    plain = grpo_loss.token_terms(logp, old, adv, 0.2, 0.2, beta=0.1, ref_logp=ref)
    weighted = grpo_loss.token_terms(logp, old, adv, 0.2, 0.2, beta=0.1, ref_logp=ref, weights=weights)
    assert torch.allclose(weighted.loss - 0.1 * weighted.kl, (plain.loss - 0.1 * plain.kl) * weights)
    assert torch.allclose(plain.loss - 0.1 * plain.kl, torch.full_like(logp, -2.0))  # ratio 1: -A


def test_correction_settings_are_checked():
    with pytest.raises(ValueError, match="routing_replay must be 'off' or 'r3'"):
        RolloutCorrection(routing_replay="yes")
    with pytest.raises(ValueError, match="tis_cap must be >= 0"):
        RolloutCorrection(tis_cap=-1.0)
    with pytest.raises(ValueError, match="this model has none: use routing_replay: off"):
        GRPOModule(TOKENIZER, correction=RolloutCorrection(routing_replay="r3"))


@pytest.mark.distributed
@pytest.mark.parametrize("family, parallel, layers", [
    ("qwen3_moe", dict(tensor_model_parallel_size=2, sequence_parallel=True), 2),
    ("qwen3_moe", dict(pipeline_model_parallel_size=2), 1),
    ("deepseek_v3", dict(pipeline_model_parallel_size=2), 0),
], ids=["tp2_sp", "pp2", "deepseek_pp2"])
def test_routing_replay_at_other_layouts(family, parallel, layers, tmp_path):
    """TP=2+SP: generation runs with SP switched off (each rank routes all tokens), training with
    it on (each rank routes its half of the packed row): replay gives each rank its half. PP=2:
    each stage records and replays its own MoE layers; a DeepSeek-V3's first stage has none (its
    first layer is dense: `layers` is what rank 0 holds)."""
    got = run(tmp_path, "layout", nudge=0.0, family=family, **parallel)
    gaps, metrics = got["gaps"], got["metrics"]
    # other experts replayed move the log-probs far past float noise (DeepSeek: one MoE layer of
    # four experts beside a shared one, 2e-4; the Qwen3-MoE, 3e-2)
    assert gaps["r3"] <= 1e-6 and gaps["off"] <= 1e-6 and gaps["r3_other"] > 1e-4, gaps
    assert gaps["routing_shape"][2] == layers, gaps
    assert metrics["train/routing_mismatch"] == 0.0, metrics
