import os
from unittest import mock

# Ranks are forked from this process. An OpenMP pool with >1 thread in the parent deadlocks
# forked children (seen in torch.zeros), and Lightning raises the thread count unless
# OMP_NUM_THREADS is set; one thread per rank also suits 2 cores.
os.environ["OMP_NUM_THREADS"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# GPU tests compare fp32 with transformers' fp32: Transformer Engine runs fp32 GEMMs in TF32
# unless this is set before CUDA starts (Gemma 3's tiny model: 8e-3 off with TF32, 4e-6 without).
os.environ.setdefault("NVIDIA_TF32_OVERRIDE", "0")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _each_test_starts_clean():
    """What a test leaves in this process, later tests' forked ranks would inherit:
    - the environment: an in-process CLI call seeds (PL_GLOBAL_SEED, which Lightning's ranks
      re-seed from) and a launch sets MASTER_PORT / WORLD_SIZE; it is restored after each test;
    - a default process group and mcore's parallel state, left by tests that train in this very
      process (GPU tests with one device): the next test that starts its own would fail
      ("initialize the default process group twice"). They are torn down."""
    with mock.patch.dict(os.environ):
        yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
