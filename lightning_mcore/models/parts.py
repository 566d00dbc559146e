"""What the family modules share: config.json <-> GPTConfig pieces and weight-table builders.

Weight tables name mcore parameters (local layer spec names, inside one GPTModel chunk) and the
HF tensors they are made of; `{L}` is the layer, `{E}` the expert (hf/mappings.py).

Sharding at a glance (tensor-parallel dim, stated by each transform in hf/transforms.py):
    embedding / output_layer   Vocab    dim 0 (padded vocab rows)
    linear_qkv (+bias)         QKV      dim 0 (whole query groups)
    linear_proj, linear_fc2    Split(1) row-parallel
    linear_fc1                 GateUp   dim 0 ([gate_i; up_i])
    norms, q/k norms, router   Replicated
    experts                    as their dense twins, over expert-TP; experts split over EP
    shared expert (+ gate)     as a dense MLP, over TP (not expert-TP); its gate Replicated
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Optional, Union

from lightning_mcore.hf.config import HFCheckpointError
from lightning_mcore.hf.mappings import Entry
from lightning_mcore.hf.transforms import (
    QKV,
    GatedQKV,
    GateUp,
    KeyHeadGroups,
    Replicated,
    Sections,
    Split,
    Vocab,
)
from lightning_mcore.model.config import GPTConfig, LinearAttentionConfig
from lightning_mcore.model.rope import SUPPORTED_ROPE_TYPES
from lightning_mcore.models.architecture import HFConfig

M, H = "decoder.layers.{L}.", "model.layers.{L}."
ROPE_FACTORS = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings"),
}
ROPE_OPTIONS = ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor", "truncate")


# ---------------------------------------------------------------- config.json -> GPTConfig
def rope(hf: HFConfig, params: Optional[dict] = None,
         kinds: tuple[str, ...] = SUPPORTED_ROPE_TYPES, partial: bool = False) -> tuple[float, Optional[dict]]:
    """(rope theta, HF-style scaling dict or None for plain RoPE), from transformers 5's
    `rope_parameters` (or `params`, one layer type's entry) or transformers 4's
    `rope_theta` + `rope_scaling`; `kinds`: the rope types the family computes; `partial`: the
    family rotates the first partial_rotary_factor of each head (rotary_fraction reads it)."""
    if params is not None or "rope_parameters" in hf:  # transformers 5
        params = dict(params if params is not None else hf["rope_parameters"])
        field = "rope_parameters"
        if params and all(isinstance(v, dict) for v in params.values()):
            hf.refuse(field, "per-layer-type RoPE parameters are not supported by this family.")
    else:  # transformers 4
        params = dict(hf.get("rope_scaling") or {})
        field = "rope_scaling"
    theta = float(params.pop("rope_theta", hf.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in kinds:
        hf.refuse(field, f"rope_type {kind!r} is not supported; supported: {', '.join(kinds)}.")
    if not partial and float(params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))) != 1.0:
        hf.refuse("partial_rotary_factor", "only 1 (RoPE on the whole head) is supported.")
    if theta != math.floor(theta):  # mcore's GPTModel takes rotary_base as an int
        hf.refuse("rope_theta", "a non-integer rope_theta is not supported.")
    missing = [k for k in ROPE_FACTORS[kind] if params.get(k) is None]
    if missing:
        raise HFCheckpointError(f"{hf.source}: {field} ({kind}) lacks {', '.join(missing)}.")
    if kind == "default":
        return theta, None
    options = {k: params[k] for k in ROPE_OPTIONS if params.get(k) is not None}
    return theta, {"rope_type": kind, **{k: params[k] for k in ROPE_FACTORS[kind]}, **options}


def rotary_fraction(hf: HFConfig) -> float:
    """partial_rotary_factor, from rope_parameters (transformers 5) or the top level."""
    params = hf.get("rope_parameters") or {}
    return float(params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)))


def refuse_unless(hf: HFConfig, field: str, allowed, why: str) -> None:
    """Refuse `field` when set to anything but one of `allowed` (None: the field is absent)."""
    allowed = allowed if isinstance(allowed, (tuple, list)) else (allowed,)
    if hf.data.get(field) not in allowed:
        hf.refuse(field, why)


def decoder(hf: HFConfig, act: str = "silu", rope_types: tuple[str, ...] = SUPPORTED_ROPE_TYPES,
            partial_rotary: bool = False, **fields) -> dict:
    """GPTConfig fields of a Llama-style decoder (GQA, RoPE, RMSNorm, gated MLP, no biases);
    `partial_rotary`: RoPE on partial_rotary_factor of each head; `fields` add or replace
    (e.g. add_qkv_bias=True)."""
    refuse_unless(hf, "hidden_act", (act, None), f"only {act} is supported for this family.")
    if hf.get("attention_bias") and not (fields.get("add_qkv_bias") or fields.get("add_bias_linear")):
        hf.refuse("attention_bias", "attention projection biases (incl. o_proj) are not supported.")
    if hf.get("mlp_bias"):
        hf.refuse("mlp_bias", "MLP biases are not supported.")
    theta, scaling = rope(hf, kinds=rope_types, partial=partial_rotary)
    if partial_rotary:
        fields = dict(rotary_percent=rotary_fraction(hf)) | fields
    heads = hf["num_attention_heads"]
    return dict(
        num_layers=hf["num_hidden_layers"],
        hidden_size=hf["hidden_size"],
        ffn_hidden_size=hf["intermediate_size"],
        num_attention_heads=heads,
        num_query_groups=hf.get("num_key_value_heads", heads),
        kv_channels=hf.get("head_dim", hf["hidden_size"] // heads),
        vocab_size=hf["vocab_size"],
        rotary_base=theta,
        rope_scaling=scaling,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        norm_epsilon=hf.get("rms_norm_eps", 1e-6),
        init_method_std=hf.get("initializer_range", 0.02),
        attention_dropout=float(hf.get("attention_dropout", 0.0)),
    ) | fields


def sliding_window(hf: HFConfig, windowed: Callable[[int], bool]) -> dict:
    """GPTConfig sliding_window and layer_types: config.json's `sliding_window` on the layers its
    `layer_types` names or, where it has none, on each layer i with windowed(i)."""
    layers = hf["num_hidden_layers"]
    types = hf.get("layer_types") or [
        "sliding_attention" if windowed(i) else "full_attention" for i in range(layers)]
    if len(types) != layers:
        hf.refuse("layer_types", f"{len(types)} entries for num_hidden_layers={layers}.")
    return dict(sliding_window=hf["sliding_window"], layer_types=list(types))


def linear_attention(hf: HFConfig) -> dict:
    """GPTConfig fields of a Gated DeltaNet hybrid (Qwen3.5, Qwen3-Next): the linear-attention
    sizes and `layer_types` ("linear_attention" / "full_attention" per layer)."""
    layers = hf["num_hidden_layers"]
    types = hf.get("layer_types")
    if types is None:  # a config saved without layer_types: every full_attention_interval-th is full
        interval = hf.get("full_attention_interval", 4)
        types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)]
    if len(types) != layers:
        hf.refuse("layer_types", f"{len(types)} entries for num_hidden_layers={layers}.")
    la = LinearAttentionConfig(
        num_key_heads=hf["linear_num_key_heads"], num_value_heads=hf["linear_num_value_heads"],
        key_head_dim=hf["linear_key_head_dim"], value_head_dim=hf["linear_value_head_dim"],
        conv_kernel_dim=hf.get("linear_conv_kernel_dim", 4))
    if la.num_value_heads % la.num_key_heads:
        hf.refuse("linear_num_value_heads", f"must be a multiple of linear_num_key_heads "
                                            f"({la.num_key_heads}).")
    return dict(linear_attention=la, layer_types=list(types))


def num_experts(hf: HFConfig) -> int:
    """transformers 4 writes num_experts, transformers 5 num_local_experts."""
    if "num_experts" not in hf and "num_local_experts" not in hf:
        raise HFCheckpointError(f"{hf.source}: missing required field num_experts "
                                f"(or num_local_experts).")
    return hf.get("num_experts", hf.get("num_local_experts"))


def moe(hf: HFConfig, experts: int, ffn: str = "moe_intermediate_size", **fields) -> dict:
    """GPTConfig MoE fields for a softmax top-k router (`ffn`: the field of the experts'
    width); `fields` add or replace."""
    return dict(
        num_moe_experts=experts,
        moe_router_topk=hf["num_experts_per_tok"],
        moe_ffn_hidden_size=hf[ffn],
        # norm_topk_prob: HF renormalises the top-k softmax probs = mcore's softmax over the
        # top-k logits (pre_softmax=False). Otherwise HF keeps the full-softmax probs of the
        # chosen experts = mcore pre_softmax=True.
        moe_router_pre_softmax=not hf.get("norm_topk_prob", False),
    ) | fields


def gated_shared_expert(hf: HFConfig, **fields) -> dict:
    """GPTConfig MoE fields of the Qwen MoE families: a softmax top-k router over num_experts
    routed experts and a shared expert of shared_expert_intermediate_size scaled by
    sigmoid(shared_expert_gate . x) (mcore's moe_shared_expert_gate); `fields` add or replace."""
    for field in ("num_experts", "shared_expert_intermediate_size"):
        if hf[field] < 1:
            hf.refuse(field, "must be positive: a model without (shared) experts is not "
                             "supported by this family.")
    return moe(hf, hf["num_experts"], moe_shared_expert_intermediate_size=hf["shared_expert_intermediate_size"],
               moe_shared_expert_gate=True, **fields)


def sparse_layers(hf: HFConfig) -> Union[int, list[int]]:
    """moe_layer_freq by the Qwen-MoE rule: layer i (0-based) is MoE unless it is listed in
    mlp_only_layers, and only when i + 1 is a multiple of decoder_sparse_step; 1 when all are."""
    step, dense = hf.get("decoder_sparse_step", 1), set(hf.get("mlp_only_layers", []))
    if step < 1:
        hf.refuse("decoder_sparse_step", "must be a positive int.")
    layers = [int(i not in dense and (i + 1) % step == 0) for i in range(hf["num_hidden_layers"])]
    if not any(layers):
        hf.refuse("mlp_only_layers" if dense else "decoder_sparse_step",
                  "no layer is MoE; a model without experts is not supported by this family.")
    return 1 if all(layers) else layers


# ---------------------------------------------------------------- GPTConfig -> config.json
VARIANT_FIELDS = (
    "add_qkv_bias", "qk_layernorm", "activation", "zero_centered_norm", "post_norms",
    "embedding_scale", "softmax_scale", "sliding_window", "layer_types", "local_rotary_base",
    "mla", "mrope", "vision", "num_moe_experts", "moe_layer_freq", "moe_shared_expert_intermediate_size",
    "moe_shared_expert_gate", "moe_router_score_function", "moe_router_enable_expert_bias",
    "moe_router_num_groups", "moe_router_group_topk", "moe_router_topk_scaling_factor",
    "rotary_percent", "attention_output_gate", "linear_attention", "add_bias_linear",
    "attention_sinks", "glu_linear_offset", "activation_clamp", "qk_norm_across_heads",
)
_DEFAULTS = GPTConfig()


def expressible(cfg: GPTConfig, family: str, free: tuple[str, ...] = (),
                rope_types: tuple[str, ...] = SUPPORTED_ROPE_TYPES, **fixed) -> None:
    """Refuse `cfg` unless each field in `fixed` has that value, and every other architecture
    variant but those in `free` is at its default: an export must describe the model trained."""
    for name in VARIANT_FIELDS:
        if name in free:
            continue
        value, want = getattr(cfg, name), fixed.get(name, getattr(_DEFAULTS, name))
        if value != want:
            raise HFCheckpointError(f"{family} needs GPTConfig.{name}={want!r}, got {value!r}.")
    if cfg.rope_scaling and cfg.rope_scaling.get("rope_type") not in rope_types:
        raise HFCheckpointError(f"rope_scaling {cfg.rope_scaling!r} is not supported.")


def decoder_hf(cfg: GPTConfig, act: str = "silu", partial_rotary: bool = False) -> dict:
    """transformers config kwargs of a Llama-style decoder; `partial_rotary`: as
    transformers 5's rope_parameters with cfg.rotary_percent as partial_rotary_factor (the
    families that read it there)."""
    out = dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.ffn_hidden_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_query_groups or cfg.num_attention_heads,
        head_dim=cfg.head_dim,
        hidden_act=act,
        max_position_embeddings=cfg.seq_length,
        rms_norm_eps=cfg.norm_epsilon,
        initializer_range=cfg.init_method_std,
        tie_word_embeddings=cfg.tie_word_embeddings,
        attention_dropout=cfg.attention_dropout,
        # Accepted by transformers 4 as is and converted to rope_parameters by transformers 5.
        rope_theta=float(cfg.rotary_base),
        rope_scaling=dict(cfg.rope_scaling) if cfg.rope_scaling else None,
    )
    if partial_rotary:
        out["rope_parameters"] = {"rope_type": "default", **(out.pop("rope_scaling") or {}),
                                  "rope_theta": out.pop("rope_theta"),
                                  "partial_rotary_factor": cfg.rotary_percent}
    return out


def sliding_window_hf(cfg: GPTConfig) -> dict:
    """transformers config kwargs of a Qwen-style window (use_sliding_window, sliding_window,
    layer_types; max_window_layers too where the windowed layers are the last ones)."""
    if cfg.sliding_window is None:
        return {}
    types = list(cfg.layer_types or ["sliding_attention"] * cfg.num_layers)
    full = types.count("full_attention")
    out = dict(use_sliding_window=True, sliding_window=cfg.sliding_window, layer_types=types)
    if types == ["full_attention"] * full + ["sliding_attention"] * (len(types) - full):
        out["max_window_layers"] = full
    return out


def linear_attention_hf(cfg: GPTConfig) -> dict:
    """transformers config kwargs of a Gated DeltaNet hybrid."""
    la = cfg.linear_attention
    return dict(layer_types=list(cfg.layer_types), linear_conv_kernel_dim=la.conv_kernel_dim,
                linear_key_head_dim=la.key_head_dim, linear_value_head_dim=la.value_head_dim,
                linear_num_key_heads=la.num_key_heads, linear_num_value_heads=la.num_value_heads)


def moe_hf(cfg: GPTConfig) -> dict:
    return dict(
        num_experts_per_tok=cfg.moe_router_topk,
        moe_intermediate_size=cfg.moe_ffn_hidden_size or cfg.ffn_hidden_size,
        norm_topk_prob=not cfg.moe_router_pre_softmax,
    )


def gated_shared_expert_hf(cfg: GPTConfig, family: str) -> dict:
    """transformers config kwargs of gated_shared_expert's fields."""
    if not cfg.num_moe_experts or not cfg.moe_shared_expert_intermediate_size or not cfg.moe_shared_expert_gate:
        raise HFCheckpointError(f"{family} needs num_moe_experts and a gated shared expert "
                                f"(moe_shared_expert_intermediate_size, moe_shared_expert_gate).")
    return moe_hf(cfg) | dict(num_experts=cfg.num_moe_experts,
                              shared_expert_intermediate_size=cfg.moe_shared_expert_intermediate_size)


def sparse_layers_hf(cfg: GPTConfig) -> dict:
    """The Qwen-MoE fields that give cfg's dense/MoE layer pattern."""
    dense = [i for i in range(cfg.num_layers) if not cfg.is_moe_layer(i)]
    return dict(decoder_sparse_step=1, mlp_only_layers=dense)


# ---------------------------------------------------------------- weight tables
def ends(tied: bool, embed: str = "model.embed_tokens.weight", norm: str = "model.norm.weight",
         head: str = "lm_head.weight") -> list[Entry]:
    """Embedding, final norm and output layer (reading the embedding when tied)."""
    return [
        Entry("embedding.word_embeddings.weight", (embed,), Vocab(), (("V", "h"),)),
        Entry("decoder.final_layernorm.weight", (norm,), Replicated(), (("h",),)),
        Entry("output_layer.weight", (embed if tied else head,), Vocab(), (("V", "h"),),
              export=not tied),
    ]


def norm(mcore: str, hf: str, size: str = "h") -> Entry:
    return Entry(M + mcore, (H + hf,), Replicated(), ((size,),))


def attention(qkv_bias: bool = False, qk_norm: bool = False, attn: str = "self_attn.",
              norms: tuple[str, str] = ("input_layernorm", "post_attention_layernorm")) -> list[Entry]:
    """GQA attention with fused QKV, its input norm and the norm before the MLP (`norms`: their
    HF names)."""
    out = [
        norm("input_layernorm.weight", norms[0] + ".weight"),
        Entry(M + "self_attention.linear_qkv.weight",
              tuple(H + f"{attn}{p}_proj.weight" for p in "qkv"), QKV(),
              (("q", "h"), ("kv", "h"), ("kv", "h"))),
        Entry(M + "self_attention.linear_proj.weight", (H + f"{attn}o_proj.weight",), Split(1),
              (("h", "q"),)),
        norm("pre_mlp_layernorm.weight", norms[1] + ".weight"),
    ]
    if qkv_bias:
        out.append(Entry(M + "self_attention.linear_qkv.bias",
                         tuple(H + f"{attn}{p}_proj.bias" for p in "qkv"), QKV(),
                         (("q",), ("kv",), ("kv",))))
    if qk_norm:
        out += [norm("self_attention.q_layernorm.weight", f"{attn}q_norm.weight", "d"),
                norm("self_attention.k_layernorm.weight", f"{attn}k_norm.weight", "d")]
    return out


def gated_attention(attn: str = "self_attn.") -> list[Entry]:
    """Attention with per-head q/k norms whose q_proj also projects a per-head output gate
    ([q_h; gate_h] per head; mcore's attention_output_gate), and the layer's two norms."""
    plain = [e for e in attention(qk_norm=True, attn=attn) if not e.mcore.endswith("linear_qkv.weight")]
    return plain + [Entry(M + "self_attention.linear_qkv.weight",
                          tuple(H + f"{attn}{p}_proj.weight" for p in "qkv"), GatedQKV(),
                          (("q2", "h"), ("kv", "h"), ("kv", "h")))]


def gated_delta_net(cfg: GPTConfig, grouped: bool = False, attn: str = "linear_attn.") -> list[Entry]:
    """A Gated DeltaNet layer (model/gated_delta_net.py), its in_proj [q k v z b a] made of
    in_proj_qkv, in_proj_z, in_proj_b and in_proj_a (Qwen3.5), or with `grouped` of
    in_proj_qkvz and in_proj_ba laid out per key head (Qwen3-Next). Its output norm is a plain
    RMSNorm (the weight as HF stores it)."""
    la = cfg.linear_attention
    k, v, heads = la.num_key_heads * la.key_head_dim, la.num_value_heads * la.value_head_dim, la.num_value_heads
    conv = ((0, 0, k), (0, k, k), (0, 2 * k, v))
    if grouped:
        per_k = la.num_value_heads // la.num_key_heads  # value heads per key head
        names = tuple(H + f"{attn}{n}.weight" for n in ("in_proj_qkvz", "in_proj_ba"))
        dk, dv = la.key_head_dim, la.value_head_dim
        in_proj = Entry(M + "self_attention.in_proj.weight", names, KeyHeadGroups(
            la.num_key_heads, ((dk, dk, per_k * dv, per_k * dv), (per_k, per_k))),
            (("lc+lv", "h"), ("2lh", "h")))
    else:
        names = tuple(H + f"{attn}{n}.weight" for n in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"))
        in_proj = Entry(M + "self_attention.in_proj.weight", names,
                        Sections(conv + ((1, 0, v), (2, 0, heads), (3, 0, heads))),
                        (("lc", "h"), ("lv", "h"), ("lh", "h"), ("lh", "h")))
    return [
        in_proj,
        Entry(M + "self_attention.conv1d.weight", (H + f"{attn}conv1d.weight",), Sections(conv),
              (("lc", "1", "ck"),)),
        Entry(M + "self_attention.A_log", (H + f"{attn}A_log",), Split(0), (("lh",),)),
        Entry(M + "self_attention.dt_bias", (H + f"{attn}dt_bias",), Split(0), (("lh",),)),
        norm("self_attention.out_norm.weight", f"{attn}norm.weight", "dv"),
        Entry(M + "self_attention.out_proj.weight", (H + f"{attn}out_proj.weight",), Split(1),
              (("h", "lv"),)),
    ]


def gated_mlp(mcore: str, hf: str, names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
              size: str = "f", expert: bool = False) -> list[Entry]:
    """fc1 = [gate; up] and fc2 = down of a gated MLP under `mcore` / `hf` prefixes."""
    gate, up, down = (f"{hf}{n}.weight" for n in names)
    return [
        Entry(mcore + "linear_fc1.weight", (gate, up), GateUp(), ((size, "h"), (size, "h")),
              expert=expert),
        Entry(mcore + "linear_fc2.weight", (down,), Split(1), (("h", size),), expert=expert),
    ]


def dense_mlp(hf: str = H + "mlp.") -> list[Entry]:
    return gated_mlp(M + "mlp.", hf)


def experts(hf: str, names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
            router: str = H + "mlp.gate.weight") -> list[Entry]:
    """The router and the routed experts (`hf`: the prefix of expert {E})."""
    return [Entry(M + "mlp.router.weight", (router,), Replicated(), (("E", "h"),))] + gated_mlp(
        M + "mlp.experts.local_experts.{E}.", hf, names, size="mf", expert=True)


def shared_expert(hf: str = H + "mlp.shared_expert.",
                  gate: Optional[str] = H + "mlp.shared_expert_gate.weight") -> list[Entry]:
    """The shared expert, tensor-parallel like a dense MLP (not over expert-TP), and its sigmoid
    gate, a replicated [1, h] weight (`gate`: its HF name; None: ungated)."""
    out = gated_mlp(M + "mlp.shared_experts.", hf, size="sf")
    if gate:
        out.append(Entry(M + "mlp.shared_experts.gate_weight", (gate,), Replicated(), (("1", "h"),)))
    return out


def renamed(entries: list[Entry], old: str, new: str) -> list[Entry]:
    """The table with each HF name that starts with `old` starting with `new` instead (a decoder
    nested in a bigger model: "model." -> "model.language_model.")."""
    return [dataclasses.replace(e, hf=tuple(new + n[len(old):] if n.startswith(old) else n
                                            for n in e.hf)) for e in entries]


def module_entries(module, mcore: str, hf: str) -> list[Entry]:
    """One-to-one, replicated entries for every parameter of a module kept as transformers
    builds it (a vision encoder): mcore `<mcore><name>` <-> HF `<hf><name>`, shapes as numbers."""
    return [Entry(mcore + name, (hf + name,), Replicated(), (tuple(str(d) for d in p.shape),))
            for name, p in module.named_parameters()]
