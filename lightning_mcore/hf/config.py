"""Hugging Face `config.json` <-> `GPTConfig`, for the architectures whose weights we can map.

Anything in a checkpoint that our model cannot express (biases, sliding windows, other RoPE
variants, mixed dense/MoE stacks) is refused by name rather than dropped: a model that loads
and then computes something else is worse than an error.

Reads both config generations: transformers 4 (`rope_theta` + `rope_scaling`, `num_experts`)
and transformers 5 (`rope_parameters` holding theta and scaling, `num_local_experts`).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

from lightning_mcore.model.config import GPTConfig
from lightning_mcore.model.rope import SUPPORTED_ROPE_TYPES


class HFCheckpointError(ValueError):
    """A Hugging Face checkpoint or config that we cannot load (faithfully)."""


class HFCheckpointNotFoundError(HFCheckpointError, FileNotFoundError):
    """The path is not a directory, or the directory has no config.json."""


@dataclass(frozen=True)
class Architecture:
    family: str  # key of the weight-mapping tables
    config_class: str  # transformers class used for export
    # Fields whose absence transformers fills with something other than our default
    # (e.g. Mistral's num_key_value_heads=8, Qwen3's head_dim=128).
    required: tuple[str, ...] = ("num_key_value_heads",)
    qkv_bias: bool = False  # Qwen2 hard-codes q/k/v bias (no o_proj bias); no config field
    qk_layernorm: bool = False  # Qwen3 RMS-normalises q and k per head
    moe: bool = False
    # How transformers reads the window: "if_set" (Mistral: sliding_window not None),
    # "flag" (Qwen: only with use_sliding_window), None (ignored).
    sliding_window: Optional[str] = "flag"


SUPPORTED_ARCHITECTURES: dict[str, Architecture] = {
    "LlamaForCausalLM": Architecture("llama", "LlamaConfig", required=(), sliding_window=None),
    "MistralForCausalLM": Architecture("mistral", "MistralConfig", sliding_window="if_set"),
    "Qwen2ForCausalLM": Architecture("qwen2", "Qwen2Config", qkv_bias=True),
    "Qwen3ForCausalLM": Architecture(
        "qwen3", "Qwen3Config", required=("num_key_value_heads", "head_dim"), qk_layernorm=True
    ),
    "Qwen3MoeForCausalLM": Architecture(
        "qwen3_moe", "Qwen3MoeConfig", qk_layernorm=True, moe=True,
        required=("num_key_value_heads", "num_experts_per_tok", "moe_intermediate_size"),
    ),
}
ARCHITECTURE_BY_FAMILY = {a.family: name for name, a in SUPPORTED_ARCHITECTURES.items()}

REQUIRED_FIELDS = (
    "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size",
    "max_position_embeddings",
)
ROPE_FACTORS = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}
DEFAULT_SEQ_LENGTH_CAP = 4096

PathOrDict = Union[str, os.PathLike, dict]


def read_hf_config(path: Union[str, os.PathLike]) -> dict:
    """`<path>/config.json` as a dict, checked to be an architecture and setup we support."""
    path = Path(path)
    if not path.is_dir():
        raise HFCheckpointNotFoundError(
            f"{path} is not a directory; expected a Hugging Face checkpoint directory "
            "(holding config.json and *.safetensors)."
        )
    file = path / "config.json"
    if not file.is_file():
        raise HFCheckpointNotFoundError(
            f"{path} has no config.json; expected a Hugging Face checkpoint directory "
            "(as written by save_pretrained)."
        )
    try:
        hf = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise HFCheckpointError(f"{file} is not valid JSON: {e}") from e
    architecture(hf, str(file))
    return hf


def architecture(hf: dict, source: str = "config") -> tuple[str, Architecture]:
    """(architectures[0], its entry), or an error naming the supported ones.

    A config saved without a model has no `architectures`; then `model_type` decides.
    """
    names = hf.get("architectures") or []
    if not names:
        by_type = {a.family: n for n, a in SUPPORTED_ARCHITECTURES.items()}
        names = [by_type[hf["model_type"]]] if hf.get("model_type") in by_type else []
    supported = ", ".join(SUPPORTED_ARCHITECTURES)
    if not names:
        raise HFCheckpointError(f"{source}: no 'architectures' field; supported: {supported}.")
    if names[0] not in SUPPORTED_ARCHITECTURES:
        raise HFCheckpointError(
            f"{source}: architecture {names[0]!r} is not supported; supported: {supported}."
        )
    arch = SUPPORTED_ARCHITECTURES[names[0]]
    missing = [f for f in REQUIRED_FIELDS + arch.required if hf.get(f) is None]
    if arch.moe and hf.get("num_experts") is None and hf.get("num_local_experts") is None:
        missing.append("num_experts (or num_local_experts)")
    if missing:
        raise HFCheckpointError(f"{source}: missing required field(s): {', '.join(missing)}.")
    return names[0], arch


def gpt_config_from_hf(
    path_or_dict: PathOrDict, seq_length: Optional[int] = None, **overrides: Any
) -> tuple[GPTConfig, str]:
    """(GPTConfig, family) for a checkpoint directory or a config.json dict.

    `seq_length` defaults to min(max_position_embeddings, 4096) and may not exceed it (nor a
    sliding window); `overrides` replace any GPTConfig field afterwards (e.g. transformer_impl,
    recompute_granularity). Inputs longer than seq_length are refused where they enter.
    """
    if isinstance(path_or_dict, dict):
        hf, source = path_or_dict, "config"
    else:
        hf, source = read_hf_config(path_or_dict), str(Path(path_or_dict) / "config.json")
    _, arch = architecture(hf, source)

    def refuse(field: str, why: str):
        raise HFCheckpointError(f"{source}: {field}={hf.get(field)!r}: {why}")

    if hf.get("hidden_act", "silu") != "silu":
        refuse("hidden_act", "only silu (SwiGLU) is supported.")
    if hf.get("attention_bias") and not arch.qkv_bias:
        refuse("attention_bias", "attention projection biases (incl. o_proj) are not supported.")
    if hf.get("mlp_bias"):
        refuse("mlp_bias", "MLP biases are not supported.")

    seq_length = seq_length or min(hf["max_position_embeddings"], DEFAULT_SEQ_LENGTH_CAP)
    if seq_length > hf["max_position_embeddings"]:
        refuse("max_position_embeddings", f"seq_length={seq_length} (model_overrides) is longer "
               f"than the model was built for; use seq_length <= {hf['max_position_embeddings']}.")
    if arch.sliding_window == "flag" and hf.get("use_sliding_window"):
        refuse("use_sliding_window", "sliding-window attention is not supported.")
    window = hf.get("sliding_window") if arch.sliding_window == "if_set" else None
    if window is not None and window < seq_length:
        # HF's window keeps kv positions q-W < kv <= q: a no-op while seq_length <= W.
        refuse("sliding_window", f"sliding-window attention is not supported, and the window is "
               f"shorter than seq_length={seq_length}; train at seq_length <= {window}.")
    other = sorted(set(hf.get("layer_types") or []) - {"full_attention"})
    if other:
        raise HFCheckpointError(
            f"{source}: layer_types has {other}; only full_attention is supported."
        )

    rotary_base, rope_scaling = _rope(hf, source)
    heads = hf["num_attention_heads"]
    kwargs = dict(
        num_layers=hf["num_hidden_layers"],
        hidden_size=hf["hidden_size"],
        ffn_hidden_size=hf["intermediate_size"],
        num_attention_heads=heads,
        num_query_groups=hf.get("num_key_value_heads") or heads,
        kv_channels=hf.get("head_dim") or hf["hidden_size"] // heads,
        vocab_size=hf["vocab_size"],
        seq_length=seq_length,
        rotary_base=rotary_base,
        rope_scaling=rope_scaling,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        add_qkv_bias=arch.qkv_bias,
        qk_layernorm=arch.qk_layernorm,
        norm_epsilon=hf.get("rms_norm_eps", 1e-6),
        init_method_std=hf.get("initializer_range", 0.02),
        attention_dropout=float(hf.get("attention_dropout") or 0.0),
    )
    if arch.moe:
        if hf.get("decoder_sparse_step", 1) != 1:
            refuse("decoder_sparse_step", "mixed dense/MoE layer stacks are not supported.")
        if hf.get("mlp_only_layers"):
            refuse("mlp_only_layers", "mixed dense/MoE layer stacks are not supported.")
        experts = hf.get("num_experts")
        kwargs.update(
            num_moe_experts=hf.get("num_local_experts") if experts is None else experts,
            moe_router_topk=hf["num_experts_per_tok"],
            moe_ffn_hidden_size=hf["moe_intermediate_size"],
            # norm_topk_prob: HF renormalises the top-k softmax probs = mcore's softmax over
            # the top-k logits (pre_softmax=False). Otherwise HF keeps the full-softmax probs
            # of the chosen experts = mcore pre_softmax=True.
            moe_router_pre_softmax=not hf.get("norm_topk_prob", False),
        )
    kwargs.update(overrides)
    return GPTConfig(**kwargs), arch.family


def _rope(hf: dict, source: str) -> tuple[float, Optional[dict]]:
    """(rope theta, HF-style scaling dict or None for plain RoPE) from either config style."""
    if hf.get("rope_parameters") is not None:  # transformers 5
        params = dict(hf["rope_parameters"])
        field = "rope_parameters"
        if params and all(isinstance(v, dict) for v in params.values()):
            raise HFCheckpointError(f"{source}: per-layer-type rope_parameters are not supported.")
    else:  # transformers 4
        params = dict(hf.get("rope_scaling") or {})
        field = "rope_scaling"
    theta = float(params.pop("rope_theta", hf.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in SUPPORTED_ROPE_TYPES:
        raise HFCheckpointError(
            f"{source}: {field} rope_type {kind!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}."
        )
    if params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)) != 1.0:
        raise HFCheckpointError(f"{source}: partial_rotary_factor != 1 is not supported.")
    if theta != math.floor(theta):  # mcore's GPTModel takes rotary_base as an int
        raise HFCheckpointError(f"{source}: non-integer rope_theta={theta} is not supported.")
    missing = [k for k in ROPE_FACTORS[kind] if params.get(k) is None]
    if missing:
        raise HFCheckpointError(f"{source}: {field} ({kind}) lacks {', '.join(missing)}.")
    if kind == "default":
        return theta, None
    return theta, {"rope_type": kind, **{k: params[k] for k in ROPE_FACTORS[kind]}}


def hf_config_dict_from_gpt(cfg: GPTConfig, family: str, **hf_overrides: Any) -> dict:
    """config.json contents for `cfg` as a `family` model, via transformers' own config class.

    `max_position_embeddings` is cfg.seq_length; pass it (or bos/eos_token_id, ...) in
    `hf_overrides` to write something else.
    """
    import transformers

    if family not in ARCHITECTURE_BY_FAMILY:
        raise HFCheckpointError(
            f"unknown family {family!r}; supported: {', '.join(ARCHITECTURE_BY_FAMILY)}."
        )
    name = ARCHITECTURE_BY_FAMILY[family]
    arch = SUPPORTED_ARCHITECTURES[name]
    for field, want in (("add_qkv_bias", arch.qkv_bias), ("qk_layernorm", arch.qk_layernorm)):
        if getattr(cfg, field) != want:
            raise HFCheckpointError(f"{family} needs GPTConfig.{field}={want}.")
    if bool(cfg.num_moe_experts) != arch.moe:
        raise HFCheckpointError(f"{family}: num_moe_experts={cfg.num_moe_experts} does not fit.")
    if cfg.moe_shared_expert_intermediate_size:
        raise HFCheckpointError(f"{family} has no shared experts.")
    if cfg.rope_scaling and cfg.rope_scaling.get("rope_type") not in SUPPORTED_ROPE_TYPES:
        raise HFCheckpointError(f"rope_scaling {cfg.rope_scaling!r} is not supported.")

    kwargs = dict(
        architectures=[name],
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.ffn_hidden_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_query_groups or cfg.num_attention_heads,
        head_dim=cfg.head_dim,
        hidden_act="silu",
        max_position_embeddings=cfg.seq_length,
        rms_norm_eps=cfg.norm_epsilon,
        initializer_range=cfg.init_method_std,
        tie_word_embeddings=cfg.tie_word_embeddings,
        attention_dropout=cfg.attention_dropout,
        # Accepted by transformers 4 as is and converted to rope_parameters by transformers 5.
        rope_theta=float(cfg.rotary_base),
        rope_scaling=dict(cfg.rope_scaling) if cfg.rope_scaling else None,
    )
    if family == "mistral":
        kwargs["sliding_window"] = None
    if arch.moe:
        kwargs.update(
            num_experts=cfg.num_moe_experts,
            num_experts_per_tok=cfg.moe_router_topk,
            moe_intermediate_size=cfg.moe_ffn_hidden_size or cfg.ffn_hidden_size,
            norm_topk_prob=not cfg.moe_router_pre_softmax,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )
    kwargs.update(hf_overrides)
    return getattr(transformers, arch.config_class)(**kwargs).to_dict()
