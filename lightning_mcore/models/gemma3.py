"""Gemma 3, text only (Gemma3ForCausalLM, model_type gemma3_text): GQA with per-head q/k norm,
RMSNorms that scale by (1 + weight), a norm before and after both attention and MLP, GeGLU
(gelu-tanh), embeddings times sqrt(hidden), attention scaled by query_pre_attn_scalar^-0.5,
and local layers (sliding window, their own RoPE base) interleaved with global ones.

The multimodal Gemma3ForConditionalGeneration keeps these weights under other names
(model.language_model.*) next to a vision tower; it is not this architecture.
"""

from __future__ import annotations

import math

from lightning_mcore.hf.config import HFCheckpointError
from lightning_mcore.models import parts
from lightning_mcore.models.architecture import Architecture, HFConfig

FULL, LOCAL = "full_attention", "sliding_attention"
# transformers' defaults when a (transformers 4) config.json leaves them out
DEFAULT_THETA = {FULL: 1_000_000.0, LOCAL: 10_000.0}
DEFAULT_PATTERN = 6  # sliding_window_pattern: every 6th layer is global


class Gemma3(Architecture):
    hf_class, model_type, config_class = "Gemma3ForCausalLM", "gemma3_text", "Gemma3TextConfig"
    required = ("intermediate_size", "num_key_value_heads", "head_dim", "query_pre_attn_scalar",
                "sliding_window")

    def gpt_config(self, hf):
        for field in ("attn_logit_softcapping", "final_logit_softcapping"):
            parts.refuse_unless(hf, field, None, "logit soft-capping is not supported.")
        if hf.get("use_bidirectional_attention"):
            hf.refuse("use_bidirectional_attention", "only causal attention is supported.")
        parts.refuse_unless(hf, "hidden_activation", ("gelu_pytorch_tanh", None),
                            "only gelu_pytorch_tanh (GeGLU with tanh-approximated GELU) is supported.")
        full, local = _rope_by_layer_type(hf)
        local_theta, local_scaling = parts.rope(hf, local)
        if local_scaling:
            hf.refuse("rope_parameters", f"RoPE scaling on {LOCAL} layers is not supported.")
        # The global layers' RoPE is the model's RoPE.
        hidden = hf["hidden_size"]
        return parts.decoder(
            HFConfig(hf.data | {"rope_parameters": full}, hf.source), act="gelu_pytorch_tanh",
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
            qk_layernorm=True, activation="gelu_tanh", zero_centered_norm=True, post_norms=True,
            embedding_scale=hidden**0.5, softmax_scale=hf["query_pre_attn_scalar"] ** -0.5,
            sliding_window=hf["sliding_window"], layer_types=_layer_types(hf),
            local_rotary_base=local_theta,
        )

    def hf_config(self, cfg):
        parts.expressible(
            cfg, self.model_type, free=("softmax_scale", "sliding_window", "layer_types",
                                        "local_rotary_base"),
            qk_layernorm=True, activation="gelu_tanh", zero_centered_norm=True, post_norms=True,
            embedding_scale=cfg.hidden_size**0.5,
        )
        if cfg.local_rotary_base is None:
            raise HFCheckpointError(f"{self.model_type} needs GPTConfig.local_rotary_base (the "
                                    f"RoPE base of its {LOCAL} layers).")
        if cfg.local_rotary_base != math.floor(cfg.local_rotary_base):
            raise HFCheckpointError(f"{self.model_type}: a non-integer local_rotary_base "
                                    f"({cfg.local_rotary_base}) is not supported.")
        kwargs = parts.decoder_hf(cfg)
        for name in ("hidden_act", "rope_theta", "rope_scaling"):  # Gemma 3 names them otherwise
            kwargs.pop(name)
        return kwargs | dict(
            hidden_activation="gelu_pytorch_tanh",
            query_pre_attn_scalar=_query_pre_attn_scalar(cfg),
            sliding_window=cfg.sliding_window,
            layer_types=[LOCAL if cfg.is_window_layer(i) else FULL for i in range(cfg.num_layers)],
            rope_parameters={
                FULL: {"rope_type": "default", **(cfg.rope_scaling or {}),
                       "rope_theta": float(cfg.rotary_base)},
                LOCAL: {"rope_type": "default", "rope_theta": float(cfg.local_rotary_base)},
            },
        )

    def weights(self, cfg):
        return (
            parts.ends(cfg.tie_word_embeddings)
            + parts.attention(qk_norm=True, norms=("input_layernorm", "pre_feedforward_layernorm"))
            + [parts.norm("self_attention.linear_proj.post_layernorm.weight",
                          "post_attention_layernorm.weight"),
               parts.norm("mlp.linear_fc2.post_layernorm.weight", "post_feedforward_layernorm.weight")]
            + parts.dense_mlp()
        )


ARCHITECTURE = Gemma3()


def _rope_by_layer_type(hf: HFConfig) -> tuple[dict, dict]:
    """The RoPE parameters of global and local layers: transformers 5 keeps one dict per layer
    type in rope_parameters; transformers 4 has rope_theta + rope_scaling (global layers) and
    rope_local_base_freq."""
    if "rope_parameters" not in hf:
        return ({"rope_theta": hf.get("rope_theta", DEFAULT_THETA[FULL]), **hf.get("rope_scaling", {})},
                {"rope_theta": hf.get("rope_local_base_freq", DEFAULT_THETA[LOCAL])})
    params = hf["rope_parameters"]
    if not (isinstance(params, dict) and set(params) <= {FULL, LOCAL}
            and all(isinstance(v, dict) for v in params.values())):
        hf.refuse("rope_parameters", f"expected one dict per layer type ({FULL}, {LOCAL}).")
    return tuple({"rope_theta": DEFAULT_THETA[t], **params.get(t, {})} for t in (FULL, LOCAL))


def _layer_types(hf: HFConfig) -> list[str]:
    n = hf["num_hidden_layers"]
    types = hf.get("layer_types")
    if types is None:  # transformers 4: every `sliding_window_pattern`-th layer is global
        pattern = hf.get("sliding_window_pattern", DEFAULT_PATTERN)
        types = [LOCAL if (i + 1) % pattern else FULL for i in range(n)]
    if len(types) != n:
        hf.refuse("layer_types", f"has {len(types)} entries for num_hidden_layers={n}.")
    return list(types)


def _query_pre_attn_scalar(cfg) -> int:
    """The integer s with s^-0.5 == cfg.softmax_scale (head_dim when unset)."""
    if cfg.softmax_scale is None:
        return cfg.head_dim
    scalar = round(cfg.softmax_scale**-2)
    if scalar**-0.5 != cfg.softmax_scale:
        raise HFCheckpointError(f"gemma3_text scales attention by query_pre_attn_scalar^-0.5 for "
                                f"an integer query_pre_attn_scalar; softmax_scale="
                                f"{cfg.softmax_scale} is not one.")
    return scalar
