"""Declarative Hugging Face <-> mcore parameter tables, one per architecture family.

An entry names the mcore parameter (local layer spec names, inside one GPTModel chunk), the
HF tensors it is made of, the transform between them (which also states the tensor-parallel
dimension), and the HF shapes in symbols checked against the config before any read:
    h hidden, q heads x head_dim, kv groups x head_dim, d head_dim, f ffn, mf expert ffn,
    V vocab, E experts.
`{L}` is the layer (local index in mcore names, global in HF names); `{E}` the expert (local
to the expert-parallel rank in mcore names, global in HF names).

Sharding at a glance (tensor-parallel dim):
    embedding / output_layer   Vocab    dim 0 (padded vocab rows)
    linear_qkv (+bias)         QKV      dim 0 (whole query groups)
    linear_proj, linear_fc2    Split(1) row-parallel
    linear_fc1                 GateUp   dim 0 ([gate_i; up_i])
    norms, q/k norms, router   Replicated
    experts                    as their dense twins, over expert-TP; experts split over EP
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

from lightning_mcore.hf.transforms import (
    QKV,
    GateUp,
    Replicated,
    Split,
    Transform,
    Vocab,
)


@dataclass(frozen=True)
class Entry:
    mcore: str
    hf: tuple[str, ...]
    transform: Transform
    shapes: tuple[tuple[str, ...], ...]
    expert: bool = False  # sharded over expert-tensor-parallel ranks, experts over EP
    export: bool = True  # False: the HF tensors are written by another entry (tied output)

    def pattern(self) -> re.Pattern:
        text = re.escape(self.mcore).replace(r"\{L\}", r"(?P<L>\d+)").replace(r"\{E\}", r"(?P<E>\d+)")
        return re.compile(text + "$")

    def hf_names(self, layer: Optional[int] = None, expert: Optional[int] = None) -> tuple[str, ...]:
        return tuple(n.format(L=layer, E=expert) for n in self.hf)


# TE layer spec fuses the norms into the following linear; its names map to the local spec's.
TE_TO_LOCAL = (
    (re.compile(r"^(.*)self_attention\.linear_qkv\.layer_norm_weight$"), r"\1input_layernorm.weight"),
    (re.compile(r"^(.*)mlp\.linear_fc1\.layer_norm_weight$"), r"\1pre_mlp_layernorm.weight"),
    (re.compile(r"^(.*)mlp\.experts\.linear_fc(\d)\.weight(\d+)$"),
     r"\1mlp.experts.local_experts.\3.linear_fc\2.weight"),
)


def local_name(name: str) -> str:
    """An mcore parameter name under the local-spec naming (TE names translated)."""
    for pattern, replacement in TE_TO_LOCAL:
        new, n = pattern.subn(replacement, name)
        if n:
            return new
    return name


M, H = "decoder.layers.{L}.", "model.layers.{L}."


def _attention(qkv_bias: bool, qk_norm: bool) -> list[Entry]:
    out = [
        Entry(M + "input_layernorm.weight", (H + "input_layernorm.weight",), Replicated(), (("h",),)),
        Entry(M + "self_attention.linear_qkv.weight",
              tuple(H + f"self_attn.{p}_proj.weight" for p in "qkv"), QKV(),
              (("q", "h"), ("kv", "h"), ("kv", "h"))),
        Entry(M + "self_attention.linear_proj.weight", (H + "self_attn.o_proj.weight",), Split(1),
              (("h", "q"),)),
        Entry(M + "pre_mlp_layernorm.weight", (H + "post_attention_layernorm.weight",), Replicated(),
              (("h",),)),
    ]
    if qkv_bias:
        out.append(Entry(M + "self_attention.linear_qkv.bias",
                         tuple(H + f"self_attn.{p}_proj.bias" for p in "qkv"), QKV(),
                         (("q",), ("kv",), ("kv",))))
    if qk_norm:
        out += [
            Entry(M + "self_attention.q_layernorm.weight", (H + "self_attn.q_norm.weight",), Replicated(), (("d",),)),
            Entry(M + "self_attention.k_layernorm.weight", (H + "self_attn.k_norm.weight",), Replicated(), (("d",),)),
        ]
    return out


def _dense_mlp() -> list[Entry]:
    return [
        Entry(M + "mlp.linear_fc1.weight", (H + "mlp.gate_proj.weight", H + "mlp.up_proj.weight"),
              GateUp(), (("f", "h"), ("f", "h"))),
        Entry(M + "mlp.linear_fc2.weight", (H + "mlp.down_proj.weight",), Split(1), (("h", "f"),)),
    ]


def _moe_mlp() -> list[Entry]:
    X, Y = M + "mlp.experts.local_experts.{E}.", H + "mlp.experts.{E}."
    return [
        Entry(M + "mlp.router.weight", (H + "mlp.gate.weight",), Replicated(), (("E", "h"),)),
        Entry(X + "linear_fc1.weight", (Y + "gate_proj.weight", Y + "up_proj.weight"), GateUp(),
              (("mf", "h"), ("mf", "h")), expert=True),
        Entry(X + "linear_fc2.weight", (Y + "down_proj.weight",), Split(1), (("h", "mf"),), expert=True),
    ]


def _ends(tied: bool) -> list[Entry]:
    return [
        Entry("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), Vocab(), (("V", "h"),)),
        Entry("decoder.final_layernorm.weight", ("model.norm.weight",), Replicated(), (("h",),)),
        Entry("output_layer.weight", ("model.embed_tokens.weight" if tied else "lm_head.weight",),
              Vocab(), (("V", "h"),), export=not tied),
    ]


FAMILIES = {
    # family: (qkv bias, q/k norm, MoE)
    "llama": (False, False, False),
    "mistral": (False, False, False),
    "qwen2": (True, False, False),
    "qwen3": (False, True, False),
    "qwen3_moe": (False, True, True),
}


def mapping(family: str, tied: bool) -> list[Entry]:
    if family not in FAMILIES:
        raise ValueError(f"no weight mapping for family {family!r}; known: {', '.join(FAMILIES)}.")
    qkv_bias, qk_norm, moe = FAMILIES[family]
    return _ends(tied) + _attention(qkv_bias, qk_norm) + (_moe_mlp() if moe else _dense_mlp())


def shape_symbols(cfg) -> dict[str, int]:
    groups = cfg.num_query_groups or cfg.num_attention_heads
    return {
        "h": cfg.hidden_size, "q": cfg.num_attention_heads * cfg.head_dim,
        "kv": groups * cfg.head_dim, "d": cfg.head_dim, "f": cfg.ffn_hidden_size,
        "mf": cfg.moe_ffn_hidden_size or cfg.ffn_hidden_size, "V": cfg.vocab_size,
        "E": cfg.num_moe_experts or 0,
    }


def family_of(cfg) -> str:
    """The HF family a model trained from scratch is exported as."""
    if cfg.num_moe_experts:
        return "qwen3_moe"
    if cfg.qk_layernorm:
        return "qwen3"
    if cfg.add_qkv_bias:
        return "qwen2"
    return "llama"
