"""RMSNorm for mcore's local layer spec that also works under sequence parallelism.

mcore's WrappedTorchNorm refuses sequence_parallel (it expects Apex). The norm itself needs
nothing special: each rank normalises its own sequence slice; only the weight's gradient must
be summed over tensor-parallel ranks, which mcore's finalize_model_grads does for parameters
marked `sequence_parallel=True`.
"""

from __future__ import annotations

import torch


class RMSNorm(torch.nn.RMSNorm):
    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_unused):
        super().__init__(hidden_size, eps=eps, dtype=config.params_dtype)
        self.weight.sequence_parallel = bool(config.sequence_parallel)
