"""Trainer(deterministic=True) under MegatronStrategy: mcore's deterministic mode and the
environment TE / NCCL / cuBLAS read, in every rank (strategy/determinism.py).

On CPU two runs give bitwise-equal losses with or without the switch, so the equality below
cannot fail here; what can is that each rank's TransformerConfig, embedding, torch flag and
environment follow the switch. Bitwise equality that needs the switch is the GPU test (TE)."""

import json
import os
from pathlib import Path

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_mcore import MegatronStrategy, OptimizerSettings
from lightning_mcore.data.packing import build_row, pack
from lightning_mcore.objectives.sft import SFTModule
from lightning_mcore.strategy import determinism
from test_sft_packing import LENGTHS, SEQ, samples
from toy import ROOT, RecordLosses, tiny_config

VARIABLES = ("NCCL_ALGO", "NVTE_ALLOW_NONDETERMINISTIC_ALGO", "CUBLAS_WORKSPACE_CONFIG")


@pytest.fixture(autouse=True)
def _torch_flags_restored(monkeypatch):
    """Lightning's switch sets process-wide torch flags that a later test would inherit; the
    environment starts without the variables (conftest restores it afterwards)."""
    for name in VARIABLES:
        monkeypatch.delenv(name, raising=False)
    before = (torch.are_deterministic_algorithms_enabled(),
              torch.is_deterministic_algorithms_warn_only_enabled(), torch.backends.cudnn.benchmark)
    yield
    torch.use_deterministic_algorithms(before[0], warn_only=before[1])
    torch.backends.cudnn.benchmark = before[2]


class RecordDeterminism(L.Callback):
    """Each rank writes what its run is set to once its model is built."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_fit_start(self, trainer, pl_module):
        from megatron.core.utils import get_model_config

        chunk = pl_module.chunks[0]
        config = get_model_config(chunk)
        inner = chunk.module if hasattr(chunk, "module") else chunk
        state = {
            "deterministic_mode": config.deterministic_mode,
            "cross_entropy_loss_fusion": config.cross_entropy_loss_fusion,
            "embedding_deterministic": inner.embedding.word_embeddings.deterministic_mode,
            "torch": torch.are_deterministic_algorithms_enabled(),
            "env": {name: os.environ.get(name) for name in VARIABLES},
        }
        self.out.with_suffix(f".rank{trainer.global_rank}.json").write_text(json.dumps(state))


def packed_rows() -> list[dict]:
    data = samples()
    return [build_row([data[i] for i in row], SEQ, pad_id=0) for row in pack(LENGTHS, SEQ)]


def sft_run(tmp_path: Path, name: str, devices: int = 2, accelerator: str = "cpu",
            config=None, start_method: str = "fork", precision: str = "32-true",
            **trainer_kwargs) -> tuple[list[float], list[dict]]:
    """2 SFT steps on 4 packed rows (TP=devices); rank 0's losses and every rank's state."""
    out = tmp_path / f"{name}.json"
    rows = packed_rows()
    trainer = L.Trainer(
        accelerator=accelerator, devices=devices, max_steps=2, logger=False, precision=precision,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[RecordLosses(out), RecordDeterminism(out)],
        strategy=MegatronStrategy(tensor_model_parallel_size=devices, global_batch_size=len(rows),
                                  micro_batch_size=2, start_method=start_method),
        **trainer_kwargs,
    )
    module = SFTModule(config or tiny_config(seq_length=SEQ), OptimizerSettings(lr=1e-2))
    trainer.fit(module, DataLoader(rows, batch_size=len(rows)))
    states = [json.loads(out.with_suffix(f".rank{r}.json").read_text()) for r in range(devices)]
    return json.loads(out.read_text()), states


@pytest.mark.distributed
def test_switch_reaches_every_rank_and_two_runs_are_bitwise_equal(tmp_path):
    first, states = sft_run(tmp_path, "first", deterministic=True)
    for state in states:
        assert state == {
            "deterministic_mode": True, "cross_entropy_loss_fusion": False,
            "embedding_deterministic": True, "torch": True,
            "env": {"NCCL_ALGO": "Ring", "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0",
                    "CUBLAS_WORKSPACE_CONFIG": ":4096:8"},
        }
    second, _ = sft_run(tmp_path, "second", deterministic=True)
    assert len(first) == 2 and first == second  # bitwise: floats compared with ==


@pytest.mark.distributed
def test_off_by_default(tmp_path):
    torch.use_deterministic_algorithms(False)  # as in a fresh process
    _, states = sft_run(tmp_path, "default")
    for state in states:
        assert state["deterministic_mode"] is False and state["torch"] is False
        assert state["embedding_deterministic"] is False
        assert state["env"] == {name: None for name in VARIABLES}


def test_environment_set_where_missing_kept_where_deterministic():
    env = {"CUBLAS_WORKSPACE_CONFIG": ":16:8", "NCCL_ALGO": "Ring,^NVLS"}
    determinism.set_environment(env)
    assert env == {"CUBLAS_WORKSPACE_CONFIG": ":16:8", "NCCL_ALGO": "Ring,^NVLS",
                   "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0"}


@pytest.mark.parametrize("name, value", [("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "1"),
                                         ("NCCL_ALGO", "Tree"), ("NCCL_ALGO", "Ring,Tree"),
                                         ("CUBLAS_WORKSPACE_CONFIG", ":0:0")])
def test_nondeterministic_user_value_refused_not_overwritten(name, value):
    env = {name: value}
    with pytest.raises(determinism.DeterminismError, match=f"{name}={value!r}"):
        determinism.set_environment(env)
    assert env == {name: value}


def test_cli_refuses_before_launch(monkeypatch, capsys):
    """The CLI's `trainer.deterministic: true` with TE told to allow non-deterministic kernels:
    one error line naming the variable, exit 2, no rank started, the variable left as set."""
    from lightning_mcore.cli import MegatronCLI

    monkeypatch.setenv("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "1")
    with pytest.raises(SystemExit) as exit_info:  # run=False: builds everything, fits nothing
        MegatronCLI(args=["--config", str(ROOT / "configs/quickstart.yaml"),
                          "--trainer.deterministic", "true"], run=False)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "error:" in err and "NVTE_ALLOW_NONDETERMINISTIC_ALGO='1'" in err, err
    assert os.environ["NVTE_ALLOW_NONDETERMINISTIC_ALGO"] == "1"


@pytest.mark.gpu
def test_gpu_te_two_runs_bitwise_equal(tmp_path):
    """Two identical short SFT runs through Transformer Engine (bf16, THD attention) give
    bitwise-equal losses. One process: a forked child cannot use CUDA once TE started here."""
    config = tiny_config(seq_length=SEQ, transformer_impl="transformer_engine")
    common = dict(devices=1, accelerator="gpu", config=config, start_method="popen",
                  precision="bf16-mixed", deterministic=True)
    first, states = sft_run(tmp_path, "first", **common)
    assert states[0]["deterministic_mode"] and states[0]["env"]["NVTE_ALLOW_NONDETERMINISTIC_ALGO"] == "0"
    second, _ = sft_run(tmp_path, "second", **common)
    assert len(first) == 2 and first == second
