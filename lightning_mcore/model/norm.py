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
from megatron.core import parallel_state

from lightning_mcore.model.group_sum import sum_over_group


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


class ProjectionRMSNorm(torch.nn.Module):
    """RMSNorm over a token's whole query (or key) projection, all heads together
    (`heads_of` "q": num_attention_heads x head_dim values, "k": num_query_groups x head_dim),
    where mcore's q/k norms normalise each head by itself. Under tensor parallelism a rank holds
    some of the heads: the sum of squares is all-reduced over the tensor-parallel group (and its
    gradient with it). The weight is kept whole on every rank, each using its heads' slice: the
    other slices get zero gradient there, and mcore's finalize_model_grads sums q/k layernorm
    gradients over tensor-parallel ranks, which completes every slice.

        x [.., local heads, head_dim]  ->  x / rms(all heads of the token) * weight[local slice]
    """

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, heads_of: str = "q", **_unused):
        super().__init__()
        heads = config.num_attention_heads if heads_of == "q" else config.num_query_groups
        self.size, self.eps = heads * hidden_size, eps
        self.weight = torch.nn.Parameter(torch.ones(self.size, dtype=config.params_dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        group = parallel_state.get_tensor_model_parallel_group()
        tp, rank = torch.distributed.get_world_size(group), torch.distributed.get_rank(group)
        local = x.shape[-2] * x.shape[-1]
        if local * tp != self.size:
            raise ValueError(f"ProjectionRMSNorm of {self.size} values got {x.shape[-2]} heads x "
                             f"{x.shape[-1]} on each of {tp} tensor-parallel ranks.")
        squares = x.float().pow(2).sum(dim=(-2, -1), keepdim=True)
        if tp > 1:
            squares = sum_over_group(squares, group)
        normed = x.float() * torch.rsqrt(squares / self.size + self.eps)
        weight = self.weight[rank * local:(rank + 1) * local].view(x.shape[-2:])
        return weight * normed.to(x.dtype)
