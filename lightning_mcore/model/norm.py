"""RMSNorm for mcore's local layer spec that also works under sequence parallelism.

mcore's WrappedTorchNorm refuses sequence_parallel (it expects Apex). The norm itself needs
nothing special: each rank normalises its own sequence slice; only the weight's gradient must
be summed over tensor-parallel ranks, which mcore's finalize_model_grads does for parameters
marked `sequence_parallel=True`.

With `layernorm_zero_centered_gamma` (Gemma) the weight is stored centred on zero and the norm
scales by (1 + weight), computed in fp32 and cast back as transformers does (TE's RMSNorm takes
the same flag itself); the weight then starts at zero.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class RMSNorm(torch.nn.RMSNorm):
    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_unused):
        super().__init__(hidden_size, eps=eps, dtype=config.params_dtype)
        self.weight.sequence_parallel = bool(config.sequence_parallel)
        self.zero_centered = bool(getattr(config, "layernorm_zero_centered_gamma", False))
        if self.zero_centered:
            with torch.no_grad():
                self.weight.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.zero_centered:
            return super().forward(x)
        normed = F.rms_norm(x.float(), self.normalized_shape, eps=self.eps)
        return (normed * (1.0 + self.weight.float())).type_as(x)
