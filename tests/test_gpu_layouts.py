"""GPU layouts that need Transformer Engine: context parallelism (ring attention over 2 GPUs,
each holding 2 of 4 sequence chunks) trains like data parallelism on the same global batch,
for plain rows and for packed (THD) SFT."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.distributed,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")]


def torchrun_two_gpus(script: str, tmp_path) -> None:
    """`script` (next to this file) under torchrun on 2 processes; it writes into tmp_path."""
    here = Path(__file__).parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(here), os.environ.get("PYTHONPATH", "")])}
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                    str(here / script), str(tmp_path)], env=env, check=True)


def test_context_parallel_equals_data_parallel(tmp_path):
    torchrun_two_gpus("gpu_layouts_script.py", tmp_path)
    runs = json.loads((tmp_path / "losses.json").read_text())
    dp2, cp2 = runs["dp2"], runs["cp2"]
    assert len(cp2) == len(dp2) == 4
    for got, want in zip(cp2, dp2):  # bf16: the two layouts round differently
        assert abs(got - want) <= 2e-3 * want, (cp2, dp2)
    assert dp2[-1] < dp2[0]  # and the runs trained


def test_packed_sft_context_parallel_equals_cp1(tmp_path):
    """Packed SFT under context parallelism (every sequence padded to a multiple of 2*cp, split
    over the cp ranks in TE's order: model/packing.py packed_context_parallel_slice) trains like
    CP=1 on the same global batch: same losses and grad norms over 5 steps, within bf16 rounding."""
    torchrun_two_gpus("gpu_sft_cp_script.py", tmp_path)
    runs = json.loads((tmp_path / "runs.json").read_text())
    cp1, cp2 = runs["cp1"], runs["cp2"]
    assert len(cp1) == len(cp2) == 5
    for (loss2, norm2), (loss1, norm1) in zip(cp2, cp1):  # bf16: the layouts round differently
        assert abs(loss2 - loss1) <= 2e-3 * loss1, (cp2, cp1)
        assert norm1 is not None and abs(norm2 - norm1) <= 2e-2 * norm1, (cp2, cp1)
    assert cp1[-1][0] < cp1[0][0]  # and the runs trained
