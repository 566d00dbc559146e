"""GPU (Transformer Engine) checks of SFT packing and checkpoints; skipped without CUDA.

- Packed SFT through TE's THD attention equals the samples one per row (bf16, so a loose
  tolerance: both runs round differently).
- The distributed optimizer (TE's fused Adam) resumes exactly at DP=2 and reshards to DP=1.
- With Adam in CPU memory (optimizer cpu_offload) it resumes exactly on 1 GPU.
"""

import dataclasses

import lightning as L
import pytest
import torch

from lightning_mcore import OptimizerSettings
from lightning_mcore.data.packing import build_row, pack
from lightning_mcore.objectives.sft import SFTModule
from test_sft_packing import LENGTHS, SEQ, run, samples
from toy import fit_with_checkpoints, tiny_config

pytestmark = [pytest.mark.gpu, pytest.mark.distributed]


def te_config(**overrides):
    return tiny_config(transformer_impl="transformer_engine", **overrides)


def test_packed_sft_with_te_thd_equals_one_sample_per_row(tmp_path, monkeypatch):
    from lightning_mcore import PretrainModule

    monkeypatch.setenv("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")
    data = samples()
    packed = [build_row([data[i] for i in row], SEQ, pad_id=0) for row in pack(LENGTHS, SEQ)]
    single = [{k: v for k, v in build_row([s], SEQ, pad_id=0).items() if k != "segment_ids"} for s in data]
    # One process, no launcher: a forked child cannot use CUDA once TE has initialised it here.
    common = dict(config=te_config(seq_length=SEQ), accelerator="gpu", precision="bf16-mixed",
                  start_method="popen")
    ref_loss, ref = run(tmp_path, "reference", single, PretrainModule, **common)
    loss, got = run(tmp_path, "packed", packed, SFTModule, **common)
    assert abs(loss - ref_loss) <= 5e-3 * ref_loss, (loss, ref_loss)
    cross_loss, _ = run(tmp_path, "cross", packed, PretrainModule, **common)
    assert abs(cross_loss - ref_loss) > 10 * abs(loss - ref_loss), (cross_loss, loss, ref_loss)
    for key in ref:
        torch.testing.assert_close(got[key], ref[key], rtol=0, atol=2e-2, msg=key)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_distributed_optimizer_resumes_exactly_and_reshards(tmp_path, monkeypatch):
    """2 ranks under torchrun (straight / stopped at 3 / resumed), then DP=1 in this process."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    here = Path(__file__).parent
    env = {**os.environ, "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0",
           "PYTHONPATH": os.pathsep.join([str(here), os.environ.get("PYTHONPATH", "")])}
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                    str(here / "gpu_resume_script.py"), str(tmp_path)], env=env, check=True)
    runs = json.loads((tmp_path / "losses.json").read_text())
    straight = runs["straight"]
    assert runs["first"] == straight[:3]
    for got, want in zip(runs["resumed"], straight[3:]):
        assert abs(got - want) <= 1e-6 * abs(want), (runs["resumed"], straight[3:])
    monkeypatch.setenv("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")
    saved = str(tmp_path / "first-ckpts" / "epoch=0-step=3.ckpt")
    dp1 = fit_with_checkpoints(tmp_path, "dp1", 1, ckpt_path=saved, start_method="popen",
                               config=tiny_config(vocab_size=512, transformer_impl="transformer_engine"),
                               accelerator="gpu", use_distributed_optimizer=True)
    for got, want in zip(dp1, straight[3:]):
        assert abs(got - want) <= 1e-4 * abs(want), (dp1, straight[3:])


class OptimizerPlacement(L.Callback):
    """After fit: the class of the torch optimizer inside mcore's (distributed) optimizer and the
    devices Adam's moments are on."""

    def __init__(self) -> None:
        self.kinds, self.devices = set(), set()

    def on_train_end(self, trainer, pl_module):
        for part in trainer.optimizers[0].parts:  # mcore's optimizers behind ours
            self.kinds.add(type(part.optimizer).__name__)
            self.devices |= {value.device.type for state in part.optimizer.state.values()
                             for key, value in state.items() if key in ("exp_avg", "exp_avg_sq")}


@pytest.mark.parametrize("warmup", [2, 0], ids=["warmup", "no-warmup"])
def test_optimizer_offload_resumes_exactly(tmp_path, monkeypatch, warmup):
    """Adam's state and update in CPU memory (cpu_offload: mcore's HybridDeviceOptimizer inside
    the distributed optimizer), bf16, 1 GPU: stopped at step 3 and resumed equals 6 straight steps.
    Without warmup the LR is not 0 while the checkpoint loads, when mcore steps the offloaded Adam
    once on random gradients to allocate its state (MegatronOptimizer._load_without_moving).

    Against Adam on the GPU: the same AdamW (decoupled weight decay, bias correction) in fp32, TE's
    fused kernel there, torch's fused CPU kernel here; they round differently (last bits of the
    fp32 master weights, now and then one bf16 step of a weight), far below 1e-3 of the loss,
    while training moves the loss by several percent: an offload that skipped or garbled
    updates (e.g. never copied them back to the GPU weights) would be off by more."""
    monkeypatch.setenv("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")
    common = dict(config=te_config(vocab_size=512), accelerator="gpu", start_method="popen",
                  precision="bf16-mixed", use_distributed_optimizer=True)
    offload = OptimizerSettings(lr=1e-3, warmup_steps=warmup, cpu_offload=True, offload_fraction=1.0)
    straight_at, resumed_at, on_gpu_at = OptimizerPlacement(), OptimizerPlacement(), OptimizerPlacement()
    straight = fit_with_checkpoints(tmp_path, "straight", 1, optim=offload, callbacks=[straight_at], **common)
    first = fit_with_checkpoints(tmp_path, "first", 1, stop=3, optim=offload, **common)
    saved = str(tmp_path / "first-ckpts" / "epoch=0-step=3.ckpt")
    resumed = fit_with_checkpoints(tmp_path, "resumed", 1, ckpt_path=saved, optim=offload,
                                   callbacks=[resumed_at], **common)
    on_gpu = fit_with_checkpoints(tmp_path, "on-gpu", 1, optim=dataclasses.replace(offload, cpu_offload=False),
                                  callbacks=[on_gpu_at], **common)

    for where in (straight_at, resumed_at):  # offloaded, all of it (offload_fraction=1.0)
        assert where.kinds == {"HybridDeviceOptimizer"} and where.devices == {"cpu"}, vars(where)
    assert "HybridDeviceOptimizer" not in on_gpu_at.kinds and on_gpu_at.devices == {"cuda"}, vars(on_gpu_at)

    assert len(straight) == 6 and len(resumed) == 3, (straight, resumed)
    assert first == straight[:3]
    for got, want in zip(resumed, straight[3:]):
        assert abs(got - want) <= 1e-6 * abs(want), (resumed, straight[3:])

    assert straight[0] == on_gpu[0]  # the same weights and batch before any update
    for got, want in zip(straight, on_gpu):
        assert abs(got - want) <= 1e-3 * abs(want), (straight, on_gpu)
    assert max(abs(x - on_gpu[0]) for x in on_gpu) > 5e-3 * on_gpu[0], on_gpu  # training moved it
