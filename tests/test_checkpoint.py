"""Acceptance (checkpoints): resume is exact, resharding works, bad ckpt_path fails clearly."""

import json
from pathlib import Path

import lightning as L
import pytest
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_mcore import MegatronStrategy, OptimizerSettings, PretrainModule
from lightning_mcore.data import PretrainDataModule
from lightning_mcore.strategy.checkpoint_io import CheckpointOptions
from toy import RecordLosses, tiny_config

ROOT = Path(__file__).parents[1]


class StopAfter(L.Callback):
    """Ends the run after `steps` optimizer steps, as an interruption would (max_steps unchanged)."""

    def __init__(self, steps: int) -> None:
        self.steps = steps

    def on_train_batch_end(self, trainer, *args):
        if trainer.global_step >= self.steps:
            trainer.should_stop = True


def run(tmp: Path, name: str, devices: int, stop: int = None, ckpt_path=None, config=None,
        checkpoint=None, **parallel):
    out = tmp / f"{name}.json"
    callbacks = [RecordLosses(out), ModelCheckpoint(dirpath=tmp / f"{name}-ckpts", every_n_train_steps=3,
                                                    save_top_k=-1, save_last=True)]
    if stop:
        callbacks.append(StopAfter(stop))
    trainer = L.Trainer(
        accelerator="cpu", devices=devices, max_steps=6, logger=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, callbacks=callbacks,
        strategy=MegatronStrategy(global_batch_size=8, micro_batch_size=2, start_method="fork",
                                  checkpoint=checkpoint, **parallel),
    )
    data = PretrainDataModule(paths=str(ROOT / "configs/sample_data/sample.txt"),
                              tokenizer=str(ROOT / "configs/sample_data/tokenizer"), seq_length=32,
                              shuffle=True, cache_dir=str(tmp / "cache"))
    module = PretrainModule(config or tiny_config(vocab_size=512), OptimizerSettings(lr=1e-3, warmup_steps=2))
    trainer.fit(module, data, ckpt_path=ckpt_path)
    return json.loads(out.read_text())


@pytest.mark.distributed
def test_resume_continues_exactly_with_data_parallel(tmp_path):
    layout = dict(tensor_model_parallel_size=1)  # DP=2, each rank its own data slice
    straight = run(tmp_path, "straight", 2, **layout)
    first = run(tmp_path, "first", 2, stop=3, **layout)
    assert first == straight[:3]
    saved = tmp_path / "first-ckpts" / "epoch=0-step=3.ckpt"
    assert (saved / "common.pt").is_file()
    resumed = run(tmp_path, "resumed", 2, ckpt_path=str(saved), **layout)
    assert len(resumed) == 3
    for got, want in zip(resumed, straight[3:]):
        assert abs(got - want) <= 1e-7, (resumed, straight[3:])


@pytest.mark.distributed
def test_async_save_resumes_exactly(tmp_path):
    """The shards are written by a forked process; the directory appears once all are done."""
    layout = dict(tensor_model_parallel_size=1)
    straight = run(tmp_path, "straight", 2, **layout)
    run(tmp_path, "first", 2, stop=3, checkpoint=CheckpointOptions(async_save=True), **layout)
    saved = tmp_path / "first-ckpts" / "epoch=0-step=3.ckpt"
    assert sorted(p.name for p in saved.iterdir()) == ["common.pt", "rng_0.pt", "rng_1.pt", "weights"]
    assert not list((tmp_path / "first-ckpts").glob(".tmp-*"))
    resumed = run(tmp_path, "resumed", 2, ckpt_path=str(saved), **layout)
    for got, want in zip(resumed, straight[3:]):
        assert abs(got - want) <= 1e-7, (resumed, straight[3:])


@pytest.mark.distributed
def test_checkpoint_without_optimizer_and_rng(tmp_path):
    """save_optimizer/save_rng=False leave those out; resuming warns and starts a fresh
    optimizer, so step 4 differs from the straight run's, while the first 3 match."""
    from megatron.core import dist_checkpointing

    straight = run(tmp_path, "straight", 1)
    lean = CheckpointOptions(save_optimizer=False, save_rng=False)
    first = run(tmp_path, "first", 1, stop=3, checkpoint=lean)
    assert first == straight[:3]
    saved = tmp_path / "first-ckpts" / "epoch=0-step=3.ckpt"
    assert sorted(p.name for p in saved.iterdir()) == ["common.pt", "weights"]
    keys = dist_checkpointing.load_tensors_metadata(str(saved / "weights"))
    assert keys and not [k for k in keys if k.startswith("optimizer")]
    resumed = run(tmp_path, "resumed", 1, ckpt_path=str(saved))  # warns: fresh optimizer
    assert len(resumed) == 3 and abs(resumed[0] - straight[3]) > 1e-6


@pytest.mark.distributed
def test_checkpoint_from_tp2_pp2_resumes_at_tp1_and_pp2(tmp_path):
    big = dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    straight = run(tmp_path, "straight", 4, **big)
    run(tmp_path, "first", 4, stop=3, **big)
    saved = str(tmp_path / "first-ckpts" / "epoch=0-step=3.ckpt")
    for name, devices, layout in (("tp1", 1, {}), ("pp2", 2, dict(pipeline_model_parallel_size=2))):
        resumed = run(tmp_path, name, devices, ckpt_path=saved, **layout)
        for got, want in zip(resumed, straight[3:]):
            assert abs(got - want) <= 1e-5 * abs(want), (name, resumed, straight[3:])


@pytest.mark.distributed
def test_bad_ckpt_paths_are_refused_clearly(tmp_path):
    run(tmp_path, "first", 1, stop=3)
    saved = tmp_path / "first-ckpts" / "epoch=0-step=3.ckpt"
    not_ckpt = tmp_path / "plain"
    not_ckpt.mkdir()
    cases = [
        (tmp_path / "missing.ckpt", tiny_config(vocab_size=512), "does not exist"),
        (not_ckpt, tiny_config(vocab_size=512), "is not a MegatronStrategy checkpoint"),
        (saved, tiny_config(vocab_size=512, ffn_hidden_size=96),
         "different model config: ffn_hidden_size: checkpoint 128 vs model 96"),
    ]
    for path, config, message in cases:
        with pytest.raises(Exception) as info:
            run(tmp_path, "bad", 1, ckpt_path=str(path), config=config)
        assert message in str(info.value), str(info.value)[-500:]
        assert not dist.is_initialized()
