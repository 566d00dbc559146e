"""Acceptance (DPO/IPO): loss log 2 at step 0; loss and metrics equal the formula computed from
transformers' logits; TP=2 (+SP) and PP=2 equal TP=1; the reference is the LoRA base or a frozen
copy."""

import json
import math

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM

from hf_models import make_hf_model
from lightning_mcore import MegatronStrategy, OptimizerSettings
from lightning_mcore.data.packing import build_row
from lightning_mcore.lora.config import LoRAConfig
from lightning_mcore.objectives.dpo import METRICS, DPOModule
from toy import fit, tiny_config

SEQ = 48


def pairs(n: int, vocab: int, seed: int = 0):
    """Rows of (prompt + chosen | prompt + rejected) with random tokens; loss on responses."""
    gen = torch.Generator().manual_seed(seed)
    rows, raw = [], []
    for _ in range(n):
        p = int(torch.randint(4, 10, (1,), generator=gen))
        prompt = torch.randint(0, vocab, (p,), generator=gen).tolist()
        samples = []
        for _ in range(2):
            r = int(torch.randint(3, 12, (1,), generator=gen))
            reply = torch.randint(0, vocab, (r,), generator=gen).tolist()
            samples.append((prompt + reply, [0] * p + [1] * r))
        raw.append(samples)
        rows.append(build_row(samples, SEQ, pad_id=0))
    return rows, raw


class RecordMetrics(L.Callback):
    def __init__(self, out, export_at=None) -> None:
        self.out, self.export_at, self.rows = out, export_at, []

    def on_train_batch_end(self, trainer, pl_module, *args):
        self.rows.append({k: float(trainer.callback_metrics[f"train/{k}"]) for k in METRICS})
        if trainer.global_step == self.export_at:
            pl_module.save_hf_checkpoint(self.out.parent / "policy", mode="merged")

    def on_train_end(self, trainer, pl_module):
        if trainer.global_rank == 0:
            self.out.write_text(json.dumps(self.rows))


def hf_pair_logps(model, raw) -> torch.Tensor:
    """Independent: each sequence alone through transformers, sum of response log-probs."""
    out = []
    with torch.no_grad():
        for samples in raw:
            row = []
            for ids, mask in samples:
                logits = model(input_ids=torch.tensor([ids])).logits[0].float()
                logp = torch.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
                row.append(float((logp * torch.tensor(mask[1:], dtype=torch.float)).sum()))
            out.append(row)
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.distributed
@pytest.mark.parametrize("family,parallel", [
    ("llama", {}), ("qwen3_5", dict(sequence_parallel=True)),
    ("glm4_moe", dict(sequence_parallel=True)),
    ("gpt_oss", dict(sequence_parallel=True, expert_tensor_parallel_size=1)),
], ids=["llama", "qwen3_5", "glm4_moe", "gpt_oss"])
def test_dpo_step0_is_log2_and_metrics_match_transformers(family, parallel, tmp_path):
    """Also for a Gated DeltaNet hybrid (packed pairs through its linear attention; TP needs SP)
    and two 2026 MoE families (GPT-OSS: sinks, windows, biased experts at expert-TP 1)."""
    source = tmp_path / "source"
    make_hf_model(family, source)
    rows, raw = pairs(8, 200)
    beta = 0.5
    trainer = L.Trainer(
        accelerator="cpu", devices=2, max_steps=2, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False,
        callbacks=[RecordMetrics(tmp_path / "metrics.json", export_at=1)],
        strategy=MegatronStrategy(tensor_model_parallel_size=2, global_batch_size=8, micro_batch_size=2,
                                  start_method="fork", **parallel),
    )
    module = DPOModule(str(source), OptimizerSettings(lr=5e-2, warmup_steps=0),
                       lora=LoRAConfig(rank=4, alpha=8.0), beta=beta)
    trainer.fit(module, DataLoader(rows, batch_size=8))
    step0, step1 = json.loads((tmp_path / "metrics.json").read_text())

    assert abs(step0["loss"] - math.log(2)) <= 1e-6
    for key in ("rewards/chosen", "rewards/rejected", "rewards/margins"):
        assert abs(step0[key]) <= 1e-6, (key, step0[key])

    reference = hf_pair_logps(AutoModelForCausalLM.from_pretrained(source).eval(), raw)
    policy = hf_pair_logps(AutoModelForCausalLM.from_pretrained(tmp_path / "policy").eval(), raw)
    chosen, rejected = beta * (policy[:, 0] - reference[:, 0]), beta * (policy[:, 1] - reference[:, 1])
    expected = {
        "loss": float(-torch.nn.functional.logsigmoid(chosen - rejected).mean()),
        "rewards/chosen": float(chosen.mean()), "rewards/rejected": float(rejected.mean()),
        "rewards/accuracies": float((chosen > rejected).double().mean()),
        "rewards/margins": float((chosen - rejected).mean()),
        "logps/chosen": float(policy[:, 0].mean()), "logps/rejected": float(policy[:, 1].mean()),
    }
    assert abs(step1["loss"] - math.log(2)) > 1e-3, "the first step changed nothing"
    for key, want in expected.items():
        assert abs(step1[key] - want) <= 1e-5 * max(1.0, abs(want)), (key, step1[key], want)


@pytest.mark.distributed
def test_dpo_layouts_agree(tmp_path):
    """LoRA reference (adapters off) and frozen-copy reference, each at TP=1, TP=2+SP, PP=2.
    SGD, so that equal losses mean equal gradients (Adam's first steps move coordinates whose
    gradient is fp32 noise by a full lr)."""
    rows, _ = pairs(8, 500, seed=1)
    optim = OptimizerSettings(lr=0.5, optimizer="sgd", clip_grad=0.0, weight_decay=0.0, warmup_steps=0)
    config = tiny_config(seq_length=SEQ)
    for reference, kwargs in (("lora", {"lora": LoRAConfig(rank=4, alpha=8.0), "beta": 0.5}),
                              ("frozen", {"beta": 0.5, "loss_type": "ipo"})):
        runs = {}
        for name, devices, parallel in (
            ("tp1", 1, {}), ("tp2_sp", 2, dict(tensor_model_parallel_size=2, sequence_parallel=True)),
            ("pp2", 2, dict(pipeline_model_parallel_size=2)),
        ):
            runs[name] = fit(tmp_path, devices=devices, steps=3, optim=optim, config=config, dataset=rows,
                             module_cls=DPOModule, module_kwargs=kwargs, name=f"{reference}-{name}", **parallel)
        assert runs["tp1"][-1] < runs["tp1"][0], (reference, runs["tp1"])
        for name in ("tp2_sp", "pp2"):
            for got, want in zip(runs[name], runs["tp1"]):
                assert abs(got - want) <= 1e-5 * max(1.0, abs(want)), (reference, name, runs[name], runs["tp1"])


@pytest.mark.distributed
def test_dpo_learns_the_toy_preferences(tmp_path):
    """12 steps on the bundled pairs (polite correct answers preferred to rude wrong ones): every
    pair is ranked right from about the third step on."""
    from pathlib import Path

    from lightning_mcore.data import DPODataModule

    root = Path(__file__).parents[1]
    out = tmp_path / "metrics.json"
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=12, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, callbacks=[RecordMetrics(out)],
        strategy=MegatronStrategy(global_batch_size=8, micro_batch_size=4, start_method="fork"),
    )
    config = tiny_config(num_layers=2, hidden_size=128, ffn_hidden_size=352, vocab_size=512, seq_length=256)
    module = DPOModule(config, OptimizerSettings(lr=1e-2, warmup_steps=2, min_lr=1e-3),
                       lora=LoRAConfig(rank=8, alpha=16.0), beta=0.1)
    data = DPODataModule(str(root / "configs/sample_data/dpo.jsonl"), str(root / "configs/sample_data/tokenizer"),
                         256, chat_template="chatml", cache_dir=str(tmp_path / "cache"))
    trainer.fit(module, data)
    rows = json.loads(out.read_text())
    assert rows[0]["rewards/accuracies"] == 0.0 and abs(rows[0]["loss"] - math.log(2)) <= 1e-6
    assert rows[-1]["rewards/accuracies"] > 0.9, [r["rewards/accuracies"] for r in rows]
    assert rows[-1]["rewards/margins"] > 0
