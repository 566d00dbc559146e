"""GPT-OSS (GptOssForCausalLM): GQA with biases on q/k/v/o and a learnable sink logit per head
in the softmax, windowed (sliding_attention) and full layers alternating, YaRN RoPE; on every
layer a router with a bias (softmax over the top-k logits) and experts with biases computing a
clamped SwiGLU: gate clamped to <= limit, up to [-limit, limit], gate * sigmoid(1.702 gate) *
(up + 1) (mcore: quick_gelu, glu_linear_offset=1, activation_func_clamp_value=limit).

On disk the experts of a layer are fused: gate_up_proj [E, h, 2f] with gate and up alternating
along 2f, down_proj [E, f, h] (both [in, out]), biases [E, 2f] and [E, h]. The official
checkpoints store the two weights in MXFP4 (*_blocks, *_scales; hf/mxfp4.py): they load
dequantized, exactly as transformers dequantizes them, and export in bf16 (not MXFP4).
"""

from __future__ import annotations

from lightning_mcore.hf.config import HFCheckpointError
from lightning_mcore.hf.mappings import Entry
from lightning_mcore.hf.transforms import InterleavedGateUp, Replicated, Split, Transposed
from lightning_mcore.model.rope import YARN_ROPE_TYPES
from lightning_mcore.models import parts
from lightning_mcore.models.architecture import Architecture

M, H = parts.M, parts.H
ALPHA = 1.702  # mcore's quick_gelu: x * sigmoid(1.702 x)


class GptOss(Architecture):
    hf_class, model_type, config_class = "GptOssForCausalLM", "gpt_oss", "GptOssConfig"
    required = ("intermediate_size", "num_key_value_heads", "num_experts_per_tok", "head_dim",
                "num_local_experts")

    def gpt_config(self, hf):
        parts.refuse_unless(hf, "swiglu_alpha", (ALPHA, None),
                            f"only {ALPHA} (mcore's quick_gelu) is supported.")
        if hf.data.get("attention_bias") is False:
            hf.refuse("attention_bias", "biases on the router and experts but not on attention "
                                        "are not supported.")
        window = parts.sliding_window(hf, lambda i: (i + 1) % 2 == 1) if "sliding_window" in hf else {}
        return parts.decoder(
            hf, rope_types=YARN_ROPE_TYPES, add_bias_linear=True, attention_sinks=True,
            activation="quick_gelu", glu_linear_offset=1.0,
            activation_clamp=float(hf.get("swiglu_limit", 7.0)), **window,
        ) | parts.moe(hf, parts.num_experts(hf), ffn="intermediate_size", moe_router_pre_softmax=False)

    def hf_config(self, cfg):
        if not cfg.num_moe_experts or cfg.moe_layer_freq != 1:
            raise HFCheckpointError(f"{self.model_type} needs num_moe_experts and experts on every layer.")
        if cfg.moe_router_pre_softmax:
            raise HFCheckpointError(f"{self.model_type} takes the softmax over the top-k logits: needs "
                                    f"moe_router_pre_softmax=False.")
        if cfg.activation_clamp is None:
            raise HFCheckpointError(f"{self.model_type} needs activation_clamp (its swiglu_limit).")
        parts.expressible(cfg, self.model_type, free=("num_moe_experts", "sliding_window", "layer_types",
                                                      "activation_clamp"),
                          rope_types=YARN_ROPE_TYPES, add_bias_linear=True, attention_sinks=True,
                          activation="quick_gelu", glu_linear_offset=1.0)
        kwargs = parts.decoder_hf(cfg)
        kwargs.pop("rope_scaling")
        rope = {"rope_type": "default", **(cfg.rope_scaling or {}), "rope_theta": kwargs.pop("rope_theta")}
        types = cfg.layer_types or ["sliding_attention" if cfg.sliding_window else "full_attention"] * cfg.num_layers
        return kwargs | dict(
            intermediate_size=cfg.moe_ffn_hidden_size or cfg.ffn_hidden_size,
            num_local_experts=cfg.num_moe_experts, num_experts_per_tok=cfg.moe_router_topk,
            sliding_window=cfg.sliding_window, layer_types=list(types), rope_parameters=rope,
            attention_bias=True, swiglu_alpha=ALPHA, swiglu_limit=cfg.activation_clamp)

    def weights(self, cfg):
        experts = M + "mlp.experts.local_experts.{E}."
        fused = H + "mlp.experts."
        return (parts.ends(cfg.tie_word_embeddings) + parts.attention(qkv_bias=True) + [
            Entry(M + "self_attention.linear_proj.bias", (H + "self_attn.o_proj.bias",), Replicated(), (("h",),)),
            Entry(M + "self_attention.core_attention.softmax_offset", (H + "self_attn.sinks",), Split(0),
                  (("nh",),)),
            Entry(M + "mlp.router.weight", (H + "mlp.router.weight",), Replicated(), (("E", "h"),)),
            Entry(M + "mlp.router.bias", (H + "mlp.router.bias",), Replicated(), (("E",),)),
            Entry(experts + "linear_fc1.weight", (fused + "gate_up_proj",), InterleavedGateUp(transposed=True),
                  (("E", "h", "2mf"),), expert=True, stacked=True),
            Entry(experts + "linear_fc1.bias", (fused + "gate_up_proj_bias",), InterleavedGateUp(),
                  (("E", "2mf"),), expert=True, stacked=True),
            Entry(experts + "linear_fc2.weight", (fused + "down_proj",), Transposed(1), (("E", "mf", "h"),),
                  expert=True, stacked=True),
            Entry(experts + "linear_fc2.bias", (fused + "down_proj_bias",), Replicated(), (("E", "h"),),
                  expert=True, stacked=True),
        ])


ARCHITECTURE = GptOss()
