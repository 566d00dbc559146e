"""Acceptance (reward models): loss and metrics equal the Bradley-Terry formula on transformers'
own `AutoModelForSequenceClassification` scores, before and after a step; exports load there
with our scores; TP=2 (+SP) and PP=2 equal TP=1; the bundled pairs are learnt; an unsupported
family is refused before any worker starts."""

import json
from pathlib import Path

import lightning as L
import pytest
import torch
import transformers as tf
from torch.utils.data import DataLoader

from hf_models import COMMON, FAMILIES
from lightning_mcore import MegatronStrategy, OptimizerSettings
from lightning_mcore.data.packing import build_row
from lightning_mcore.objectives.reward import METRICS, RewardModule
from toy import fit, tiny_config

ROOT = Path(__file__).parents[1]
SEQ = 48
PAD = 0  # pad_token_id of the tiny models; never inside a sequence


def make_seq_cls(name: str, directory: Path, seed: int = 0, **overrides):
    """A tiny random `...ForSequenceClassification` (num_labels=1) of family `name`, saved."""
    config_cls, _, extra = FAMILIES[name]()
    torch.manual_seed(seed)
    config = config_cls(**{**COMMON, **extra, **overrides}, num_labels=1, pad_token_id=PAD)
    model = tf.AutoModelForSequenceClassification.from_config(config).eval()
    with torch.no_grad():  # non-trivial norms and a score head that separates sequences
        for n, p in model.named_parameters():
            if p.dim() == 1:
                p.normal_(1.0 if "norm" in n else 0.0, 0.1)
        model.score.weight.normal_(0.0, 0.5)
    model.save_pretrained(directory)
    return model


def pairs(n: int, vocab: int, seed: int = 0, margins: bool = False):
    """Rows of (prompt + chosen | prompt + rejected) of random tokens (1..vocab-1), the raw
    token lists, and per-pair margins."""
    gen = torch.Generator().manual_seed(seed)
    rows, raw = [], []
    for i in range(n):
        prompt = torch.randint(1, vocab, (int(torch.randint(4, 10, (1,), generator=gen)),), generator=gen).tolist()
        sides = [prompt + torch.randint(1, vocab, (int(torch.randint(3, 12, (1,), generator=gen)),),
                                        generator=gen).tolist() for _ in range(2)]
        raw.append(sides)
        row = build_row([(s, [0] * len(prompt) + [1] * (len(s) - len(prompt))) for s in sides], SEQ, pad_id=PAD)
        if margins:
            row["margin"] = torch.tensor(0.25 * (i % 3))
        rows.append(row)
    return rows, raw


def hf_scores(directory, raw) -> torch.Tensor:
    """Independent: each conversation alone through transformers' sequence classifier."""
    model = tf.AutoModelForSequenceClassification.from_pretrained(directory).eval()
    with torch.no_grad():
        return torch.tensor([[float(model(input_ids=torch.tensor([s])).logits[0, 0]) for s in sides]
                             for sides in raw], dtype=torch.float64)


def expected_metrics(scores: torch.Tensor, margin: torch.Tensor) -> dict:
    chosen, rejected = scores[:, 0], scores[:, 1]
    return {"loss": float(-torch.nn.functional.logsigmoid(chosen - rejected - margin).mean()),
            "accuracy": float((chosen > rejected).double().mean()),
            "reward_gap": float((chosen - rejected).mean()),
            "rewards/chosen": float(chosen.mean()), "rewards/rejected": float(rejected.mean())}


class Record(L.Callback):
    """Per-step metrics; after the first update an HF export and our own scores of `raw`."""

    def __init__(self, out: Path, raw=None) -> None:
        self.out, self.raw, self.rows = out, raw, []

    def on_train_batch_end(self, trainer, pl_module, *args):
        self.rows.append({k: float(trainer.callback_metrics[f"train/{k}"]) for k in METRICS})
        if self.raw is not None and trainer.global_step == 1:
            pl_module.save_hf_checkpoint(self.out.parent / "export")
            scores = pl_module.score([s for sides in self.raw for s in sides])
            if trainer.global_rank == 0:
                torch.save(scores.cpu(), self.out.parent / "scores.pt")

    def on_train_end(self, trainer, pl_module):
        if trainer.global_rank == 0:
            self.out.write_text(json.dumps(self.rows))


def train(tmp_path, module, data, devices=1, steps=2, raw=None, callbacks=(), **parallel):
    out = tmp_path / "metrics.json"
    trainer = L.Trainer(
        accelerator="cpu", devices=devices, max_steps=steps, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=bool(callbacks),
        callbacks=[Record(out, raw), *callbacks],
        strategy=MegatronStrategy(global_batch_size=8, micro_batch_size=2, start_method="fork", **parallel),
    )
    trainer.fit(module, data)
    return json.loads(out.read_text())


def check(got: dict, want: dict, what: str) -> None:
    for key, value in want.items():
        assert abs(got[key] - value) <= 1e-5 * max(1.0, abs(value)), (what, key, got[key], value)


@pytest.mark.distributed
@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_reward_matches_transformers_and_exports(tmp_path, family):
    """TP=2 with sequence parallelism, from a sequence classifier: step 0's metrics equal the
    formula on the source's transformers scores, step 1's those on the export's (written after
    one update), which loads in AutoModelForSequenceClassification with our scores."""
    source = tmp_path / "source"
    make_seq_cls(family, source)
    rows, raw = pairs(8, COMMON["vocab_size"], margins=True)
    margin = torch.tensor([0.25 * (i % 3) for i in range(8)], dtype=torch.float64)
    module = RewardModule(str(source), OptimizerSettings(lr=2e-2, warmup_steps=0))
    step0, step1 = train(tmp_path, module, DataLoader(rows, batch_size=8), devices=2, raw=raw,
                         tensor_model_parallel_size=2, sequence_parallel=True)

    check(step0, expected_metrics(hf_scores(source, raw), margin), "source")
    exported = hf_scores(tmp_path / "export", raw)
    assert abs(step1["loss"] - step0["loss"]) > 1e-3, "the first step changed nothing"
    check(step1, expected_metrics(exported, margin), "export")
    ours = torch.load(tmp_path / "scores.pt").reshape(-1, 2).double()
    assert torch.allclose(ours, exported, atol=1e-4, rtol=0), (ours, exported)
    config = json.loads((tmp_path / "export" / "config.json").read_text())
    assert config["architectures"] == [FAMILIES[family]()[1].__name__.replace("CausalLM", "SequenceClassification")]
    assert config["pad_token_id"] == PAD and len(config["id2label"]) == 1


@pytest.mark.distributed
def test_reward_from_causal_lm_starts_at_zero_and_exports_qwen3(tmp_path):
    """A causal LM directory: the head starts at zero (loss log 2, accuracy 0), lm_head is
    dropped; the export (qwen3) scores as we do in transformers."""
    import math

    from hf_models import make_hf_model

    source = tmp_path / "source"
    make_hf_model("qwen3", source, pad_token_id=PAD)
    rows, raw = pairs(8, COMMON["vocab_size"], seed=2)
    module = RewardModule(str(source), OptimizerSettings(lr=5e-2, warmup_steps=0))
    step0, step1 = train(tmp_path, module, DataLoader(rows, batch_size=8), raw=raw)
    assert abs(step0["loss"] - math.log(2)) <= 1e-6 and step0["accuracy"] == 0.0
    exported = hf_scores(tmp_path / "export", raw)
    check(step1, expected_metrics(exported, torch.zeros(8, dtype=torch.float64)), "export")
    ours = torch.load(tmp_path / "scores.pt").reshape(-1, 2).double()
    assert torch.allclose(ours, exported, atol=1e-4, rtol=0), (ours, exported)


@pytest.mark.distributed
def test_reward_checkpoint_exports_as_sequence_classifier(tmp_path):
    """A PP=2 reward checkpoint: `lightning-mcore export` writes the scalar-head layout (the
    same tensors and config as the run's own export); it fine-tunes as a reward model only."""
    from lightning.pytorch.callbacks import ModelCheckpoint
    from safetensors.torch import load_file

    from lightning_mcore import SFTModule
    from lightning_mcore.export_checkpoint import export_checkpoint

    source = tmp_path / "source"
    make_seq_cls("qwen3", source, seed=4)
    rows, raw = pairs(8, COMMON["vocab_size"], seed=5)
    module = RewardModule(str(source), OptimizerSettings(lr=2e-2, warmup_steps=0))
    saving = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_top_k=0, save_last=True)
    train(tmp_path, module, DataLoader(rows, batch_size=8), devices=2, steps=1, raw=raw,
          callbacks=[saving], pipeline_model_parallel_size=2)
    # the run's export happened after its one update: the weights last.ckpt holds
    written = export_checkpoint(str(tmp_path / "ckpt" / "last.ckpt"), str(tmp_path / "cli-export"))
    ours, theirs = (load_file(d / "model.safetensors") for d in (tmp_path / "export", written))
    assert sorted(ours) == sorted(theirs) and "score.weight" in ours and "lm_head.weight" not in ours
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert json.loads((written / "config.json").read_text()) == json.loads((tmp_path / "export" / "config.json").read_text())
    RewardModule(str(tmp_path / "ckpt" / "last.ckpt"))
    with pytest.raises(ValueError, match="'score' head; SFTModule takes one with a 'lm' head"):
        SFTModule(str(tmp_path / "ckpt" / "last.ckpt"))


@pytest.mark.distributed
def test_reward_layouts_agree(tmp_path):
    """SGD, 3 steps, from a tied-embedding sequence classifier: TP=2+SP and PP=2 equal TP=1."""
    source = tmp_path / "source"
    make_seq_cls("llama_tied", source, seed=3)
    rows, _ = pairs(8, COMMON["vocab_size"], seed=1)
    optim = OptimizerSettings(lr=0.05, optimizer="sgd", clip_grad=0.0, weight_decay=0.0, warmup_steps=0)
    runs = {}
    for name, devices, parallel in (
        ("tp1", 1, {}), ("tp2_sp", 2, dict(tensor_model_parallel_size=2, sequence_parallel=True)),
        ("pp2", 2, dict(pipeline_model_parallel_size=2)),
    ):
        runs[name] = fit(tmp_path, devices=devices, steps=3, optim=optim, config=str(source),
                         dataset=rows, module_cls=RewardModule, name=name, **parallel)
    assert runs["tp1"][-1] < runs["tp1"][0], runs["tp1"]
    for name in ("tp2_sp", "pp2"):
        for got, want in zip(runs[name], runs["tp1"]):
            assert abs(got - want) <= 1e-5 * max(1.0, abs(want)), (name, runs[name], runs["tp1"])


@pytest.mark.distributed
def test_reward_learns_the_bundled_pairs(tmp_path):
    """20 steps from scratch on the bundled pairs (polite correct answers preferred to rude
    wrong ones, margin 0.5)."""
    from lightning_mcore.data.reward import RewardDataModule

    config = tiny_config(num_layers=2, hidden_size=128, ffn_hidden_size=352, vocab_size=512, seq_length=256)
    module = RewardModule(config, OptimizerSettings(lr=1e-3, warmup_steps=2, min_lr=1e-4))
    data = RewardDataModule(str(ROOT / "configs/sample_data/reward.jsonl"), str(ROOT / "configs/sample_data/tokenizer"),
                            256, chat_template="chatml", cache_dir=str(tmp_path / "cache"))
    rows = train(tmp_path, module, data, steps=20)
    assert rows[-1]["accuracy"] > 0.9 and rows[-1]["reward_gap"] > 0.5, [r["accuracy"] for r in rows]


def test_margins_travel_with_their_pairs(tmp_path):
    from lightning_mcore.data.reward import RewardDataModule

    records = [{"prompt": f"Question {i}?", "chosen": f"Answer {i}.", "rejected": "No." * (i % 2 + 1),
                "margin": 0.25 * i} for i in range(6)]
    records[1]["rejected"] = records[1]["chosen"]  # dropped: later pairs' rows shift by one
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    data = RewardDataModule(str(tmp_path / "pairs.jsonl"), str(ROOT / "configs/sample_data/tokenizer"), 256,
                            chat_template="chatml", cache_dir=str(tmp_path / "cache"))
    data.setup("fit")
    for k in range(len(data.train_dataset)):
        pair = data.train_dataset.rows.rows[k][0] // 2
        assert float(data.train_dataset[k]["margin"]) == records[pair]["margin"]
    assert len(data.train_dataset) == 5
    records[3]["margin"] = "big"
    (tmp_path / "bad.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    bad = RewardDataModule(str(tmp_path / "bad.jsonl"), str(ROOT / "configs/sample_data/tokenizer"), 256,
                           chat_template="chatml", cache_dir=str(tmp_path / "cache2"))
    with pytest.raises(ValueError, match="sample 3: margin column 'margin' holds 'big'"):
        bad.setup("fit")


def test_unsupported_family_is_refused_before_workers(capsys, tmp_path, monkeypatch):
    """Gemma 3 declares no scalar-head layout: the CLI stops with one error naming it."""
    from hf_models import make_hf_model
    from lightning_mcore.cli import main

    make_hf_model("gemma3", tmp_path / "gemma3")
    monkeypatch.setattr(L.Trainer, "fit", lambda *a, **k: pytest.fail("fit started"))
    monkeypatch.chdir(ROOT)
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", "configs/reward.yaml", "--model.init_args.model", str(tmp_path / "gemma3")])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in err, err
    assert "error: model.init_args.model (RewardModule): reward models of the gemma3_text family" in err, err
    assert "supported families: llama, mistral, mixtral, qwen2, qwen2_moe, qwen3, qwen3_moe, seed_oss" in err, err


def test_lora_is_refused():
    from lightning_mcore.lora.config import LoRAConfig

    with pytest.raises(ValueError, match="LoRA .* is not supported yet"):
        RewardModule(tiny_config(), lora=LoRAConfig())


def test_rows_that_are_not_pairs_are_refused():
    """SFT-packed rows (three samples in a row) would be scored as pairs without a word."""
    module = RewardModule(tiny_config())
    row = build_row([([1, 2, 3], [0, 1, 1]), ([4, 5], [0, 1]), ([6, 7], [0, 1])], 16, pad_id=PAD)
    batch = {k: v[None] for k, v in row.items()}
    with pytest.raises(ValueError, match="rows of one pair each.*segment ids up to 3"):
        module.forward_step(batch, chunk=None)
