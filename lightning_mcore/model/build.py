"""Build mcore GPTModel chunks for this rank: one per virtual pipeline stage.

    pp=2, vpp=2, 8 layers:   rank 0 holds chunks [layers 0-1] and [layers 4-5]
                             rank 1 holds chunks [layers 2-3] and [layers 6-7]
    pre_process (embedding) only on the first chunk of stage 0, post_process (final norm,
    output layer, loss) only on the last chunk of the last stage.
"""

from __future__ import annotations

import copy
import functools
from typing import Optional

import torch
from megatron.core import parallel_state
from megatron.core.extensions.transformer_engine import TENorm
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from lightning_mcore.model import fp32_logits
from lightning_mcore.model.attention import SDPAttention
from lightning_mcore.model.config import GPTConfig
from lightning_mcore.model.gated_delta_net import with_linear_attention
from lightning_mcore.model.layer_rope import add_local_rope, with_layer_rope
from lightning_mcore.model.mla import mla_layer_spec
from lightning_mcore.model.mrope import use_mrope
from lightning_mcore.model.norm import ProjectionRMSNorm, RMSNorm
from lightning_mcore.model.post_norm import with_post_norms
from lightning_mcore.model.rope import apply_rope_scaling
from lightning_mcore.model.torch_experts import with_torch_experts


def layer_spec(cfg: GPTConfig, use_te: bool, moe: Optional[bool] = None):
    """TE spec on GPU; else mcore's local spec with SDPA attention and an SP-capable RMSNorm.
    `moe`: whether this layer's MLP is a mixture of experts (default: the model has experts)."""
    experts = cfg.num_moe_experts if (moe is None or moe) else None
    spec = _mcore_layer_spec(cfg, use_te, experts)
    return with_torch_experts(spec) if experts and cfg.torch_experts else spec


def _mcore_layer_spec(cfg: GPTConfig, use_te: bool, experts: Optional[int]):
    spec = _mcore_spec(cfg, use_te, experts)
    if cfg.qk_norm_across_heads:
        spec = copy.deepcopy(spec)
        attn = spec.submodules.self_attention.submodules
        attn.q_layernorm = functools.partial(ProjectionRMSNorm, heads_of="q")
        attn.k_layernorm = functools.partial(ProjectionRMSNorm, heads_of="k")
    return spec


def _mcore_spec(cfg: GPTConfig, use_te: bool, experts: Optional[int]):
    if cfg.mla is not None:
        return mla_layer_spec(cfg, use_te, experts)
    if use_te:
        return get_gpt_layer_with_transformer_engine_spec(
            num_experts=experts,
            moe_grouped_gemm=cfg.mcore_grouped_gemm,
            qk_layernorm=cfg.qk_layernorm,
        )
    spec = copy.deepcopy(
        get_gpt_layer_local_spec(
            num_experts=experts,
            moe_grouped_gemm=cfg.mcore_grouped_gemm,
            qk_layernorm=cfg.qk_layernorm,
            normalization="RMSNorm",
        )
    )
    sub = spec.submodules
    sub.input_layernorm = RMSNorm
    sub.pre_mlp_layernorm = RMSNorm
    attn = sub.self_attention.submodules
    attn.core_attention = SDPAttention
    if cfg.qk_layernorm:
        attn.q_layernorm = RMSNorm
        attn.k_layernorm = RMSNorm
    return spec


def block_spec(cfg: GPTConfig, tf_config, use_te: bool, vp_stage: Optional[int]):
    """The layer specs of one chunk (layers differ in MLP kind, attention window, ...) and
    its final norm."""
    first = get_transformer_layer_offset(tf_config, vp_stage=vp_stage)
    n = get_num_layers_to_build(tf_config, vp_stage=vp_stage)
    layers = range(first, first + n)
    specs = [layer_spec(cfg, use_te, moe=cfg.is_moe_layer(i)) for i in layers]
    specs = [with_linear_attention(s, use_te) if cfg.is_linear_attention_layer(i) else s
             for s, i in zip(specs, layers)]
    if cfg.post_norms:
        specs = [with_post_norms(s, use_te) for s in specs]
    if cfg.local_rotary_base is not None:
        specs = [with_layer_rope(s, local=cfg.is_window_layer(i)) for s, i in zip(specs, layers)]
    return TransformerBlockSubmodules(layer_specs=specs, layer_norm=final_norm(use_te))


def final_norm(use_te: bool):
    if use_te:
        return TENorm
    return RMSNorm


def build_chunks(cfg: GPTConfig, tf_config, use_te: bool, padded_vocab: Optional[int] = None,
                 fuse_wgrad: Optional[bool] = None) -> list[GPTModel]:
    """The GPTModel chunks this rank owns, in virtual-stage order (`padded_vocab`: the
    embedding rows, by default the vocab padded for this tensor-parallel size; `fuse_wgrad`:
    see fuse_wgrad_accumulation, on by default with TE)."""
    fuse_wgrad = use_te if fuse_wgrad is None else fuse_wgrad
    vpp = tf_config.virtual_pipeline_model_parallel_size
    tp = tf_config.tensor_model_parallel_size
    chunks = []
    for vp_stage in range(vpp or 1):
        stage = vp_stage if vpp else None
        block = block_spec(cfg, tf_config, use_te, stage)
        model = GPTModel(
            config=tf_config,
            transformer_layer_spec=block,
            vocab_size=padded_vocab or cfg.padded_vocab_size(tp),
            max_sequence_length=cfg.seq_length,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
            parallel_output=True,
            share_embeddings_and_output_weights=cfg.tie_word_embeddings,
            position_embedding_type="rope",
            rotary_base=int(cfg.rotary_base),
            rotary_percent=cfg.rotary_percent,
            vp_stage=stage,
        )
        apply_rope_scaling(model, cfg)
        if cfg.mrope is not None:
            use_mrope(model, cfg)
        if cfg.local_rotary_base is not None:
            add_local_rope(model, cfg)
        if cfg.embedding_scale is not None and model.pre_process:
            model.embedding.register_forward_hook(_scale_embeddings(cfg.embedding_scale))
        _unmark_sequence_parallel_experts(model)
        if fuse_wgrad:
            fuse_wgrad_accumulation(model)
        if cfg.fp32_logits and model.post_process:
            fp32_logits.install(model.output_layer)
        if model.post_process and (padded_vocab or cfg.padded_vocab_size(tp)) > cfg.vocab_size:
            model.output_layer.register_forward_hook(_mask_padded_vocab(cfg.vocab_size))
        chunks.append(model)
    return chunks


def _unmark_sequence_parallel_experts(model: torch.nn.Module) -> None:
    """mcore marks a routed expert's row-parallel bias `sequence_parallel` under sequence
    parallelism, and its gradient is then summed over the tensor-parallel group, on top of the
    expert-data-parallel reduction that already spans those ranks at expert-TP 1: twice the
    gradient at TP=2 (found by the layout-invariance test of a family with expert biases).
    Expert parameters (allreduce=False) are reduced over their own groups only."""
    for param in model.parameters():
        if not getattr(param, "allreduce", True) and getattr(param, "sequence_parallel", False):
            param.sequence_parallel = False


def fuse_wgrad_accumulation(model: torch.nn.Module) -> int:
    """Let Transformer Engine's linear layers write weight gradients straight into mcore
    DDP's fp32 `main_grad` buffers (the GEMM accumulates; no bf16 gradient, no separate add).

    mcore's `gradient_accumulation_fusion` flag does the same but also switches mcore's own
    (non-TE) output layer to Apex's fused_weight_gradient_mlp_cuda, and that layer refuses to
    build without Apex; the TE layers need no Apex. The output layer keeps the unfused path.
    Chunks set up this way must be trained wrapped in mcore DDP (which gives every parameter
    its `main_grad`), as MegatronStrategy does. Returns the number of layers switched."""
    switched = 0
    for module in model.modules():
        if hasattr(module, "fuse_wgrad_accumulation") and any(  # subclasses too (post norms)
            c.__module__.startswith(("transformer_engine", "megatron.core.extensions.transformer_engine"))
            for c in type(module).__mro__
        ):
            module.fuse_wgrad_accumulation = True
            switched += 1
    return switched


def _scale_embeddings(scale: float):
    """Embeddings times `scale` (Gemma: sqrt(hidden)), the scale rounded to the activations'
    dtype first as transformers does (sqrt(3072) is 55.5 in bf16)."""

    def hook(module, args, output):
        return output * torch.tensor(scale, dtype=torch.float32).to(output.dtype)

    return hook


def _mask_padded_vocab(vocab_size: int):
    """The rows that pad the vocab to a TP multiple must not enter the softmax: their logits
    (0 for rows padded onto an HF model) would add to every token's normaliser and shift
    log-probs and losses away from the HF model's. They become the dtype's lowest value."""

    def hook(module, args, output):
        logits, bias = output
        width = logits.shape[-1]  # this rank's vocab slice, or all of it (gathered: inference)
        gathered = width == getattr(module, "output_size", None)
        start = 0 if gathered else parallel_state.get_tensor_model_parallel_rank() * width
        first_pad = max(0, vocab_size - start)
        if first_pad < width:
            logits = logits.clone()
            logits[..., first_pad:] = torch.finfo(logits.dtype).min
        return logits, bias

    return hook
