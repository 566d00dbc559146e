"""Resuming with changed optimizer settings: the run's settings win over the checkpoint's."""

import json
import logging
import math
from pathlib import Path

import lightning as L
import pytest
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from lightning_mcore import MegatronStrategy, OptimizerSettings, PretrainModule
from toy import TokenRows, tiny_config

FIRST = OptimizerSettings(lr=1e-3, min_lr=1e-5, warmup_steps=1, weight_decay=0.01, adam_beta2=0.95)
SECOND = OptimizerSettings(lr=4e-3, min_lr=2e-4, warmup_steps=4, weight_decay=0.1, adam_beta2=0.99)


def expected_lr(settings: OptimizerSettings, max_steps: int, step: int) -> float:
    """Megatron's schedule written out: linear warmup from 0 over warmup_steps, then cosine
    from lr to min_lr until decay_steps (= max_steps); the update of step k uses lr(k)."""
    warmup, decay, top, bottom = settings.warmup_steps, max_steps, settings.lr, settings.min_lr
    if warmup and step <= warmup:
        return top * step / warmup
    if step > decay:
        return bottom
    return bottom + (top - bottom) * 0.5 * (1 + math.cos(math.pi * (step - warmup) / (decay - warmup)))


class RecordOptimizer(L.Callback):
    """Per update: the step and the param groups' settings the update is about to use."""

    def __init__(self, out: Path) -> None:
        self.out, self.rows = out, []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        groups = optimizer.param_groups
        self.rows.append({
            "global_step": trainer.global_step,
            "scheduler_steps": optimizer.scheduler.num_steps,
            "lr": sorted({float(g["lr"]) for g in groups}),
            "weight_decay": sorted({float(g["weight_decay"]) for g in groups}),
            "betas": sorted({tuple(g["betas"]) for g in groups}),
        })

    def on_train_end(self, trainer, pl_module):
        if trainer.global_rank == 0:
            self.out.write_text(json.dumps(self.rows))


def train(tmp: Path, name: str, settings: OptimizerSettings, max_steps: int, ckpt_path=None,
          accelerator="cpu", precision="32-true", config=None, **strategy) -> list:
    out = tmp / f"{name}.json"
    trainer = L.Trainer(
        accelerator=accelerator, devices=1, max_steps=max_steps, logger=False, precision=precision,
        enable_progress_bar=False, enable_model_summary=False,
        callbacks=[RecordOptimizer(out), ModelCheckpoint(dirpath=tmp / f"{name}-ckpts",
                                                         every_n_train_steps=3, save_top_k=-1)],
        strategy=MegatronStrategy(global_batch_size=4, micro_batch_size=2, **strategy),
    )
    trainer.fit(PretrainModule(config or tiny_config(), settings), DataLoader(TokenRows(), batch_size=4),
                ckpt_path=ckpt_path)
    return json.loads(out.read_text())


def check_resume(tmp_path, **run):
    first = train(tmp_path, "first", FIRST, max_steps=3, **run)
    assert [r["lr"] for r in first] == [[pytest.approx(expected_lr(FIRST, 3, k))] for k in range(3)]

    saved = tmp_path / "first-ckpts" / "epoch=0-step=3.ckpt"
    log = logging.FileHandler(tmp_path / "log.txt")  # a forked rank inherits it
    logging.getLogger("lightning.pytorch").addHandler(log)
    try:
        resumed = train(tmp_path, "resumed", SECOND, max_steps=8, ckpt_path=str(saved), **run)
    finally:
        logging.getLogger("lightning.pytorch").removeHandler(log)
        log.close()
    assert [r["global_step"] for r in resumed] == [3, 4, 5, 6, 7]
    assert [r["scheduler_steps"] for r in resumed] == [3, 4, 5, 6, 7]
    for row in resumed:
        want = expected_lr(SECOND, 8, row["global_step"])
        assert row["lr"] == [pytest.approx(want, rel=1e-12)], (row, want)
        assert row["weight_decay"] == [0.0, pytest.approx(0.1)]  # norms and biases: no decay
        assert row["betas"] == [[0.9, 0.99]]
    assert ("with this run's optimizer settings, which differ from the checkpoint's: lr 0.001 -> "
            "0.004; min_lr 1e-05 -> 0.0002; warmup_steps 1 -> 4; decay_steps (max_steps if unset) "
            "3 -> 8; weight_decay 0.01 -> 0.1; adam_beta1, adam_beta2 [0.9, 0.95] -> [0.9, 0.99]"
            ) in (tmp_path / "log.txt").read_text()


@pytest.mark.distributed
def test_resume_follows_the_new_lr_schedule(tmp_path):
    """3 steps at lr 1e-3 over max_steps 3, then resumed at lr 4e-3, min_lr 2e-4, warmup 4,
    weight decay 0.1, beta2 0.99 over max_steps 8: every resumed update uses the new config's
    schedule at the continued step count, and the new settings reach the param groups."""
    check_resume(tmp_path, start_method="fork")


@pytest.mark.gpu
def test_resume_follows_the_new_lr_schedule_with_the_distributed_optimizer(tmp_path):
    """The same with mcore's distributed optimizer, bf16 and Transformer Engine on one GPU
    (mcore 0.19 pairs saved and current param groups by their lr bounds, which change here)."""
    check_resume(tmp_path, accelerator="gpu", precision="bf16-mixed", start_method="popen",
                 config=tiny_config(transformer_impl="transformer_engine"), use_distributed_optimizer=True)
