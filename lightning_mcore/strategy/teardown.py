"""Tearing mcore's parallel state down so that the process can start another run."""

from __future__ import annotations

import torch.distributed as dist
from megatron.core import parallel_state


def destroy_model_parallel() -> None:
    """mcore's destroy_model_parallel, and the globals it forgets (the intra-partial
    data-parallel groups and several global-rank lists). A process that forks ranks afterwards
    (an export in a notebook, then fit) would hand them the destroyed groups, and their group
    creation would wait forever."""
    parallel_state.destroy_model_parallel()
    for name, value in vars(parallel_state).items():
        if name.startswith("_") and name.isupper() and (
                isinstance(value, dist.ProcessGroup) or name.endswith("_RANKS")):
            setattr(parallel_state, name, None)
