"""Acceptance (distillation): each divergence equals trl's generalized_jsd_loss formula computed from
transformers' logits; the vocab-parallel divergence and its gradient equal the gathered one; TP=2
(+SP) and PP=2 equal TP=1; a student learns a teacher's distributions on the bundled chats; a
teacher with another vocabulary or tokenizer is refused before any worker starts."""

import json
import multiprocessing
import shutil
import traceback
import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM

from hf_models import make_hf_model
from lightning_mcore import MegatronStrategy, OptimizerSettings
from lightning_mcore.data.packing import build_row
from lightning_mcore.objectives.distill import DistillModule, DistillSettings
from toy import fit, tiny_config

ROOT = Path(__file__).parents[1]
SEQ = 32
METRICS = ("loss", "divergence", "ce")
STEPS, LR = 40, 1e-2


# ------------------------------------------------------------------ independent reference
def gkd_token_loss(student_logits, teacher_logits, labels, settings: DistillSettings):
    """Per-token loss from full-vocabulary logits, as trl's GKDTrainer.generalized_jsd_loss
    (reduction="none", summed over the vocabulary) mixed with F.cross_entropy."""
    s = F.log_softmax(student_logits / settings.temperature, -1)
    t = F.log_softmax(teacher_logits / settings.temperature, -1)
    beta = {"forward_kl": 0.0, "reverse_kl": 1.0}.get(settings.divergence, settings.beta)
    if beta == 0:
        jsd = F.kl_div(s, t, reduction="none", log_target=True)
    elif beta == 1:
        jsd = F.kl_div(t, s, reduction="none", log_target=True)
    else:
        b = torch.tensor(beta, dtype=s.dtype)
        m = torch.logsumexp(torch.stack([s + torch.log(1 - b), t + torch.log(b)]), dim=0)
        kl_teacher = F.kl_div(m, t, reduction="none", log_target=True)
        kl_student = F.kl_div(m, s, reduction="none", log_target=True)
        jsd = b * kl_teacher + (1 - b) * kl_student
    divergence = jsd.sum(-1)
    ce = F.cross_entropy(student_logits, labels, reduction="none")
    return settings.sft_weight * ce + (1 - settings.sft_weight) * divergence, divergence, ce


# ------------------------------------------------------------------ vocab-parallel unit test
def _vocab_parallel_rank(rank, world, init, out, settings):
    from lightning_mcore.objectives.distill_loss import token_cross_entropy, token_divergence

    try:
        torch.distributed.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
        gen = torch.Generator().manual_seed(0)
        vocab, padded, tokens = 13, 16, 6  # rank 1 holds 5 real columns and 3 of padding
        student = torch.randn(tokens, padded, generator=gen) * 3
        teacher = torch.randn(tokens, padded, generator=gen) * 3
        labels = torch.randint(0, vocab, (tokens,), generator=gen)
        weights = torch.rand(tokens, generator=gen)
        width = padded // world
        mine = student[:, rank * width:(rank + 1) * width].clone().requires_grad_(True)
        theirs = teacher[:, rank * width:(rank + 1) * width]
        with warnings.catch_warnings(record=True) as caught:  # none per rank per step
            warnings.simplefilter("always")
            div = token_divergence(mine, theirs, vocab, None, settings.divergence, settings.beta, settings.temperature)
            ce = token_cross_entropy(mine, labels, vocab, None)
            loss = settings.sft_weight * ce + (1 - settings.sft_weight) * div
            (loss * weights).sum().backward()

        full = student[:, :vocab].clone().requires_grad_(True)
        want, want_div, want_ce = gkd_token_loss(full, teacher[:, :vocab], labels, settings)
        (want * weights).sum().backward()
        grad = torch.zeros(tokens, padded)
        grad[:, :vocab] = full.grad
        errors = [float((div - want_div).abs().max()), float((ce - want_ce).abs().max()),
                  float((mine.grad - grad[:, rank * width:(rank + 1) * width]).abs().max())]
        Path(f"{out}.{rank}").write_text(json.dumps({"errors": errors, "warnings": [str(w.message) for w in caught]}))
    except Exception:  # noqa: BLE001 - reported to the test
        Path(f"{out}.{rank}").write_text(json.dumps({"error": traceback.format_exc()}))
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


SETTINGS = {
    "forward_kl": DistillSettings(divergence="forward_kl"),
    "reverse_kl_T2": DistillSettings(divergence="reverse_kl", temperature=2.0),
    "jsd_mixed": DistillSettings(divergence="jsd", beta=0.5, temperature=0.7, sft_weight=0.3),
}


@pytest.mark.distributed
@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_vocab_parallel_divergence_and_gradient_equal_gathered(tmp_path, name):
    ctx = multiprocessing.get_context("fork")
    init, out = f"file://{tmp_path / 'init'}", tmp_path / "errors"
    procs = [ctx.Process(target=_vocab_parallel_rank, args=(r, 2, init, out, SETTINGS[name])) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    for rank in range(2):
        got = json.loads(Path(f"{out}.{rank}").read_text())
        assert "errors" in got, got
        assert max(got["errors"]) <= 1e-5, (rank, got)  # divergence, cross-entropy, gradient
        assert got["warnings"] == [], got  # torch's deprecated autograd all_reduce warned here


# ------------------------------------------------------------------ against transformers
def chats(n: int, vocab: int, seed: int = 0):
    """Rows of two random (prompt, reply) samples each; loss on the replies."""
    gen = torch.Generator().manual_seed(seed)
    rows, raw = [], []
    for _ in range(n):
        samples = []
        for _ in range(2):
            p, r = (int(torch.randint(3, 7, (1,), generator=gen)) for _ in range(2))
            ids = torch.randint(0, vocab, (p + r,), generator=gen).tolist()
            samples.append((ids, [0] * p + [1] * r))
        raw.extend(samples)
        rows.append(build_row(samples, SEQ, pad_id=0))
    return rows, raw


class RecordMetrics(L.Callback):
    """Rank 0 writes every step's metrics; the student is exported as HF after step `export_at`."""

    def __init__(self, out: Path, export_at=None) -> None:
        self.out, self.export_at, self.rows = out, export_at, []

    def on_train_batch_end(self, trainer, pl_module, *args):
        self.rows.append({k: float(trainer.callback_metrics[f"train/{k}"]) for k in METRICS})
        if trainer.global_step == self.export_at:
            pl_module.save_hf_checkpoint(self.out.parent / "student")

    def on_train_end(self, trainer, pl_module):
        if trainer.global_rank == 0:
            self.out.write_text(json.dumps(self.rows))


def hf_metrics(student, teacher, raw, settings) -> dict:
    """Independent: each sample alone through both transformers models; per-token means."""
    sums, count = torch.zeros(3, dtype=torch.float64), 0.0
    with torch.no_grad():
        for ids, mask in raw:
            x = torch.tensor([ids])
            per_token = gkd_token_loss(student(input_ids=x).logits[0, :-1].float(),
                                       teacher(input_ids=x).logits[0, :-1].float(), x[0, 1:], settings)
            m = torch.tensor(mask[1:], dtype=torch.float64)
            sums += torch.stack([(v.double() * m).sum() for v in per_token])
            count += float(m.sum())
    return dict(zip(METRICS, (sums / count).tolist()))


def peaked(model, directory: Path, scale: float = 10.0):
    """The tiny random model with its output layer scaled (saved again): distributions far from
    uniform, so that divergences are of order 1, not 1e-3."""
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)
    model.save_pretrained(directory)
    return model


class ExportAtEnd(L.Callback):
    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def on_train_end(self, trainer, pl_module):
        pl_module.save_hf_checkpoint(self.directory)


def teacher_checkpoint(tmp_path: Path, source: Path, rows) -> tuple[Path, Path]:
    """One SFT step from `source`: (our checkpoint, its HF export) of the same weights."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_mcore import SFTModule

    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=1, logger=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0,
        callbacks=[ModelCheckpoint(dirpath=tmp_path / "ckpts", save_top_k=0, save_last=True),
                   ExportAtEnd(tmp_path / "teacher-exported")],
        strategy=MegatronStrategy(global_batch_size=4, micro_batch_size=2, start_method="fork"),
    )
    trainer.fit(SFTModule(str(source), OptimizerSettings(lr=1e-2, warmup_steps=0)), DataLoader(rows, batch_size=4))
    return tmp_path / "ckpts" / "last.ckpt", tmp_path / "teacher-exported"


@pytest.mark.distributed
def test_losses_equal_hand_computation_from_transformers(tmp_path):
    """forward KL; reverse KL at temperature 2; JSD (beta 0.5) at temperature 0.7 mixed with 30%
    cross-entropy: step 0 from the starting models, step 1 from the student exported after one
    update, against trl's formula on transformers' logits. A teacher of another depth, given as
    an HF directory, then (JSD) as one of our checkpoints."""
    teacher_dir = tmp_path / "teacher"
    start = peaked(make_hf_model("llama", tmp_path / "student0", seed=0), tmp_path / "student0")
    peaked(make_hf_model("llama", teacher_dir, seed=1, num_hidden_layers=2), teacher_dir)
    rows, raw = chats(4, 200)
    checkpoint, exported = teacher_checkpoint(tmp_path, teacher_dir, rows)
    for name, settings in SETTINGS.items():
        if name == "jsd_mixed":
            teacher_dir = checkpoint
        teacher = AutoModelForCausalLM.from_pretrained(exported if name == "jsd_mixed" else teacher_dir).eval()
        run = tmp_path / name
        run.mkdir()
        trainer = L.Trainer(
            accelerator="cpu", devices=1, max_steps=2, logger=False, enable_progress_bar=False,
            enable_model_summary=False, enable_checkpointing=False,
            callbacks=[RecordMetrics(run / "metrics.json", export_at=1)],
            strategy=MegatronStrategy(global_batch_size=4, micro_batch_size=2, start_method="fork"),
        )
        module = DistillModule(str(tmp_path / "student0"), OptimizerSettings(lr=1e-2, warmup_steps=0),
                               teacher=str(teacher_dir), distill=settings)
        trainer.fit(module, DataLoader(rows, batch_size=4))
        step0, step1 = json.loads((run / "metrics.json").read_text())
        after = AutoModelForCausalLM.from_pretrained(run / "student").eval()
        for got, student in ((step0, start), (step1, after)):
            want = hf_metrics(student, teacher, raw, settings)
            for key in METRICS:
                assert abs(got[key] - want[key]) <= 1e-5 * max(1.0, abs(want[key])), (name, key, got, want)
        assert step1["loss"] < 0.99 * step0["loss"], (name, step0, step1)


# ------------------------------------------------------------------ layouts
@pytest.mark.distributed
def test_layouts_agree(tmp_path):
    """JSD at temperature 2 mixed with cross-entropy, a 2-layer HF teacher for a 4-layer student
    (vocab 500, padded to 512: TP rank 1 holds 12 padding columns): TP=2+SP and PP=2 equal TP=1
    over 3 SGD steps (equal losses: equal gradients)."""
    teacher = tmp_path / "teacher"
    peaked(make_hf_model("llama", teacher, seed=1, vocab_size=500, num_hidden_layers=2), teacher, 5.0)
    rows, _ = chats(8, 500, seed=1)
    optim = OptimizerSettings(lr=0.5, optimizer="sgd", clip_grad=0.0, weight_decay=0.0, warmup_steps=0)
    kwargs = {"teacher": str(teacher),
              "distill": DistillSettings(divergence="jsd", beta=0.3, temperature=2.0, sft_weight=0.2)}
    runs = {}
    for name, devices, parallel in (
        ("tp1", 1, {}), ("tp2_sp", 2, dict(tensor_model_parallel_size=2, sequence_parallel=True)),
        ("pp2", 2, dict(pipeline_model_parallel_size=2)),
    ):
        runs[name] = fit(tmp_path, devices=devices, steps=3, optim=optim, config=tiny_config(seq_length=SEQ),
                         dataset=rows, module_cls=DistillModule, module_kwargs=kwargs, name=name, **parallel)
    assert runs["tp1"][-1] < runs["tp1"][0], runs["tp1"]
    for name in ("tp2_sp", "pp2"):
        for got, want in zip(runs[name], runs["tp1"]):
            assert abs(got - want) <= 1e-5 * max(1.0, abs(want)), (name, runs[name], runs["tp1"])


# ------------------------------------------------------------------ learning
@pytest.mark.distributed
def test_student_learns_the_teacher_on_the_bundled_chats(tmp_path):
    """A 1-layer student from scratch, taught by the bundled tiny Llama on the bundled chats
    (forward KL on assistant tokens): the KL falls by 10x."""
    from lightning_mcore.data import SFTDataModule

    base = str(ROOT / "configs/sample_data/tiny-llama")
    out = tmp_path / "metrics.json"
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=STEPS, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, callbacks=[RecordMetrics(out)],
        strategy=MegatronStrategy(global_batch_size=4, micro_batch_size=4, start_method="fork"),
    )
    config = tiny_config(num_layers=1, hidden_size=64, ffn_hidden_size=128, vocab_size=512, seq_length=256)
    module = DistillModule(config, OptimizerSettings(lr=LR, warmup_steps=2, min_lr=LR / 10), teacher=base)
    data = SFTDataModule(str(ROOT / "configs/sample_data/sft.jsonl"), base, 256, cache_dir=str(tmp_path / "cache"))
    trainer.fit(module, data)
    kl = [r["divergence"] for r in json.loads(out.read_text())]
    assert kl[-1] < kl[0] / 10, kl


# ------------------------------------------------------------------ refusals
def fails(capsys, monkeypatch, *args) -> str:
    """`lightning-mcore fit --config configs/distill.yaml ARGS` exits 2 before fit, no traceback."""
    from lightning_mcore.cli import main

    def refuse(*a, **kw):
        raise AssertionError("Trainer.fit must not start")

    monkeypatch.setattr(L.Trainer, "fit", refuse)
    monkeypatch.chdir(ROOT)
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", "configs/distill.yaml", *args])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in err, err
    return err


def other_tokenizer(directory: Path) -> None:
    """The bundled tokenizer with two tokens' ids swapped: the same size, other ids."""
    base = ROOT / "configs/sample_data/tiny-llama"
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(base / name, directory / name)
    tokenizer = json.loads((base / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[100:102]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (directory / "tokenizer.json").write_text(json.dumps(tokenizer))


def test_teacher_with_another_vocabulary_or_tokenizer_is_refused(capsys, monkeypatch, tmp_path):
    base = ROOT / "configs/sample_data/tiny-llama"
    bigger = tmp_path / "bigger"
    make_hf_model("llama", bigger, vocab_size=600, num_hidden_layers=1)
    err = fails(capsys, monkeypatch, "--model.init_args.teacher", str(bigger))
    assert f"error: model (DistillModule): teacher={bigger} has vocab_size=600" in err
    assert "the student vocab_size=512" in err

    # the same size, another tokenizer: refused against the data's tokenizer (the student is a
    # GPTConfig) and against an HF student's own
    renamed = tmp_path / "renamed"
    make_hf_model("llama", renamed, vocab_size=512, num_hidden_layers=1)
    other_tokenizer(renamed)
    err = fails(capsys, monkeypatch, "--model.init_args.teacher", str(renamed))
    assert f"error: model.init_args.teacher: the teacher's tokenizer ({renamed}) differs from the data's " \
           f"(data.init_args.tokenizer=configs/sample_data/tiny-llama)" in err
    err = fails(capsys, monkeypatch, "--model.init_args.teacher", str(renamed), "--model.init_args.model", str(base))
    assert f"error: model (DistillModule): the teacher's tokenizer ({renamed}) differs from the student's " \
           f"tokenizer ({base})" in err

    # the bundled model teaching itself passes every check (the two tokenizer.json files equal)
    monkeypatch.setattr(L.Trainer, "fit", lambda *a, **kw: None)
    from lightning_mcore.cli import main

    main(["fit", "--config", "configs/distill.yaml", "--model.init_args.model", str(base),
          "--trainer.logger.init_args.save_dir", str(tmp_path / "logs"),
          "--data.init_args.cache_dir", str(tmp_path / "cache")])


def test_on_policy_is_refused():
    with pytest.raises(ValueError, match="lmbda=0.5: on-policy distillation"):
        DistillSettings(lmbda=0.5)
