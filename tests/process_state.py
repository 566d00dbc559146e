"""What a run in the pytest process leaves behind, undone (tests/conftest.py after each test;
module-scoped fixtures that train in this process, around their run)."""

import contextlib
import os
from unittest import mock


@contextlib.contextmanager
def leaves_no_process_state():
    """- the environment: an in-process CLI call seeds (PL_GLOBAL_SEED, which Lightning's ranks
      re-seed from) and a launch sets MASTER_PORT / WORLD_SIZE; later forked ranks would inherit
      them (and hang on a stale rendezvous): restored;
    - a default process group and mcore's parallel state, left by runs in this very process: the
      next run that starts its own would fail ("initialize the default process group twice"):
      torn down."""
    with mock.patch.dict(os.environ):
        yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        from lightning_mcore.strategy.teardown import destroy_model_parallel

        destroy_model_parallel()
        dist.destroy_process_group()
