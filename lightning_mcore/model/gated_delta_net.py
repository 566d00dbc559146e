"""Gated DeltaNet, the linear attention of Qwen3.5 and Qwen3-Next, in plain torch.

Per layer, for each value head, a state S [key_dim, value_dim] runs along the sequence:

    S <- exp(g_t) S                          decay, g_t = -exp(A_log) softplus(a_t + dt_bias)
    S <- S + k_t (beta_t (v_t - S^T k_t))^T  the delta rule, beta_t = sigmoid(b_t)
    o_t = S^T q_t / sqrt(key_dim)            then RMSNorm(o_t) * silu(z_t), and out_proj

q, k, v first pass a causal depthwise convolution (kernel conv_kernel_dim, silu) and q, k an
L2 norm; each query/key head serves num_value_heads / num_key_heads consecutive value heads.
Training and prefill use mcore's torch chunked form of the rule (exact, one chunk of 64 tokens
at a time), or on GPU flash-linear-attention's chunked Triton kernel where fla computes it
right (`fla_kernel`: fla installed and Triton >= 3.7.1; fla itself refuses its backward on
Hopper with older Triton); a cached decode step (generation/kv_cache.py) applies the update above
once, from the convolution window and the state kept in the inference context.

Parameter names and the sharded checkpoint layout are mcore's GatedDeltaNet's (whose own
module needs flash-linear-attention's GPU kernels even to be built, and has no cached decode);
the output norm is a plain RMSNorm, as transformers has it (mcore's is zero-centred). Tensor parallelism splits key and value heads; rank r's in_proj rows are

    [ q_r | k_r | v_r | z_r | b_r | a_r ]     q_r, k_r: nk/tp heads x dk; v_r, z_r: nv/tp x dv;
                                              b_r, a_r: nv/tp (one per value head)

and its conv1d channels [q_r | k_r | v_r]. Packed rows (THD) run each sequence on its own.
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.extensions.transformer_engine import (
    TELayerNormColumnParallelLinear,
    TENorm,
    TERowParallelLinear,
)
from megatron.core.ssm.gated_delta_net.common import torch_chunk_gated_delta_rule
from megatron.core.ssm.utils import _split_tensor_factory
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.utils import (
    ensure_metadata_has_dp_cp_group,
    make_sharded_tensors_for_checkpoint,
    sharded_state_dict_default,
)
from packaging.version import Version

from lightning_mcore.model import inference_context as ic
from lightning_mcore.model.norm import RMSNorm

IN_PROJ_SECTIONS = ("query", "key", "value", "z", "beta", "alpha")
L2NORM_EPS = 1e-6  # transformers' and flash-linear-attention's
A_INIT_RANGE = (1.0, 16.0)  # A = exp(A_log) drawn from it at initialisation, as mcore's


@dataclass
class GatedDeltaNetSubmodules:
    in_proj: Union[ModuleSpec, type] = IdentityOp
    out_norm: Union[ModuleSpec, type] = IdentityOp
    out_proj: Union[ModuleSpec, type] = IdentityOp


class GatedDeltaNet(MegatronModule):
    def __init__(self, config, submodules: GatedDeltaNetSubmodules, layer_number: int = 1,
                 pg_collection=None, **_unused) -> None:
        super().__init__(config=config)
        self.layer_number = layer_number
        tp_group = pg_collection.tp if pg_collection is not None else \
            parallel_state.get_tensor_model_parallel_group()
        tp = tp_group.size()
        self.tp_size = tp
        nk, nv = config.linear_num_key_heads, config.linear_num_value_heads
        if nk % tp or nv % tp or nv % nk:
            raise ValueError(f"linear attention: {nk} key and {nv} value heads do not split over "
                             f"tensor_model_parallel_size={tp} (or value heads are not a multiple "
                             f"of key heads).")
        self.key_heads, self.value_heads = nk // tp, nv // tp  # this rank's
        self.key_dim, self.value_dim = config.linear_key_head_dim, config.linear_value_head_dim
        self.kernel = config.linear_conv_kernel_dim
        qk, v = self.key_heads * self.key_dim, self.value_heads * self.value_dim
        self.sections = (qk, qk, v, v, self.value_heads, self.value_heads)
        self.conv_channels = 2 * qk + v
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()

        self.in_proj = build_module(
            submodules.in_proj, config.hidden_size, sum(self.sections) * tp, config=config,
            init_method=config.init_method, gather_output=False, bias=False, skip_bias_add=False,
            is_expert=False, tp_comm_buffer_name="fc1", tp_group=tp_group)
        self.conv1d = torch.nn.Conv1d(self.conv_channels, self.conv_channels, self.kernel,
                                      groups=self.conv_channels, bias=False, padding=self.kernel - 1,
                                      device=device, dtype=config.params_dtype)
        self.dt_bias = torch.nn.Parameter(torch.ones(self.value_heads, device=device,
                                                     dtype=config.params_dtype))
        self.A_log = torch.nn.Parameter(self._initial_a_log(nv, tp_group.rank()).to(
            device=device, dtype=config.params_dtype))
        for param in (self.conv1d.weight, self.dt_bias, self.A_log):
            param.tensor_model_parallel, param.partition_dim = True, 0
        # A plain RMSNorm (weight 1 at start) even where the model's other norms scale by
        # (1 + weight), as transformers' Qwen3.5 / Qwen3-Next: its weight then loads and exports
        # unchanged (mcore's own layer takes it zero-centred and subtracts 1 on conversion).
        plain = copy.copy(config)
        plain.layernorm_zero_centered_gamma = False
        self.out_norm = build_module(submodules.out_norm, config=plain, hidden_size=self.value_dim,
                                     eps=config.layernorm_epsilon)
        self.out_proj = build_module(
            submodules.out_proj, nv * self.value_dim, config.hidden_size, config=config,
            init_method=config.output_layer_init_method, bias=False, input_is_parallel=True,
            skip_bias_add=True, is_expert=False, tp_comm_buffer_name="fc2", tp_group=tp_group)

    def _initial_a_log(self, value_heads: int, rank: int) -> torch.Tensor:
        """log(A), A uniform in A_INIT_RANGE, drawn for all heads of the layer (the same at any
        tensor-parallel size, as model/init.py's weights), this rank's slice."""
        gen = torch.Generator().manual_seed(self.layer_number)
        full = torch.empty(value_heads, device="cpu").uniform_(*A_INIT_RANGE, generator=gen).log()
        return full.chunk(self.tp_size)[rank].clone()

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, inference_context=None,
                packed_seq_params=None, **_unused):
        """[s, b, h] (s / tp under sequence parallelism) -> ([s, b, h], None)."""
        projected, _ = self.in_proj(hidden_states)  # [s, b, local sections]
        projected = projected.transpose(0, 1)  # [b, s, .]
        qkv, z, b, a = torch.split(projected, (self.conv_channels, self.sections[3],
                                               self.value_heads, self.value_heads), dim=-1)
        state = None
        if inference_context is not None:
            state = ic.buffers(inference_context, self.layer_number)
            if ic.position(inference_context) == 0:  # a prefill starts from nothing
                for buffer in state:
                    buffer.zero_()
        if packed_seq_params is not None:
            cu = packed_seq_params.cu_seqlens_q.tolist()
            core = torch.cat([self._mix(qkv[:, s:e], b[:, s:e], a[:, s:e], None)
                              for s, e in zip(cu[:-1], cu[1:])], dim=1)
        else:
            core = self._mix(qkv, b, a, state)
        out = self._gated_norm(core, z).transpose(0, 1).contiguous()  # [s, b, nv * dv]
        out, bias = self.out_proj(out)
        return out, bias

    def _mix(self, qkv: torch.Tensor, b: torch.Tensor, a: torch.Tensor,
             state: Optional[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """The core output [batch, s, value_heads, value_dim] of one run of sequences; `state`
        (convolution window [batch, channels, kernel - 1], recurrent state [batch, value_heads,
        key_dim, value_dim]) is read and updated in place when given."""
        batch, s, _ = qkv.shape
        x = qkv.transpose(1, 2)  # [batch, channels, s]
        window = state[0] if state is not None else x.new_zeros(batch, self.conv_channels, self.kernel - 1)
        x = torch.cat([window.to(x.dtype), x], dim=-1)
        if state is not None:
            state[0].copy_(x[..., -(self.kernel - 1):])
        mixed = F.silu(F.conv1d(x, self.conv1d.weight, groups=self.conv_channels)).transpose(1, 2)
        qk = self.key_heads * self.key_dim
        q, k, v = torch.split(mixed, (qk, qk, self.value_heads * self.value_dim), dim=-1)
        repeat = self.value_heads // self.key_heads
        q, k = (_l2norm(t.reshape(batch, s, self.key_heads, self.key_dim).float())
                .repeat_interleave(repeat, dim=2) for t in (q, k))
        v = v.reshape(batch, s, self.value_heads, self.value_dim)
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        beta = b.sigmoid()
        previous = state[1] if state is not None else None
        kernel = fla_kernel() if v.is_cuda else None
        if previous is not None and s == 1:
            out, last = _recurrent_step(q, k, v, g, beta, previous)
        elif kernel is not None:
            out, last = kernel(q.to(v.dtype), k.to(v.dtype), v, g=g, beta=beta.to(v.dtype),
                               initial_state=previous, output_final_state=state is not None)
        else:
            out, last = torch_chunk_gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=previous,
                                                     output_final_state=state is not None)
        if state is not None:
            state[1].copy_(last)
        return out.to(v.dtype)

    def _gated_norm(self, core: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """RMSNorm over each head's values, times silu(z) (in float32), -> [b, s, heads * dim]."""
        batch, s = core.shape[:2]
        normed = self.out_norm(core.reshape(-1, self.value_dim))
        gated = normed * F.silu(z.reshape(-1, self.value_dim).float())
        return gated.to(core.dtype).reshape(batch, s, -1)

    def state_buffers(self, rows: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """Zeroed (convolution window, recurrent state) for `rows` cached sequences."""
        dtype = self.conv1d.weight.dtype
        return (torch.zeros(rows, self.conv_channels, self.kernel - 1, dtype=dtype, device=device),
                torch.zeros(rows, self.value_heads, self.key_dim, self.value_dim,
                            dtype=torch.float32, device=device))

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None, tp_group=None):
        """mcore's GatedDeltaNet layout: A_log, dt_bias and conv1d split over TP along dim 0;
        in_proj and conv1d stored as their sections (so a checkpoint reshards over TP)."""
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        tp_group = tp_group if tp_group is not None else parallel_state.get_tensor_model_parallel_group()
        own = {}
        self._save_to_state_dict(own, "", keep_vars=True)
        out = make_sharded_tensors_for_checkpoint(
            own, prefix, {"A_log": 0, "dt_bias": 0}, sharded_offsets, tp_group=tp_group,
            dp_cp_group=metadata["dp_cp_group"])
        for name, module in self.named_children():
            if name == "conv1d":
                out.update(make_sharded_tensors_for_checkpoint(
                    module.state_dict(prefix="", keep_vars=True), f"{prefix}conv1d.", {"weight": 0},
                    sharded_offsets, tp_group=tp_group, dp_cp_group=metadata["dp_cp_group"]))
            else:
                out.update(sharded_state_dict_default(module, f"{prefix}{name}.", sharded_offsets,
                                                      metadata, tp_group=tp_group))
        out[f"{prefix}in_proj.weight"] = _split_tensor_factory(
            out[f"{prefix}in_proj.weight"], list(self.sections), list(IN_PROJ_SECTIONS), 0)
        out[f"{prefix}conv1d.weight"] = _split_tensor_factory(
            out[f"{prefix}conv1d.weight"], list(self.sections[:3]), ["query", "key", "value"], 0)
        return out


@functools.lru_cache(maxsize=1)
def fla_kernel():
    """flash-linear-attention's chunk_gated_delta_rule where it is installed and its Triton is
    3.7.1 or newer (on Hopper, fla refuses the backward of older Triton: "incorrect results");
    None: mcore's torch form."""
    try:  # optional dependencies (flash-linear-attention and its Triton): absent, mcore's torch form
        import triton
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except Exception:
        return None
    return chunk_gated_delta_rule if Version(triton.__version__) >= Version("3.7.1") else None


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + L2NORM_EPS)


def _recurrent_step(q, k, v, g, beta, state):
    """One token ([b, 1, heads, dim] q/k/v, [b, 1, heads] g/beta) through the delta rule from
    `state` [b, heads, key_dim, value_dim]: (output [b, 1, heads, value_dim], new state)."""
    q, k, v = (t[:, 0].float() for t in (q, k, v))
    q = q * q.shape[-1] ** -0.5
    state = state * g[:, 0].float().exp()[..., None, None]
    remembered = (state * k[..., None]).sum(dim=-2)
    delta = (v - remembered) * beta[:, 0].float()[..., None]
    state = state + k[..., None] * delta[..., None, :]
    return (state * q[..., None]).sum(dim=-2)[:, None], state


def with_linear_attention(spec, use_te: bool):
    """A copy of layer spec `spec` with Gated DeltaNet in place of its self-attention (its input
    norm stays where the spec has it: fused into in_proj with TE, a separate RMSNorm without)."""
    if use_te:
        parts = GatedDeltaNetSubmodules(TELayerNormColumnParallelLinear, TENorm, TERowParallelLinear)
    else:
        parts = GatedDeltaNetSubmodules(ColumnParallelLinear, RMSNorm, RowParallelLinear)
    spec = copy.deepcopy(spec)
    spec.submodules.self_attention = ModuleSpec(module=GatedDeltaNet, submodules=parts)
    return spec
