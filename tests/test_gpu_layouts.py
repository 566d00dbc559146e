"""GPU layouts that need Transformer Engine: context parallelism (ring attention over 2 GPUs,
each holding 2 of 4 sequence chunks) trains like data parallelism on the same global batch."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.distributed,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")]


def test_context_parallel_equals_data_parallel(tmp_path):
    here = Path(__file__).parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(here), os.environ.get("PYTHONPATH", "")])}
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                    str(here / "gpu_layouts_script.py"), str(tmp_path)], env=env, check=True)
    runs = json.loads((tmp_path / "losses.json").read_text())
    dp2, cp2 = runs["dp2"], runs["cp2"]
    assert len(cp2) == len(dp2) == 4
    for got, want in zip(cp2, dp2):  # bf16: the two layouts round differently
        assert abs(got - want) <= 2e-3 * want, (cp2, dp2)
    assert dp2[-1] < dp2[0]  # and the runs trained
