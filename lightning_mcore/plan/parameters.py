"""Exact parameter counts of one rank's model chunks, from the config: the sizes mcore's layers
and our additions (q/k norms across heads, post norms, LoRA adapters, the vision encoder) give
their weights, per tensor-parallel, expert-parallel and pipeline rank.

    pp=2, 4 layers, untied:  stage 0: embedding + layers 0-1     stage 1: layers 2-3 + norm + head
    tied (pp=1): the head reuses the embedding; pp>1: the last stage keeps its own copy.

Multi-latent and linear attention are not counted (PlanError)."""

from __future__ import annotations

from dataclasses import dataclass

from lightning_mcore.lora.config import adapts_experts, resolve_targets
from lightning_mcore.lora.quantized_base import CODECS
from lightning_mcore.plan.inputs import PlanInputs


class PlanError(ValueError):
    """A model the plan cannot count; `fields`: the model config fields involved."""

    def __init__(self, message: str, fields: tuple = ()) -> None:
        super().__init__(message)
        self.fields = tuple(fields)


@dataclass(frozen=True)
class ParameterCount:
    """One rank's parameters: trained dense ones (reduced over data parallel), trained routed
    experts' (over expert data parallel) and frozen ones (no gradient, no optimizer state)."""

    dense: int = 0
    experts: int = 0
    frozen: int = 0
    # LoRA over a quantized base (lora/quantized_base.py): the frozen weights held as codes, the
    # codes' bytes (fp8: 1 a weight, nf4 and mxfp4: 1/2), their scales' bytes (fp8: an fp32 one a
    # row, nf4: an fp32 one per 64 inputs, mxfp4: a byte per 32; buffers, not parameters), and the
    # largest weight (a linear, or a layer's [E, out, in] experts block) dequantized for one call
    quantized: int = 0
    code_bytes: int = 0
    scale_bytes: int = 0
    largest_quantized: int = 0

    def __add__(self, other: "ParameterCount") -> "ParameterCount":
        return ParameterCount(self.dense + other.dense, self.experts + other.experts, self.frozen + other.frozen,
                              self.quantized + other.quantized, self.code_bytes + other.code_bytes,
                              self.scale_bytes + other.scale_bytes, max(self.largest_quantized, other.largest_quantized))

    @property
    def trainable(self) -> int:
        return self.dense + self.experts

    @property
    def total(self) -> int:
        return self.trainable + self.frozen


@dataclass(frozen=True)
class _Linears:
    """(out, in) of one layer's linears under mcore's names, on this rank, and its other weights."""

    dense: dict  # name -> (out, in, bias) of the attention and dense/shared MLP linears
    experts: dict  # name -> (local experts, out, in, bias) of the routed experts
    other: int  # norms, router, sinks, gates


def stage_parameters(inputs: PlanInputs, stage: int) -> ParameterCount:
    """The parameters pipeline rank `stage` holds (every TP/EP rank of a stage holds as many)."""
    m, p = inputs.model, inputs.parallel
    if m.mla is not None or m.linear_attention is not None:
        raise PlanError("the memory plan counts softmax attention with grouped queries only, not "
                        "multi-latent or linear attention", fields=("mla", "linear_attention"))
    pp, vpp = p.pipeline_model_parallel_size, p.virtual_stages
    per_chunk = m.num_layers // (pp * vpp)
    count = ParameterCount()
    for chunk in range(vpp):
        first = (chunk * pp + stage) * per_chunk
        for layer in range(first, first + per_chunk):
            count += _layer(inputs, layer)
        pre = stage == 0 and chunk == 0
        post = stage == pp - 1 and chunk == vpp - 1
        count += _ends(inputs, pre, post)
    return count


def _ends(inputs: PlanInputs, pre: bool, post: bool) -> ParameterCount:
    """Embedding (and the vision encoder) on the first chunk; final norm and output layer on the
    last, the output layer shared with the embedding only where one chunk holds both."""
    m, tp = inputs.model, inputs.parallel.tensor_model_parallel_size
    table = m.padded_vocab_size(tp) // tp * m.hidden_size
    n = 0
    if pre:
        n += table + inputs.vision_parameters
    if post:
        n += m.hidden_size + (0 if (m.tie_word_embeddings and pre) else table)
    return ParameterCount(dense=n) if inputs.lora is None else ParameterCount(frozen=n)


def _layer(inputs: PlanInputs, layer: int) -> ParameterCount:
    lin = _linears(inputs, layer)
    experts = sum(e * (o * i + (o if b else 0)) for e, o, i, b in lin.experts.values())
    dense = lin.other + sum(o * i + (o if b else 0) for o, i, b in lin.dense.values())
    if inputs.lora is None:
        return ParameterCount(dense=dense, experts=experts)
    blocks = _targeted(inputs, lin)
    return ParameterCount(frozen=dense + experts) + _adapters(inputs, blocks) + _quantized(inputs, blocks)


def _targeted(inputs: PlanInputs, lin: _Linears) -> list[tuple[int, int, int, bool]]:
    """(local experts or 1, out, in, routed) of each linear LoRA adapts on this rank."""
    lora = inputs.lora
    targets = resolve_targets(lora.target_modules)
    blocks = [(1, out, inp, False) for name, (out, inp, _) in lin.dense.items() if name.rsplit(".", 1)[-1] in targets]
    if lin.experts and adapts_experts(lora, inputs.model):
        blocks += [(local, out, inp, True) for name, (local, out, inp, _) in lin.experts.items() if name in targets]
    return blocks


def _quantized(inputs: PlanInputs, blocks: list) -> ParameterCount:
    """The targeted linears' weights (`blocks`: _targeted) a quantized base holds as codes
    (biases stay in the weights' dtype)."""
    codec = CODECS.get(inputs.lora.base_precision)
    if codec is None:
        return ParameterCount()
    weights = sum(e * o * i for e, o, i, _ in blocks)
    return ParameterCount(quantized=weights, code_bytes=int(weights * codec.code_bytes),
                          scale_bytes=codec.scale_bytes * sum(e * o * (i // codec.block if codec.block else 1)
                                                              for e, o, i, _ in blocks),
                          largest_quantized=max((e * o * i for e, o, i, _ in blocks), default=0))


def _linears(inputs: PlanInputs, layer: int) -> _Linears:
    m, p = inputs.model, inputs.parallel
    tp = p.tensor_model_parallel_size
    etp = p.expert_tensor_parallel_size or tp
    h, d = m.hidden_size, m.head_dim
    q, kv = m.num_attention_heads * d, (m.num_query_groups or m.num_attention_heads) * d
    qkv = q + 2 * kv + (q if m.attention_output_gate else 0)
    bias = m.add_bias_linear
    dense = {"linear_qkv": (qkv // tp, h, m.add_qkv_bias or bias), "linear_proj": (h, q // tp, bias)}
    other = 2 * h  # input and pre-MLP norms (TE fuses the first into linear_qkv: same size)
    if m.qk_layernorm:
        other += q + kv if m.qk_norm_across_heads else 2 * d
    if m.attention_sinks:
        other += m.num_attention_heads // tp
    if m.post_norms:
        other += 2 * h
    experts = {}
    if m.is_moe_layer(layer):
        e, ffn = m.num_moe_experts, m.moe_ffn_hidden_size or m.ffn_hidden_size
        other += e * h + (e if bias else 0)  # router
        local = e // p.expert_model_parallel_size
        experts = {"linear_fc1": (local, 2 * ffn // etp, h, bias), "linear_fc2": (local, h, ffn // etp, bias)}
        shared = m.moe_shared_expert_intermediate_size
        if shared:
            dense.update({"shared_experts.linear_fc1": (2 * shared // tp, h, bias),
                          "shared_experts.linear_fc2": (h, shared // tp, bias)})
            other += h if m.moe_shared_expert_gate else 0
    else:
        dense.update({"linear_fc1": (2 * m.ffn_hidden_size // tp, h, bias),
                      "linear_fc2": (h, m.ffn_hidden_size // tp, bias)})
    return _Linears(dense, experts, other)


def _adapters(inputs: PlanInputs, blocks: list) -> ParameterCount:
    """LoRA's A and B of each targeted linear (`blocks`: _targeted; lora/adapters.py), r x (out +
    in) of this rank's shard: a column-parallel linear's A [r, in] is whole and B [out/tp, r]
    sharded like it, a row-parallel one's A [r, in/tp] sharded and B [out, r] whole; routed
    experts' per local expert, sharded over expert-TP."""
    r = inputs.lora.rank
    return ParameterCount(dense=sum(r * (o + i) for _, o, i, routed in blocks if not routed),
                          experts=sum(e * r * (o + i) for e, o, i, routed in blocks if routed))
