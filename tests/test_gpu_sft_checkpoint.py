"""GPU (Transformer Engine) checks of SFT packing and checkpoints; skipped without CUDA.

- Packed SFT through TE's THD attention equals the samples one per row (bf16, so a loose
  tolerance: both runs round differently).
- The distributed optimizer (TE's fused Adam) resumes exactly at DP=2 and reshards to DP=1.
"""

import pytest
import torch

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
