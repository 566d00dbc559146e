"""Tearing mcore's parallel state down so that the process can start another run."""

from __future__ import annotations

import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.models.common.embeddings import rotary_pos_embedding, yarn_rotary_pos_embedding


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
    clear_rotary_caches()


def clear_rotary_caches() -> None:
    """Empty mcore's caches of rotary embeddings (functools.lru_cache on RotaryEmbedding.forward
    and YarnRotaryEmbedding.forward, 32 entries each), whose keys hold the module and its
    context-parallel process group: a finished run's groups stay referenced there. A rank forked
    afterwards (tests, notebooks) that evicts such an entry drops the last reference to a group of
    the launching process, whose destructor joins threads that did not come across the fork: the
    rank hung for good in ~ProcessGroupGloo (a CI run of session 28)."""
    for module in (rotary_pos_embedding, yarn_rotary_pos_embedding):
        for value in vars(module).values():  # the module's own classes' methods and functions
            if getattr(value, "__module__", None) != module.__name__:
                continue
            for attr in vars(value).values() if isinstance(value, type) else (value,):
                if callable(getattr(attr, "cache_clear", None)):
                    attr.cache_clear()
