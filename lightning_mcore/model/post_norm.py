"""Row-parallel linears followed by a norm of their output: the post-attention and
post-feedforward norms of Gemma 2/3 (`GPTConfig.post_norms`).

mcore's TransformerLayer adds linear_proj's (linear_fc2's) output to the residual as it is;
Gemma normalises it first. As in Megatron-Bridge, the norm lives in the linear, as
`linear_proj.post_layernorm` and `linear_fc2.post_layernorm`, applied after the linear's
all-reduce (under sequence parallelism its reduce-scatter): each rank normalises whole hidden
vectors of its tokens. The weight is replicated and marked like the other norms, so mcore sums
its gradient over TP under sequence parallelism.

The norm runs as a forward hook that the linear registers on itself; a hook whose result must
go through the norm (a LoRA update of the linear) registers in front of it (prepend=True).
"""

from __future__ import annotations

import copy
import dataclasses
import functools

from megatron.core.extensions.transformer_engine import TENorm, TERowParallelLinear
from megatron.core.tensor_parallel import RowParallelLinear
from megatron.core.transformer.mlp import MLPSubmodules

from lightning_mcore.model.norm import RMSNorm


def _normalise_output(module, args, output):
    out, bias = output
    return module.post_layernorm(out), bias


class _PostNorm:
    norm_class: type

    def __init__(self, input_size: int, output_size: int, *, config, **kwargs):
        if kwargs.get("bias"):
            raise ValueError("post norms after biased linears are not supported (the bias "
                             "would be added after the norm).")
        super().__init__(input_size, output_size, config=config, **kwargs)
        self.post_layernorm = self.norm_class(config, output_size, eps=config.layernorm_epsilon)
        self.register_forward_hook(_normalise_output)


class RowParallelLinearPostNorm(_PostNorm, RowParallelLinear):
    norm_class = RMSNorm


@functools.cache
def te_row_parallel_linear_post_norm() -> type:
    class TERowParallelLinearPostNorm(_PostNorm, TERowParallelLinear):
        norm_class = TENorm

    return TERowParallelLinearPostNorm


def with_post_norms(spec, use_te: bool):
    """A copy of a layer spec whose attention output projection and MLP down projection
    normalise their outputs."""
    spec = copy.deepcopy(spec)
    linear = te_row_parallel_linear_post_norm() if use_te else RowParallelLinearPostNorm
    spec.submodules.self_attention.submodules.linear_proj = linear
    spec.submodules.mlp = _with_fc2(spec.submodules.mlp, linear)
    return spec


def _with_fc2(mlp, linear):
    """The MLP spec (a functools.partial carrying `submodules`, as mcore's specs build MLPs)
    with `linear` as its down projection."""
    subs = mlp.keywords.get("submodules")
    if not isinstance(subs, MLPSubmodules):
        raise ValueError("post norms are supported on dense MLPs only, not mixtures of experts.")
    subs = dataclasses.replace(subs, linear_fc2=linear)
    return functools.partial(mlp.func, *mlp.args, **{**mlp.keywords, "submodules": subs})
