"""Deterministic runs: Lightning's `Trainer(deterministic=True)` carried into mcore, TE and NCCL.

Lightning's switch calls `torch.use_deterministic_algorithms(True)` in every process (its spawn
launcher carries the flag over; popen ranks rebuild the Trainer) and sets
CUBLAS_WORKSPACE_CONFIG. It keeps no record of the switch itself, so the strategy reads torch's
`torch.are_deterministic_algorithms_enabled()` when the Trainer builds it and then:

- sets mcore's `deterministic_mode` in the TransformerConfig (a deterministic embedding
  backward; TE's attention refuses to build without NVTE_ALLOW_NONDETERMINISTIC_ALGO=0) and
  turns off the cross-entropy loss fusion (Megatron-LM's --deterministic-mode requires it off);
- sets the environment below in the launching process, before any rank starts, as Megatron-LM's
  `megatron/training/determinism.py` does. Each library reads its variable once (NCCL when a
  communicator starts, cuBLAS when its handle is made, TE at the first attention), so it must be
  there before then. A value the user set is kept when it is one of the deterministic ones and
  refused otherwise (never overwritten; Lightning itself overwrites CUBLAS_WORKSPACE_CONFIG).
"""

from __future__ import annotations

import os
from typing import MutableMapping

import torch

ENVIRONMENT = {
    "NCCL_ALGO": "Ring",  # a fixed reduction order; Tree's depends on the topology
    "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0",  # TE picks deterministic attention kernels
    "CUBLAS_WORKSPACE_CONFIG": ":4096:8",  # cuBLAS's documented reproducible workspaces
}
# What Megatron-LM (0.19's determinism.py) accepts as deterministic when a launcher set it.
ACCEPTED = {
    "NVTE_ALLOW_NONDETERMINISTIC_ALGO": {"0"},
    "CUBLAS_WORKSPACE_CONFIG": {":4096:8", ":16:8"},
}
ACCEPTED_NCCL_ALGOS = {"Ring", "CollnetDirect", "CollnetChain", "^NVLS"}


class DeterminismError(ValueError):
    """An environment variable set to a value that makes a deterministic run non-deterministic."""


def requested() -> bool:
    """Whether this process runs deterministically (Trainer(deterministic=True or "warn"))."""
    return torch.are_deterministic_algorithms_enabled()


def set_environment(env: MutableMapping[str, str] = os.environ) -> None:
    """Check the deterministic variables the user set, then set the missing ones."""
    for name, accepted in ACCEPTED.items():
        value = env.get(name)
        if value is not None and value not in accepted:
            raise DeterminismError(
                f"Trainer(deterministic=True) needs {name} in {sorted(accepted)}, but the "
                f"environment sets {name}={value!r}: unset it or set {name}={ENVIRONMENT[name]}."
            )
    algo = env.get("NCCL_ALGO")
    if algo is not None:
        tokens = [t.strip() for t in algo.split(",") if t.strip()]
        if not tokens or not set(tokens) <= ACCEPTED_NCCL_ALGOS:
            raise DeterminismError(
                f"Trainer(deterministic=True) needs NCCL algorithms with a fixed reduction order "
                f"({', '.join(sorted(ACCEPTED_NCCL_ALGOS))}), but the environment sets "
                f"NCCL_ALGO={algo!r}: unset it or set NCCL_ALGO=Ring."
            )
    for name, value in ENVIRONMENT.items():
        env.setdefault(name, value)


def make_deterministic(config) -> None:
    """mcore's deterministic execution in a built TransformerConfig (its __post_init__ checks
    neither field against others: setting them afterwards is the same)."""
    config.deterministic_mode = True
    config.cross_entropy_loss_fusion = False
