"""Acceptance (issue 19, item 3): a checkpoint with expert adapters resumes exactly at EP=2 and
reshards to EP=1; a checkpoint from before expert adapters (its LoRA config has no `experts`)
is not resumed with expert adapters it lacks.

Tiny Qwen3-MoE (4 experts, top-2), LoRA on the experts only (so that every change of the loss
is theirs and the dense optimizer is mcore's stub), Adam (so the optimizer state matters). One EP=2 run of 4 steps straight, one of 2 steps that saves;
the resumed runs continue from that save."""

from __future__ import annotations

import dataclasses
import functools
import shutil
from pathlib import Path

import lightning as L
import pytest
import torch
import yaml
from lightning.pytorch.callbacks import ModelCheckpoint

from hf_models import make_hf_model
from lightning_mcore import MegatronStrategy, OptimizerSettings, PretrainModule
from lightning_mcore.cli import main
from lightning_mcore.data.feeding import DataParallelDataModule
from lightning_mcore.lora.config import LoRAConfig
from lightning_mcore.strategy.checkpoint_io import COMMON, load_plain
from toy import RecordLosses, StopAfter, TokenRows, assemble, tiny_config

EXPERTS = LoRAConfig(target_modules=["gate_proj", "up_proj", "down_proj"], rank=4, alpha=8.0)
# Adam: its moments are optimizer state that a resume must bring back. (mcore cannot
# resume SGD's state: its FP32Optimizer has no init_state_fn for SGD's momentum buffers.)
ADAM = OptimizerSettings(lr=2e-2, weight_decay=0.0, warmup_steps=0)
EP2 = dict(expert_model_parallel_size=2)


class Rows(DataParallelDataModule):
    """TokenRows through the library's resumable per-rank feeding (mid-epoch resume)."""

    def __init__(self) -> None:
        super().__init__()
        self.save_hyperparameters({"seq_length": 16, "seed": 0, "shuffle": True, "num_workers": 0})
        self.train_dataset = TokenRows(n=16, seq=16, vocab=200)


def run(tmp: Path, name: str, devices: int, stop: int | None = None, ckpt_path=None,
        lora: LoRAConfig = EXPERTS, **parallel) -> list[float]:
    """4 steps (global batch 4) of the tiny Qwen3-MoE with expert adapters; a checkpoint every
    2 steps; each rank dumps its weights at the start (after a restore) and the end."""
    out = tmp / f"{name}.json"
    callbacks = [RecordLosses(out, dump_weights=True),
                 ModelCheckpoint(dirpath=tmp / f"{name}-ckpts", every_n_train_steps=2, save_top_k=-1)]
    if stop:
        callbacks.append(StopAfter(stop))
    trainer = L.Trainer(
        accelerator="cpu", devices=devices, max_steps=4, logger=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, callbacks=callbacks,
        strategy=MegatronStrategy(global_batch_size=4, micro_batch_size=1, start_method="fork",
                                  use_distributed_optimizer=False, **parallel),
    )
    trainer.fit(PretrainModule(str(tmp / "source"), ADAM, lora=lora), Rows(), ckpt_path=ckpt_path)
    return yaml.safe_load(out.read_text())


def adapters(tmp: Path, name: str, when: str, ranks: int) -> dict:
    """Full adapter tensors (keys 'lora.<global path>.lora_A/B') from every rank's dump."""
    full = assemble([tmp / f"{name}.{when}{r}.pt" for r in range(ranks)])
    return {k: v for k, v in full.items() if k.startswith("lora.")}


@pytest.fixture(scope="module")
def ep2(tmp_path_factory):
    """The EP=2 runs: 4 steps straight, and 2 steps that save; their losses and the save."""
    tmp = tmp_path_factory.mktemp("ep2")
    make_hf_model("qwen3_moe", tmp / "source")
    straight = run(tmp, "straight", 2, **EP2)
    first = run(tmp, "first", 2, stop=2, **EP2)
    saved = tmp / "first-ckpts" / "epoch=0-step=2.ckpt"
    assert (saved / COMMON).is_file()
    return tmp, straight, first, saved


def expert_keys(tensors: dict) -> set[int]:
    """The global experts that have adapters among `tensors` (stacked: [experts, ...], the rows
    no rank dumped left NaN)."""
    stacked = [v for k, v in tensors.items() if "__experts__" in k]
    assert stacked, "no expert adapters"
    return {e for v in stacked for e in range(v.shape[0]) if not v[e].isnan().any()}


@pytest.mark.distributed
def test_resume_at_ep2_is_exact(ep2):
    """Same layout, same reduction order, the same single-threaded CPU kernels: the resumed run
    repeats the straight one bit for bit (losses and adapters), as the dense resume test does."""
    tmp, straight, first, saved = ep2
    assert len(straight) == 4 and first == straight[:2]
    resumed = run(tmp, "resumed", 2, ckpt_path=str(saved), **EP2)
    assert resumed == straight[2:], (resumed, straight)
    want, got = adapters(tmp, "straight", "end", 2), adapters(tmp, "resumed", "end", 2)
    assert expert_keys(want) == {0, 1, 2, 3} and got.keys() == want.keys()
    fresh = adapters(tmp, "straight", "init", 2)
    assert max((want[k] - fresh[k]).abs().max().item() for k in want) > 1e-2, "nothing trained"
    for key, tensor in want.items():
        assert torch.equal(got[key], tensor), key


@pytest.mark.distributed
def test_ep2_checkpoint_reshards_to_ep1(ep2):
    """EP=1 loads every global expert's A/B as saved at EP=2 (a copy: bitwise) and continues
    like the EP=2 run (another reduction order: within 1e-5), momentum included."""
    tmp, straight, _, saved = ep2
    resumed = run(tmp, "ep1", 1, ckpt_path=str(saved))
    saved_adapters = adapters(tmp, "first", "end", 2)  # rank 0 holds experts 0-1, rank 1 2-3
    loaded = adapters(tmp, "ep1", "init", 1)
    assert expert_keys(saved_adapters) == {0, 1, 2, 3} and loaded.keys() == saved_adapters.keys()
    for key, tensor in saved_adapters.items():
        assert torch.equal(loaded[key], tensor), key
    fresh = adapters(tmp, "straight", "init", 2)
    assert max((saved_adapters[k] - fresh[k]).abs().max().item() for k in fresh) > 1e-2
    assert len(resumed) == 2
    for got, want in zip(resumed, straight[2:]):
        assert abs(got - want) <= 1e-5 * want, (resumed, straight)
    end_ep1, end_ep2 = adapters(tmp, "ep1", "end", 1), adapters(tmp, "straight", "end", 2)
    for key, tensor in end_ep2.items():
        torch.testing.assert_close(end_ep1[key], tensor, rtol=1e-5, atol=1e-6, msg=key)


def forget_experts(saved: Path, to: Path) -> Path:
    """A copy of `saved` whose LoRA config has no `experts` field, as before expert adapters."""
    shutil.copytree(saved, to)
    common = load_plain(to / COMMON)
    del common["megatron"]["lora"]["experts"]
    torch.save(common, to / COMMON)
    return to


@pytest.mark.distributed
def test_resuming_a_checkpoint_from_before_expert_adapters_with_them_is_refused(ep2):
    """Its LoRA config reads as experts=False: a run whose config adapts the experts would
    train adapters the checkpoint lacks; the resume refuses, naming `experts`."""
    tmp, _, _, saved = ep2
    old = forget_experts(saved, tmp / "old.ckpt")
    with pytest.raises(Exception, match="experts: checkpoint unset") as info:
        run(tmp, "old", 2, ckpt_path=str(old), **EP2)
    assert "experts=False" in str(info.value), str(info.value)


# ------------------------------------------------------------ the CLI, before workers start
MOE = dataclasses.asdict(tiny_config(num_layers=2, vocab_size=512, num_moe_experts=4,
                                     moe_ffn_hidden_size=32, moe_router_topk=2))
DENSE = dataclasses.asdict(tiny_config(num_layers=2, vocab_size=512))
OLD_LORA = {"target_modules": "all-linear", "rank": 4, "alpha": 8.0, "dropout": 0.0,
            "use_rslora": False}  # as saved before expert adapters: no `experts`


@pytest.fixture
def no_fit(monkeypatch):
    """Reaching Trainer.fit means every check before launch passed."""
    @functools.wraps(L.Trainer.fit)  # the CLI reads fit's arguments (ckpt_path) from its signature
    def passed(*args, **kwargs):
        raise RuntimeError("checks passed")

    monkeypatch.setattr(L.Trainer, "fit", passed)


def cli_resume(tmp: Path, model: dict, *args: str):
    """`lightning-mcore fit` of `model` with all-linear LoRA, resuming a checkpoint that holds
    `model` and OLD_LORA (common.pt only: nothing reads weights before launch)."""
    ckpt = tmp / "old.ckpt"
    (ckpt / "weights").mkdir(parents=True, exist_ok=True)
    torch.save({"global_step": 2, "megatron": {"model_config": model, "lora": OLD_LORA,
                "parallel": {"tensor_model_parallel_size": 1}, "dtype": "float32"}}, ckpt / COMMON)
    samples = Path(__file__).parents[1] / "configs" / "sample_data"
    config = {
        "trainer": {"accelerator": "cpu", "devices": 1, "max_steps": 4, "logger": False,
                    "strategy": {"class_path": "lightning_mcore.MegatronStrategy",
                                 "init_args": {"global_batch_size": 2, "micro_batch_size": 1}}},
        "model": {"class_path": "lightning_mcore.PretrainModule",
                  "init_args": {"model": model, "lora": {"target_modules": "all-linear", "rank": 4,
                                                         "alpha": 8.0}}},
        "data": {"class_path": "lightning_mcore.data.PretrainDataModule",
                 "init_args": {"paths": str(samples / "sample.txt"), "seq_length": 32,
                               "tokenizer": str(samples / "tokenizer"), "cache_dir": str(tmp / "cache")}},
    }
    (tmp / "config.yaml").write_text(yaml.safe_dump(config))
    main(["fit", "--config", str(tmp / "config.yaml"), "--ckpt_path", str(ckpt), *args])


def test_cli_refuses_expert_adapters_on_a_checkpoint_without_them(tmp_path, capsys, no_fit):
    with pytest.raises(SystemExit) as exit_info:
        cli_resume(tmp_path, MOE)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err[-2000:]
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err[-2000:]
    assert "experts: checkpoint unset" in lines[0] and "experts=False" in lines[0], lines[0]


def test_cli_resumes_old_checkpoints_when_nothing_changes(tmp_path, no_fit):
    """experts=False on the MoE model, and a dense model with experts unset (no experts to
    adapt) pass every check before launch."""
    with pytest.raises(RuntimeError, match="checks passed"):
        cli_resume(tmp_path, MOE, "--model.init_args.lora.experts", "false")
    with pytest.raises(RuntimeError, match="checks passed"):
        cli_resume(tmp_path, DENSE)
