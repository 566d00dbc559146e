"""The entries of the declarative Hugging Face <-> mcore weight tables (each family module in
lightning_mcore/models/ builds its table from them).

An entry names the mcore parameter (local layer spec names, inside one GPTModel chunk), the
HF tensors it is made of, the transform between them (which also states the tensor-parallel
dimension), and the HF shapes in symbols checked against the config before any read:
    h hidden, nh heads, q heads x head_dim, q2 twice that (queries and their output gates), kv groups x
    head_dim, d head_dim, f ffn, mf expert ffn, 2mf twice that, sf shared-expert ffn, V vocab, E experts, 1 one;
    multi-latent attention: ql / kvl q / kv latent ranks, kva kv latent + RoPE dim, qh heads x
    q head, kvb heads x (k + v head), o heads x v head; linear attention: lk key heads x key dim,
    lv value heads x value dim, lh value heads, lc 2 lk + lv (convolution channels), dv value dim, ck convolution kernel; lc+lv, 2lh.
`{L}` is the layer (local index in mcore names, global in HF names); `{E}` the expert (local
to the expert-parallel rank in mcore names, global in HF names).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

from lightning_mcore.hf.transforms import Transform


@dataclass(frozen=True)
class Entry:
    mcore: str
    hf: tuple[str, ...]
    transform: Transform
    shapes: tuple[tuple[str, ...], ...]
    expert: bool = False  # sharded over expert-tensor-parallel ranks, experts over EP
    export: bool = True  # False: the HF tensors are written by another entry (tied output)
    dtype: Optional[str] = None  # stored in this safetensors dtype whatever the model's (e.g. "F32")
    # The HF tensors stack every expert along dim 0 ([E, ...], `shapes` say so); this entry is
    # expert {E}'s slice of them, which its transform sees as a tensor of its own.
    stacked: bool = False

    def pattern(self) -> re.Pattern:
        text = re.escape(self.mcore).replace(r"\{L\}", r"(?P<L>\d+)").replace(r"\{E\}", r"(?P<E>\d+)")
        return re.compile(text + "$")

    def hf_names(self, layer: Optional[int] = None, expert: Optional[int] = None) -> tuple[str, ...]:
        return tuple(n.format(L=layer, E=expert) for n in self.hf)


@dataclass(frozen=True)
class FusedExperts:
    """How transformers 5 holds a family's routed experts in memory (on disk they stay per
    expert): one module per layer (`module`, with {L}) whose 3-D parameters [experts, out, in]
    (`params`, in declaration order) each stack per-expert HF tensors along out, e.g.
    gate_up_proj = [gate_proj; up_proj]. peft adapts them through `target_parameters`.
    `per_expert` (with {L}): where the per-expert tensors live on disk when that is not under
    `module` (a block transformers renames on load), e.g. "model.layers.{L}.moe.experts"."""

    module: str
    params: tuple[tuple[str, tuple[str, ...]], ...]
    per_expert: Optional[str] = None

    @property
    def source(self) -> str:
        """The HF prefix of expert {E}'s per-expert tensors, without the expert index."""
        return self.per_expert or self.module


# TE layer spec fuses the norms into the following linear; its names map to the local spec's.
TE_TO_LOCAL = (
    (re.compile(r"^(.*)self_attention\.linear_qkv\.layer_norm_weight$"), r"\1input_layernorm.weight"),
    (re.compile(r"^(.*)mlp\.linear_fc1\.layer_norm_weight$"), r"\1pre_mlp_layernorm.weight"),
    (re.compile(r"^(.*)self_attention\.in_proj\.layer_norm_weight$"), r"\1input_layernorm.weight"),
    (re.compile(r"^(.*)self_attention\.linear_q_up_proj\.layer_norm_weight$"),
     r"\1self_attention.q_layernorm.weight"),
    (re.compile(r"^(.*)self_attention\.linear_kv_up_proj\.layer_norm_weight$"),
     r"\1self_attention.kv_layernorm.weight"),
    (re.compile(r"^(.*)mlp\.experts\.linear_fc(\d)\.weight(\d+)$"),
     r"\1mlp.experts.local_experts.\3.linear_fc\2.weight"),
    (re.compile(r"^(.*)mlp\.experts\.linear_fc(\d)\.bias(\d+)$"),
     r"\1mlp.experts.local_experts.\3.linear_fc\2.bias"),
)


def local_name(name: str) -> str:
    """An mcore parameter name under the local-spec naming (TE names translated)."""
    for pattern, replacement in TE_TO_LOCAL:
        new, n = pattern.subn(replacement, name)
        if n:
            return new
    return name


def shape_symbols(cfg) -> dict[str, int]:
    groups = cfg.num_query_groups or cfg.num_attention_heads
    out = {
        "h": cfg.hidden_size, "q": cfg.num_attention_heads * cfg.head_dim,
        "kv": groups * cfg.head_dim, "d": cfg.head_dim, "f": cfg.ffn_hidden_size,
        "mf": cfg.moe_ffn_hidden_size or cfg.ffn_hidden_size, "V": cfg.vocab_size,
        "E": cfg.num_moe_experts or 0, "sf": cfg.moe_shared_expert_intermediate_size or 0, "1": 1,
    }
    out.update(q2=2 * out["q"], nh=cfg.num_attention_heads,
               **{"2mf": 2 * out["mf"], "2f": 2 * out["f"], "q+2kv": out["q"] + 2 * out["kv"]})
    if cfg.linear_attention is not None:
        la = cfg.linear_attention
        lk, lv = la.num_key_heads * la.key_head_dim, la.num_value_heads * la.value_head_dim
        out.update(lk=lk, lv=lv, lh=la.num_value_heads, lc=2 * lk + lv, dv=la.value_head_dim)
        out.update({"lc+lv": 2 * lk + 2 * lv, "2lh": 2 * la.num_value_heads, "ck": la.conv_kernel_dim})
    if cfg.mla is not None:  # multi-latent attention: latent ranks and per-head q/k, v sizes
        m, n = cfg.mla, cfg.num_attention_heads
        out.update(ql=m.q_lora_rank or 0, qh=n * (m.qk_head_dim + m.qk_pos_emb_head_dim),
                   kvl=m.kv_lora_rank, kva=m.kv_lora_rank + m.qk_pos_emb_head_dim,
                   kvb=n * (m.qk_head_dim + m.v_head_dim), o=n * m.v_head_dim)
    return out
