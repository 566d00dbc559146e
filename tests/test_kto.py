"""Acceptance (issue 23, KTO): loss and metrics equal trl's formula computed from transformers'
logits (z0 over the whole global batch at DP=2); TP=2 (+SP) and PP=2 equal TP=1; rewards of
desirable and undesirable examples separate on the bundled data; rows pair each prompt with the
next example's completion; data without labels is refused before any worker starts."""

import json
from pathlib import Path

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_models import make_hf_model
from lightning_mcore import KTOModule, MegatronStrategy, OptimizerSettings
from lightning_mcore.cli import main
from lightning_mcore.data import KTODataModule
from lightning_mcore.data.packing import build_row
from lightning_mcore.lora.config import LoRAConfig
from lightning_mcore.objectives.kto import METRICS
from toy import fit, tiny_config

ROOT = Path(__file__).parents[1]
SAMPLES = ROOT / "configs" / "sample_data"
SEQ = 48
LABELS = [True, False, True, True, False, False, True, False]


def examples(vocab: int, seed: int = 0):
    """Rows of (prompt + completion | prompt + next example's completion) with random tokens and
    a label each; `raw` keeps the (ids, mask) of both sequences for the hand computation."""
    gen = torch.Generator().manual_seed(seed)
    prompts, completions = [], []

    def tokens(low, high):
        return torch.randint(0, vocab, (int(torch.randint(low, high, (1,), generator=gen)),), generator=gen).tolist()

    for _ in LABELS:
        prompts.append(tokens(4, 10))
        completions.append(tokens(3, 12))
    rows, raw = [], []
    for i, (prompt, label) in enumerate(zip(prompts, LABELS)):
        samples = [(prompt + c, [0] * len(prompt) + [1] * len(c))
                   for c in (completions[i], completions[(i + 1) % len(LABELS)])]
        raw.append(samples)
        rows.append({**build_row(samples, SEQ, pad_id=0), "label": torch.tensor(float(label))})
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


def hf_logps(model, raw) -> torch.Tensor:
    """Independent: each sequence alone through transformers; [rows, 2] summed completion
    log-probs (own completion, mismatched completion)."""
    out = []
    with torch.no_grad():
        for samples in raw:
            row = []
            for ids, mask in samples:
                logits = model(input_ids=torch.tensor([ids])).logits[0].double()
                logp = torch.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
                row.append(float((logp * torch.tensor(mask[1:], dtype=torch.float64)).sum()))
            out.append(row)
    return torch.tensor(out, dtype=torch.float64)


def trl_kto(policy, reference, desirable, beta, dw, uw) -> dict:
    """trl's KTOTrainer "kto" loss and logged metrics, written out by hand."""
    kl = max(0.0, float((policy[:, 1] - reference[:, 1]).mean()))
    logratio = policy[:, 0] - reference[:, 0]
    chosen, rejected = logratio[desirable], logratio[~desirable]
    losses = torch.cat([dw * (1 - torch.sigmoid(beta * (chosen - kl))),
                        uw * (1 - torch.sigmoid(beta * (kl - rejected)))])
    return {"loss": float(losses.mean()), "kl": kl,
            "rewards/chosen": float(beta * chosen.mean()), "rewards/rejected": float(beta * rejected.mean()),
            "logps/chosen": float(policy[desirable, 0].mean()), "logps/rejected": float(policy[~desirable, 0].mean())}


@pytest.mark.distributed
def test_kto_loss_and_metrics_match_transformers(tmp_path):
    """DP=2 (4 rows per rank, 2 microbatches each): z0 must be the mean over all 8 rows."""
    source = tmp_path / "source"
    make_hf_model("llama", source)
    rows, raw = examples(200)
    beta, dw, uw = 0.5, 1.0, 1.5
    trainer = L.Trainer(
        accelerator="cpu", devices=2, max_steps=2, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False,
        callbacks=[RecordMetrics(tmp_path / "metrics.json", export_at=1)],
        strategy=MegatronStrategy(global_batch_size=8, micro_batch_size=2, start_method="fork"),
    )
    module = KTOModule(str(source), OptimizerSettings(lr=5e-2, warmup_steps=0), lora=LoRAConfig(rank=4, alpha=8.0),
                       beta=beta, desirable_weight=dw, undesirable_weight=uw)
    trainer.fit(module, DataLoader(rows, batch_size=4))
    step0, step1 = json.loads((tmp_path / "metrics.json").read_text())

    desirable = torch.tensor(LABELS)
    # Step 0: the policy is the reference (LoRA's B = 0): every log-ratio and z0 are 0.
    assert abs(step0["loss"] - 0.5 * (dw * desirable.sum() + uw * (~desirable).sum()) / len(LABELS)) <= 1e-6
    for key in ("kl", "rewards/chosen", "rewards/rejected"):
        assert abs(step0[key]) <= 1e-6, (key, step0[key])

    reference = hf_logps(AutoModelForCausalLM.from_pretrained(source).eval(), raw)
    policy = hf_logps(AutoModelForCausalLM.from_pretrained(tmp_path / "policy").eval(), raw)
    expected = trl_kto(policy, reference, desirable, beta, dw, uw)
    # The step moved the mismatched completions' log-probs up on average, so z0 is not clamped
    # away and its global mean is what the loss saw.
    assert expected["kl"] > 1e-3, expected
    assert abs(step1["loss"] - step0["loss"]) > 1e-3, "the first step changed nothing"
    for key, want in expected.items():
        assert abs(step1[key] - want) <= 1e-5 * max(1.0, abs(want)), (key, step1[key], want)


@pytest.mark.distributed
def test_kto_layouts_agree(tmp_path):
    """Frozen-copy reference at TP=1, TP=2+SP, PP=2; SGD, so equal losses mean equal gradients."""
    rows, _ = examples(500, seed=1)
    optim = OptimizerSettings(lr=0.5, optimizer="sgd", clip_grad=0.0, weight_decay=0.0, warmup_steps=0)
    kwargs = {"beta": 0.5, "desirable_weight": 1.0, "undesirable_weight": 1.5}
    runs = {}
    for name, devices, parallel in (
        ("tp1", 1, {}), ("tp2_sp", 2, dict(tensor_model_parallel_size=2, sequence_parallel=True)),
        ("pp2", 2, dict(pipeline_model_parallel_size=2)),
    ):
        runs[name] = fit(tmp_path, devices=devices, steps=3, optim=optim, config=tiny_config(seq_length=SEQ),
                         dataset=rows, module_cls=KTOModule, module_kwargs=kwargs, name=name, **parallel)
    assert runs["tp1"][-1] < runs["tp1"][0], runs["tp1"]
    for name in ("tp2_sp", "pp2"):
        for got, want in zip(runs[name], runs["tp1"]):
            assert abs(got - want) <= 1e-5 * max(1.0, abs(want)), (name, runs[name], runs["tp1"])


class RewardsByFileLabel(L.Callback):
    """After training: beta * (policy - base) summed log-probs of every example's own completion
    (from the model's logits, adapters on and off), averaged per label as the jsonl file gives it,
    so a label mixed up on its way to the loss shows."""

    def __init__(self, out, beta) -> None:
        self.out, self.beta = out, beta

    def on_train_end(self, trainer, pl_module):
        from lightning_mcore.lora.adapters import adapters_disabled

        rows = trainer.datamodule.train_dataset
        keys = ("tokens", "labels", "loss_mask", "segment_ids")
        batch = {k: torch.stack([rows[i][k] for i in range(len(rows))]) for k in keys}
        mask = batch["loss_mask"] * (batch["segment_ids"] == 1)  # segment 1 attends only to itself

        def logps():
            logits = pl_module.forward_logits(batch["tokens"]).double()
            return (torch.log_softmax(logits, -1).gather(-1, batch["labels"][..., None])[..., 0] * mask).sum(-1)

        with torch.no_grad():
            policy = logps()
            with adapters_disabled(list(pl_module.chunks)):
                base = logps()
        records = [json.loads(line) for line in (SAMPLES / "kto.jsonl").read_text().splitlines()]
        good = torch.tensor([r["label"] for r in records])
        rewards = self.beta * (policy - base)
        if trainer.global_rank == 0:
            self.out.write_text(json.dumps({"desirable": float(rewards[good].mean()),
                                            "undesirable": float(rewards[~good].mean())}))


@pytest.mark.distributed
def test_kto_rewards_separate_on_the_toy_data(tmp_path):
    """The bundled examples: polite correct answers desirable, rude wrong ones undesirable."""
    out, by_file = tmp_path / "metrics.json", tmp_path / "by_file.json"
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=14, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False,
        callbacks=[RecordMetrics(out), RewardsByFileLabel(by_file, beta=0.1)],
        strategy=MegatronStrategy(global_batch_size=8, micro_batch_size=4, start_method="fork"),
    )
    config = tiny_config(num_layers=2, hidden_size=128, ffn_hidden_size=352, vocab_size=512, seq_length=256)
    module = KTOModule(config, OptimizerSettings(lr=1e-2, warmup_steps=2, min_lr=1e-3),
                       lora=LoRAConfig(rank=8, alpha=16.0), beta=0.1)
    data = KTODataModule(str(SAMPLES / "kto.jsonl"), str(SAMPLES / "tokenizer"), 256,
                         chat_template="chatml", shuffle=True, cache_dir=str(tmp_path / "cache"))
    trainer.fit(module, data)
    rows = json.loads(out.read_text())
    assert rows[0]["rewards/chosen"] == 0.0 and rows[0]["rewards/rejected"] == 0.0
    last = rows[-3:]
    gap = [r["rewards/chosen"] - r["rewards/rejected"] for r in last]
    assert min(gap) > 1.0, [(r["rewards/chosen"], r["rewards/rejected"]) for r in rows]
    assert sum(r["loss"] for r in last) / 3 < rows[0]["loss"] - 0.1, [r["loss"] for r in rows]
    rewards = json.loads(by_file.read_text())
    assert rewards["desirable"] > 0 > rewards["undesirable"] and rewards["desirable"] - rewards["undesirable"] > 1.0, rewards


# ---------------------------------------------------------------------- data
def test_rows_pair_each_prompt_with_the_next_completion(tmp_path):
    records = [json.loads(line) for line in (SAMPLES / "kto.jsonl").read_text().splitlines()]
    data = KTODataModule(str(SAMPLES / "kto.jsonl"), str(SAMPLES / "tokenizer"), 256, chat_template="chatml",
                         shuffle=False, cache_dir=str(tmp_path / "cache"))
    data.setup("fit")
    tok = AutoTokenizer.from_pretrained(SAMPLES / "tokenizer")
    assert len(data.train_dataset) == len(records) and data.stats["train"]["desirable"] == 24
    for i in (0, 23, len(records) - 1):
        row = data.train_dataset[i]
        assert float(row["label"]) == float(records[i]["label"])
        for segment, j in ((1, i), (2, (i + 1) % len(records))):
            at = row["segment_ids"] == segment
            assert tok.decode(row["tokens"][at]).startswith(f"<|im_start|>user\n{records[i]['prompt']}<|im_end|>")
            target = tok.decode(row["labels"][at & (row["loss_mask"] > 0)])
            assert target == records[j]["completion"] + "<|im_end|>\n", (i, segment, target)


@pytest.fixture
def no_fit(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a refused run must not reach Trainer.fit")

    monkeypatch.setattr(L.Trainer, "fit", refuse)
    monkeypatch.chdir(ROOT)


def refused(capsys, *args) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", "configs/kto.yaml", *args])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err[-3000:]
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, err
    return lines[0]


def write_jsonl(path: Path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def test_data_without_labels_is_refused_before_workers(capsys, tmp_path, no_fit):
    records = [json.loads(line) for line in (SAMPLES / "kto.jsonl").read_text().splitlines()]
    path = write_jsonl(tmp_path / "unlabelled.jsonl", [{k: r[k] for k in ("prompt", "completion")} for r in records])
    line = refused(capsys, "--data.init_args.paths", path)
    assert path in line and "column 'label'" in line and "columns found: ['prompt', 'completion']" in line


def test_labels_that_are_not_booleans_are_refused(capsys, tmp_path, no_fit):
    records = [json.loads(line) for line in (SAMPLES / "kto.jsonl").read_text().splitlines()]
    records[3]["label"] = "yes"
    path = write_jsonl(tmp_path / "strings.jsonl", records)
    line = refused(capsys, "--data.init_args.paths", path)
    assert path in line and "sample 3" in line and "'label' must be true" in line and "'yes'" in line


@pytest.mark.parametrize("option", ["beta", "desirable_weight", "undesirable_weight"])
def test_options_are_validated(option):
    with pytest.raises(ValueError, match=option):
        KTOModule(tiny_config(), **{option: 0.0})


def test_batches_without_labels_are_refused():
    """A preference-pair batch (DPODataModule) fed to KTOModule names what is missing."""
    row = build_row([([1, 2, 3], [0, 1, 1]), ([1, 2, 4], [0, 1, 1])], 8, pad_id=0)
    with pytest.raises(ValueError, match="'label'.*KTODataModule"):
        KTOModule(tiny_config())._with_reference({k: v[None] for k, v in row.items()})
