"""Multi-latent attention (DeepSeek-V2/V3) on mcore's MLASelfAttention.

    q  = q_up(norm(q_down(x)))          or q_proj(x) without q_lora_rank   [heads x (nope + rope)]
    kv = kv_down(x) = [latent | k_rope]   k, v = kv_up(norm(latent))        [heads x (nope + v)]
    RoPE on the rope part of q and on k_rope (one head, shared by all heads), as HF's
    `rope_interleave`: pairs (x0, x1), (x2, x3), ... (mcore de-interleaves, then rotates half).

Both layer specs keep one tensor-parallel layout (the weight tables have one): every projection
is column-parallel, the two down projections too (their outputs are gathered over TP, as mcore's
own local spec does), where mcore's TE spec would hold them whole on every rank.
"""

from __future__ import annotations

import copy
import functools

import torch
from megatron.core import parallel_state
from megatron.core.extensions.transformer_engine import TEColumnParallelLinear, TENorm
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.tensor_parallel.mappings import (
    gather_from_tensor_model_parallel_region,
    scatter_to_sequence_parallel_region,
)
from megatron.core.transformer.multi_latent_attention import MLASelfAttention

from lightning_mcore.model.attention import SDPAttention
from lightning_mcore.model.norm import RMSNorm

MLA_ROPE_TYPES = ("default", "yarn")


class LatentAttention(MLASelfAttention):
    """mcore's MLASelfAttention, built with the norms and projections its spec names.

    mcore 0.19 re-derives the q/kv norms from `qk_layernorm` (QKNormConfigResolver) and, without
    q_lora_rank, replaces linear_q_proj by a fused norm+linear: a norm on the query input that
    DeepSeek-V2-Lite does not have. The specs below already say where each norm is."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if self.config.tensor_model_parallel_size > 1:
            self.linear_kv_down_proj.register_forward_hook(_whole_kv_latent(self.config))

    def _resolve_qk_norm_config(self, submodules) -> dict:
        return dict(
            linear_q_proj=submodules.linear_q_proj,
            linear_q_up_proj=submodules.linear_q_up_proj,
            linear_kv_up_proj=submodules.linear_kv_up_proj,
            q_layernorm=submodules.q_layernorm,
            kv_layernorm=submodules.kv_layernorm,
        )


def _whole_kv_latent(config):
    """mcore gathers the column-parallel kv down projection's output over TP and uses the RoPE
    key part on every rank, each for its own heads: each rank's gradient of it holds only its
    heads' share, and the gather's backward keeps only the rank's own columns, so the key RoPE
    rows of the weight (and the layer input) miss the other ranks' heads. This hook gathers the
    output itself, as a replicated down projection would give it (mcore's TE spec uses one), so
    that mcore sums the RoPE key's gradient over TP: under sequence parallelism by gathering it
    over the sequence (sequence shard out of here), else by the all-reduce added here."""
    latent = config.kv_lora_rank

    def hook(module, args, output):
        out, bias = output
        whole = gather_from_tensor_model_parallel_region(out)
        if config.sequence_parallel:
            return scatter_to_sequence_parallel_region(whole), bias
        kv, k_rope = whole.split([latent, whole.shape[-1] - latent], dim=-1)
        return torch.cat([kv, _SumGradOverTP.apply(k_rope)], dim=-1), bias

    return hook


class _SumGradOverTP(torch.autograd.Function):
    """Identity forward; backward sums the gradient over tensor-parallel ranks. (mcore's
    copy_to_tensor_model_parallel_region does not for non-contiguous gradients, as a slice's
    is: it all-reduces a contiguous copy and returns the original.)"""

    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        torch.distributed.all_reduce(grad, group=parallel_state.get_tensor_model_parallel_group())
        return grad


def mla_config_kwargs(cfg) -> dict:
    """MLATransformerConfig fields for `cfg.mla` and its RoPE (HF's `rope_scaling` dict).

    YaRN as transformers computes it: cos/sin scaled by mscale(factor, mscale) /
    mscale(factor, mscale_all_dim) when both are set (else mscale(factor)), and the softmax
    scale by mscale(factor, mscale_all_dim)^2; mcore computes the same from these fields."""
    m = cfg.mla
    rope = dict(cfg.rope_scaling or {})
    kind = rope.get("rope_type", rope.get("type", "default"))
    out = dict(
        multi_latent_attention=True,
        q_lora_rank=m.q_lora_rank,
        kv_lora_rank=m.kv_lora_rank,
        qk_head_dim=m.qk_head_dim,
        qk_pos_emb_head_dim=m.qk_pos_emb_head_dim,
        v_head_dim=m.v_head_dim,
        rotary_base=cfg.rotary_base,
        apply_rope_fusion=False,  # mcore: MLA's fused RoPE is for training only, YaRN only
    )
    if kind == "default":
        return {**out, "rope_type": "rope", "rotary_scaling_factor": 1.0}
    if kind != "yarn":
        raise ValueError(f"multi-latent attention takes rope_type "
                         f"{' or '.join(MLA_ROPE_TYPES)}, not {kind!r}.")
    mscale, all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
    if all_dim and not mscale:
        # transformers: cos/sin by mscale(factor) alone, the softmax by mscale_all_dim
        raise ValueError(f"YaRN with mscale_all_dim={all_dim!r} and no mscale is not supported.")
    if rope.get("attention_factor") is not None:
        raise ValueError("YaRN with an explicit attention_factor is not supported.")
    if rope.get("truncate", True) is not True:
        raise ValueError("YaRN with truncate=False is not supported.")
    return {
        **out,
        "rope_type": "yarn",
        "rotary_scaling_factor": float(rope["factor"]),
        "original_max_position_embeddings": int(rope["original_max_position_embeddings"]),
        "beta_fast": float(rope.get("beta_fast") or 32),
        "beta_slow": float(rope.get("beta_slow") or 1),
        "mscale": float(mscale) if all_dim else 1.0,  # without mscale_all_dim HF ignores it
        "mscale_all_dim": float(all_dim or 0.0),
    }


def mla_layer_spec(cfg, use_te: bool, experts):
    """The layer spec of an MLA layer (`experts`: its MoE expert count, None for a dense MLP)."""
    eps = cfg.mla.latent_norm_epsilon
    own_eps = eps is not None and eps != cfg.norm_epsilon  # mcore builds them with the layers' eps
    if use_te:
        spec = copy.deepcopy(get_gpt_layer_with_transformer_engine_spec(
            num_experts=experts, moe_grouped_gemm=cfg.mcore_grouped_gemm, qk_layernorm=True,
            multi_latent_attention=True))
        attn = spec.submodules.self_attention
        attn.module = LatentAttention
        sub = attn.submodules
        sub.linear_q_down_proj = sub.linear_kv_down_proj = TEColumnParallelLinear
        if own_eps:  # else the q/kv norms are fused into the up projections (layer_norm_weight)
            sub.linear_q_up_proj = sub.linear_kv_up_proj = TEColumnParallelLinear
            sub.q_layernorm = sub.kv_layernorm = _with_eps(_TENormFactory, eps, TENorm=TENorm)
        return spec

    spec = copy.deepcopy(get_gpt_layer_local_spec(
        num_experts=experts, moe_grouped_gemm=cfg.mcore_grouped_gemm, qk_layernorm=True,
        multi_latent_attention=True, normalization="RMSNorm"))
    sub = spec.submodules
    sub.input_layernorm = RMSNorm
    sub.pre_mlp_layernorm = RMSNorm
    sub.self_attention.module = LatentAttention
    attn = sub.self_attention.submodules
    attn.core_attention = SDPAttention
    attn.q_layernorm = attn.kv_layernorm = _with_eps(_LatentRMSNorm, eps) if own_eps else RMSNorm
    return spec


class _LatentRMSNorm(RMSNorm):
    """Our RMSNorm with the latent norms' own eps (the class's `latent_eps`), whatever mcore
    passes."""

    latent_eps = 1e-6

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_unused):
        super().__init__(config, hidden_size, eps=self.latent_eps)


class _TENormFactory:
    """Transformer Engine's norm (a factory too) with the latent norms' own eps."""

    latent_eps, TENorm = 1e-6, None

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **_unused):
        return cls.TENorm(config, hidden_size, eps=cls.latent_eps)


@functools.lru_cache(maxsize=None)
def _with_eps(base: type, eps: float, **attrs) -> type:
    """`base` with `latent_eps` = eps: mcore builds specs' norms from classes (and calls them
    with the layers' eps), so the eps travels in the class."""
    return type(base.__name__, (base,), {"latent_eps": eps, **attrs})
