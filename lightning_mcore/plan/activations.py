"""Activation bytes of one rank: the tensors a forward pass keeps for backward, per layer and
micro batch, times the micro batches a pipeline stage holds in flight.

The per-layer count follows Korthikanti et al. 2022 ("Reducing Activation Recomputation in
Large Transformer Models"), redone for this layer: RMSNorm, grouped-query attention with RoPE,
a SwiGLU MLP, no dropout, and attention without the s x s scores (TE's fused attention, and
torch's flash SDPA on CPU, keep none). Per token of a rank, in elements:

    each norm        input + output                      2h   (x2 norms)
    attention        mixed q|k|v (v stays a view of it)   q + 2kv (+ q: output gate)
                     q, k after RoPE                      q + kv
                     attention output (linear_proj's in)  q
    dense MLP        fc1 output (SwiGLU's in)             2f
                     SwiGLU output (fc2's in)             f
    routed experts   per token copy (top-k copies):       h in + 2f/etp + f/etp + h out
    router           fp32 logits and probabilities        4E (bf16 elements)

h-sized tensors are split over tensor-parallel ranks under sequence parallelism, the others
always; context parallelism splits the tokens. Routing is assumed balanced (each rank gets
k x its tokens' share of copies) and without a capacity limit (a capacity factor in `extra`
caps it). Recompute keeps what mcore's checkpointing keeps: a unit's input (full), or drops
the recomputed part (selective)."""

from __future__ import annotations

from dataclasses import dataclass

from lightning_mcore.plan.inputs import PlanInputs


@dataclass(frozen=True)
class LayerActivations:
    """Elements per token a layer keeps for backward: the parts selective recompute can drop."""

    norms: int  # inputs of the two norms
    norm_outputs: int  # their outputs ('layernorm' recompute drops them)
    attention: int
    mlp: int  # dense MLP or shared experts ('mlp' / 'shared_experts' drop them)
    routed: float  # routed experts ('moe' drops them, 'moe_act' the SwiGLU outputs)
    routed_act: float
    hidden: int  # one h vector (a recompute unit's input)

    @property
    def total(self) -> float:
        return self.norms + self.norm_outputs + self.attention + self.mlp + self.routed


def layer_activations(inputs: PlanInputs, layer: int) -> LayerActivations:
    """Elements per token of this rank that `layer` keeps."""
    m, p = inputs.model, inputs.parallel
    tp = p.tensor_model_parallel_size
    etp = p.expert_tensor_parallel_size or tp
    h = m.hidden_size // (tp if p.sequence_parallel else 1)
    q = m.num_attention_heads * m.head_dim
    kv = (m.num_query_groups or m.num_attention_heads) * m.head_dim
    attention = (q + 2 * kv) + (q + kv) + q + (2 * q if m.attention_output_gate else 0)
    attention //= tp
    swiglu = 3 if inputs.fused else 5  # unfused: fc1 output, silu(gate), up, their product
    mlp, routed, routed_act = swiglu * m.ffn_hidden_size // tp, 0.0, 0.0
    if m.is_moe_layer(layer):
        ffn, k = m.moe_ffn_hidden_size or m.ffn_hidden_size, m.moe_router_topk
        copies = k * etp / tp
        capacity = m.extra.get("moe_expert_capacity_factor")
        if capacity:
            copies = min(copies, capacity * k * etp / tp)
        routed = copies * (2 * m.hidden_size + swiglu * ffn // etp) + 4 * m.num_moe_experts
        routed_act = copies * ffn // etp
        mlp = swiglu * (m.moe_shared_expert_intermediate_size or 0) // tp
    norm_outputs = 2 * h if inputs.fused else 4 * h
    return LayerActivations(norms=2 * h, norm_outputs=norm_outputs, attention=attention, mlp=mlp,
                            routed=routed, routed_act=routed_act, hidden=h)


def kept(inputs: PlanInputs, act: LayerActivations) -> float:
    """Elements per token a layer keeps under selective recompute (or none)."""
    m = inputs.model
    if m.recompute_granularity != "selective":
        return act.total
    modules = set(m.recompute_modules or ["core_attn"])  # core_attn: nothing with flash kernels
    total = act.total
    if "layernorm" in modules:
        total -= act.norm_outputs
    if ("mlp" in modules and not act.routed) or ("shared_experts" in modules and act.routed):
        total -= act.mlp
    if "moe" in modules:
        total -= act.routed
    elif "moe_act" in modules:
        total -= act.routed_act
    return total


def stage_layers(inputs: PlanInputs, stage: int) -> list[list[int]]:
    """The global layer numbers of each model chunk of pipeline rank `stage`."""
    p, m = inputs.parallel, inputs.model
    pp, vpp = p.pipeline_model_parallel_size, p.virtual_stages
    n = m.num_layers // (pp * vpp)
    return [list(range((c * pp + stage) * n, (c * pp + stage + 1) * n)) for c in range(vpp)]


def in_flight(inputs: PlanInputs, stage: int) -> float:
    """Micro batches whose activations a stage holds at once, in whole-stage units: 1F1B's
    warm-up (pp - stage), interleaved's (2 (pp - stage - 1) + (vpp - 1) pp + 1 chunks of 1/vpp
    of the stage), both at most the step's micro batches."""
    p = inputs.parallel
    pp, vpp, micro = p.pipeline_model_parallel_size, p.virtual_stages, inputs.num_microbatches
    if pp == 1:
        return 1.0
    if vpp == 1:
        return float(min(pp - stage, micro))
    return min(2 * (pp - stage - 1) + (vpp - 1) * pp + 1, micro * vpp) / vpp


def stage_activation_elements(inputs: PlanInputs, stage: int) -> float:
    """Elements the layers of `stage` keep for backward at the peak (per micro batch times the
    micro batches in flight, plus what recompute brings back for one unit at a time)."""
    m, p = inputs.model, inputs.parallel
    tokens = m.seq_length * inputs.micro_batch_size // p.context_parallel_size
    layers = [layer for chunk in stage_layers(inputs, stage) for layer in chunk]
    acts = [layer_activations(inputs, layer) for layer in layers]
    flight = in_flight(inputs, stage)
    if m.recompute_granularity != "full":
        return tokens * flight * sum(kept(inputs, a) for a in acts)
    n = m.recompute_num_layers or 1
    per_chunk = len(stage_layers(inputs, stage)[0])
    if m.recompute_method == "block":  # the first n of each chunk recompute, the rest keep all
        held = sum(a.hidden if i % per_chunk < n else a.total for i, a in enumerate(acts))
        return tokens * (flight * held + max(a.total for a in acts))
    units = -(-per_chunk // n) * len(stage_layers(inputs, stage))
    unit = max(sum(a.total for a in acts[i:i + n]) for i in range(0, len(acts), n))
    return tokens * (flight * units * acts[0].hidden + unit)


def logits_elements(inputs: PlanInputs) -> int:
    """The last stage's logits of one micro batch: tokens x the rank's vocab slice."""
    m, p = inputs.model, inputs.parallel
    tp = p.tensor_model_parallel_size
    tokens = m.seq_length * inputs.micro_batch_size // p.context_parallel_size
    return tokens * m.padded_vocab_size(tp) // tp


def embedding_elements(inputs: PlanInputs, stage: int) -> int:
    """The final norm's input and output (last stage; unfused also x * rstd)."""
    m, p = inputs.model, inputs.parallel
    if stage != p.pipeline_model_parallel_size - 1:
        return 0
    tp = p.tensor_model_parallel_size
    h = m.hidden_size // (tp if p.sequence_parallel else 1)
    return m.seq_length * inputs.micro_batch_size // p.context_parallel_size * (2 if inputs.fused else 3) * h
