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


def test_packed_sft_and_dpo_context_parallel_equal_cp1(tmp_path):
    """Packed SFT under context parallelism (every sequence padded to a multiple of 2*cp, split
    over the cp ranks in TE's order: sequence/packing.py packed_context_parallel_slice) trains like
    CP=1 on the same global batch: same losses and grad norms over 5 steps, within bf16 rounding;
    the same samples one per row (plain causal path) at CP=2 give the packed losses too; DPO's
    policy and reference log-probs (its rewards) at CP=2 equal CP=1."""
    torchrun_two_gpus("gpu_sft_cp_script.py", tmp_path)
    runs = json.loads((tmp_path / "runs.json").read_text())
    cp1, cp2, single = runs["cp1"], runs["cp2"], runs["single_cp2"]
    assert len(cp1) == len(cp2) == len(single) == 5
    for (loss2, norm2), (loss1, norm1), (loss_single, _) in zip(cp2, cp1, single):
        # bf16: the layouts round differently
        assert abs(loss2 - loss1) <= 2e-3 * loss1, (cp2, cp1)
        assert norm1 is not None and abs(norm2 - norm1) <= 2e-2 * norm1, (cp2, cp1)
        assert abs(loss_single - loss2) <= 2e-3 * loss2, (single, cp2)
    assert cp1[-1][0] < cp1[0][0]  # and the runs trained

    names = runs["dpo_metrics"] + ["grad_norm"]
    dpo1, dpo2 = runs["dpo_cp1"], runs["dpo_cp2"]
    assert len(dpo1) == len(dpo2) == 3
    for step, (got, want) in enumerate(zip(dpo2, dpo1)):
        for name, a, b in zip(names, got, want):
            if name == "rewards/accuracies":
                continue  # a count of near-ties
            scale = 2e-2 if name in ("grad_norm", "rewards/chosen", "rewards/rejected", "rewards/margins") else 2e-3
            assert abs(a - b) <= scale * max(abs(b), 0.05), (step, name, a, b)
    chosen = names.index("logps/chosen")
    assert dpo1[0][chosen] < -10  # real sums of response log-probs, not zeros
    assert dpo1[-1][names.index("loss")] < dpo1[0][names.index("loss")]
