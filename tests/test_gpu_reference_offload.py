"""GPU check of offload_reference (issue 22); skipped without CUDA.

DPO on one GPU through Transformer Engine (bf16), frozen reference (no LoRA), 3 steps: with the
reference kept in pinned CPU memory and brought to the GPU for each reference pass, the per-step
losses equal bitwise those of the reference kept on the GPU; after fit its weights are in CPU
memory (pinned), in the same Parameter objects, and each pass ran on copies on the GPU.
"""

import pytest
import torch

from test_dpo import SEQ
from test_reference_offload import check_runs, run_dpo
from toy import tiny_config

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(autouse=True)
def _torch_flags_restored():
    """Trainer(deterministic=True) sets process-wide torch flags a later test would inherit (the
    environment it sets is restored by conftest)."""
    before = (torch.are_deterministic_algorithms_enabled(),
              torch.is_deterministic_algorithms_warn_only_enabled(), torch.backends.cudnn.benchmark)
    yield
    torch.use_deterministic_algorithms(before[0], warn_only=before[1])
    torch.backends.cudnn.benchmark = before[2]


def test_gpu_offloaded_reference_gives_bitwise_equal_losses(tmp_path):
    """One process (popen, one device): a forked child cannot use CUDA once TE started here.
    deterministic=True, so that two runs can be equal bitwise at all (as SFT reruns are)."""
    config = tiny_config(seq_length=SEQ, transformer_impl="transformer_engine")
    common = dict(config=config, accelerator="gpu", precision="bf16-mixed", start_method="popen",
                  deterministic=True)
    kept = run_dpo(tmp_path, "kept", False, **common)
    offloaded = run_dpo(tmp_path, "offloaded", True, **common)
    check_runs(kept, offloaded, f"cuda:{torch.cuda.current_device()}")
    assert offloaded["end"]["pinned"] and not kept["end"]["pinned"]
