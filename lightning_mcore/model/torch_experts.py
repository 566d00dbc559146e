"""Routed experts on torch's grouped GEMM, with the per-expert token counts left on the GPU.

mcore's grouped experts (Transformer Engine's GroupedLinear) take the counts as host integers, so
every MoE layer of every micro batch copies them off the GPU and waits: the host stops queueing
work until the GPU has caught up to the router. `torch.nn.functional.grouped_mm` reads the
group boundaries from a device tensor instead. With one expert-parallel rank and expert-TP 1
nothing else needs the counts on the host (the permutation is sized tokens x top-k in dropless
routing), so the dispatcher's copy and wait are skipped too; with more ranks the all-to-all
needs its split sizes on the host anyway and only the expert GEMMs change.

The parameters are a SequentialMLP's (`local_experts.<e>.linear_fc1.weight`, [out, in] each):
checkpoints, Hugging Face mappings and dist-checkpoint resharding are the ones of mcore's
other expert layers. Each is made a view of one [experts, out, in] tensor when the layer is
built, and the GEMM reads that tensor as it is. Stacking per call copied every expert's weights
once per GEMM: in a decode step of 64 rows that copy took 41% of the GPU's time (session 25's
profile of the Qwen3-30B-A3B shape). Where something has moved the weights since (mcore's DDP
puts trained parameters in its own buffer; an offloaded reference comes back elsewhere) the GEMM
stacks them again, as before.

    tokens sorted by expert  ->  x [T, h]        offsets = cumsum(counts)  (device, int32)
    fc1: grouped_mm(x, W1 [E, h, f(x2 gated)], offsets) -> act * router prob -> fc2 likewise
"""

from __future__ import annotations

import copy
import dataclasses
import functools

import torch
import torch.nn.functional as F
from megatron.core.fusions.fused_bias_swiglu import weighted_bias_swiglu_impl
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher
from megatron.core.transformer.spec_utils import ModuleSpec

from lightning_mcore.model import inference_context
from lightning_mcore.model.generation_dispatcher import GenerationDispatcher, serves_generation

grouped_mm = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm")


def stacked_view(weights: list) -> torch.Tensor | None:
    """The experts' weights [out, in] as one [E, out, in] view where they lie back to back in one
    storage, in expert order (as TorchGroupedMLP lays them out); None where they do not."""
    first = weights[0]
    step = first.numel() * first.element_size()
    if first.is_contiguous() and all(w.shape == first.shape and w.is_contiguous()
                                     and w.data_ptr() == first.data_ptr() + e * step
                                     for e, w in enumerate(weights)):
        return first.detach().as_strided((len(weights), *first.shape), (first.numel(), *first.stride()))
    return None


def stacked(weights: list) -> torch.Tensor:
    """The experts' weights as one [E, out, in] tensor: `stacked_view`, else a stacked copy."""
    view = stacked_view(weights)
    return torch.stack([w.detach() for w in weights]) if view is None else view


def lay_out_back_to_back(weights: list) -> None:
    """Make each expert's weight a view of one new [E, out, in] tensor holding their values."""
    with torch.no_grad():
        block = torch.stack([w.detach() for w in weights])
    for w, row in zip(weights, block):
        w.data = row


class GroupedExpertLinear(torch.autograd.Function):
    """y[rows of expert e] = x[those rows] @ W_e^T for weights W_e [out, in], the rows of each
    expert contiguous and ending at `offsets` (device, int32); the weights read through
    `stacked` (a view where they lie back to back; else a copy made per GEMM and not kept)."""

    @staticmethod
    def forward(ctx, x, offsets, *weights):
        trained = any(w.requires_grad for w in weights)  # x serves the weights' gradients only (LoRA: frozen)
        ctx.save_for_backward(x if trained else None, offsets, *weights)
        return grouped_mm(x, stacked(weights).transpose(1, 2), offs=offsets)

    @staticmethod
    def backward(ctx, dy):
        x, offsets, *weights = ctx.saved_tensors
        dy = dy.contiguous()
        dx = dws = None
        if ctx.needs_input_grad[0]:
            dx = grouped_mm(dy, stacked(weights), offs=offsets)  # [T, out] @ [E, out, in]
        if any(ctx.needs_input_grad[2:]):  # frozen experts (LoRA) skip their weights' GEMM
            dws = grouped_mm(dy.t(), x, offs=offsets).unbind(0)  # per expert dy_e^T x_e: [E, out, in]
        return dx, None, *(dws or [None] * len(weights))


class StackedExpertLinear(torch.autograd.Function):
    """GroupedExpertLinear for weights already stacked, [E, out, in] (a LoRA adapter's A and B,
    frozen experts' weights read in place): no per-call unbinding and restacking, which cost more
    host time than the GEMMs in decoding, and one operand for autograd instead of one per expert."""

    @staticmethod
    def forward(ctx, x, offsets, weight):
        ctx.save_for_backward(x if weight.requires_grad else None, offsets, weight)  # x: the weight's gradient
        return grouped_mm(x, weight.transpose(1, 2), offs=offsets)

    @staticmethod
    def backward(ctx, dy):
        x, offsets, weight = ctx.saved_tensors
        dy = dy.contiguous()
        dx = grouped_mm(dy, weight, offs=offsets) if ctx.needs_input_grad[0] else None
        dw = grouped_mm(dy.t(), x, offs=offsets) if ctx.needs_input_grad[2] else None
        return dx, None, dw


def _expert_of_rows(offsets: torch.Tensor, rows: int) -> torch.Tensor:
    """The expert of each of `rows` rows sorted by expert (rows of expert e end at offsets[e])."""
    return torch.searchsorted(offsets, torch.arange(rows, device=offsets.device, dtype=offsets.dtype), right=True)


def grouped_lora_update(adapter, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """scale * B_e A_e x on each expert's rows, for a layer's stacked expert adapter
    (lora/adapters.py: lora_A [E, r, in], lora_B [E, out, r]): two more grouped GEMMs of rank r."""
    if adapter.dropout and adapter.training:
        x = F.dropout(x, adapter.dropout)
    h = StackedExpertLinear.apply(x, offsets, adapter.lora_A)  # [T, r]
    return StackedExpertLinear.apply(h, offsets, adapter.lora_B) * adapter.scale


class TorchGroupedMLP(SequentialMLP):
    """A SequentialMLP computed as two grouped GEMMs whose group offsets stay on the device.
    `lora_adapters` ({"linear_fc1": adapter, ...}, set by lora/adapters.py; not submodules, the
    adapters live in the model's LoRA dict): each adds its update to its GEMM's output.
    `base_gemms` (same keys, set by lora/fp8_gemm.py): a GEMM of the frozen base's own (its FP8
    codes) that replaces the grouped GEMM on the weights while it is `active`."""

    lora_adapters: dict = {}
    base_gemms: dict = {}  # {"linear_fc1": gemm}: a frozen base's own GEMM where `gemm.active` (lora/fp8_gemm.py)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        for name in ("linear_fc1", "linear_fc2"):
            lay_out_back_to_back([getattr(e, name).weight for e in self.local_experts])

    def forward(self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert: torch.Tensor,
                permuted_probs: torch.Tensor, **unused):
        x, probs = permuted_local_hidden_states, permuted_probs
        if self.config.moe_apply_probs_on_input:  # top-1 routing scales the input instead (mcore's rule)
            x, probs = (probs.unsqueeze(-1) * x).to(x.dtype), torch.ones_like(probs)
        offsets = torch.cumsum(tokens_per_expert.to(x.device, non_blocking=True), 0).to(torch.int32)
        rows = _expert_of_rows(offsets, x.shape[0]) if self.config.add_bias_linear else None
        intermediate = self._activation(self._linear("linear_fc1", x, offsets, rows), probs)
        return self._linear("linear_fc2", intermediate, offsets, rows, probs), None

    def _linear(self, name: str, x: torch.Tensor, offsets: torch.Tensor, rows=None, probs=None) -> torch.Tensor:
        """The experts' `name` linear on their rows, plus each row's expert bias (`rows`: the
        expert of each row; fc2's bias scaled by the router probability `probs`, as mcore's
        experts add it: p * (W2 act + b2) with the activation already scaled)."""
        gemm = self.base_gemms.get(name)
        if gemm is not None and gemm.active:
            out = gemm(x, offsets)
        else:
            weights = [getattr(e, name).weight for e in self.local_experts]
            block = None if any(w.requires_grad for w in weights) else stacked_view(weights)
            if block is not None:  # frozen (LoRA) and in place: autograd sees one [E, out, in] operand
                out = StackedExpertLinear.apply(x, offsets, block)
            else:
                out = GroupedExpertLinear.apply(x, offsets, *weights)
        adapter = self.lora_adapters.get(name)
        if adapter is not None and adapter.enabled and not adapter.merged:
            out = out + grouped_lora_update(adapter, x, offsets).to(out.dtype)
        if rows is not None:
            bias = torch.stack([getattr(e, name).bias for e in self.local_experts])[rows]
            out = out + (bias if probs is None else (bias * probs.unsqueeze(-1)).to(out.dtype))
        return out

    def _activation(self, x: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        """The activation scaled by each token's router probability, as mcore's expert MLP
        computes it (its fused SwiGLU where the config fuses, else in the activation's dtype)."""
        cfg = self.config
        if cfg.bias_activation_fusion and cfg.activation_func == F.silu and cfg.gated_linear_unit:
            return weighted_bias_swiglu_impl(x, None, probs.unsqueeze(-1), cfg.activation_func_fp8_input_store)
        if cfg.gated_linear_unit:
            x_glu, x_linear = torch.chunk(x, 2, dim=-1)
            if (clamp := getattr(cfg, "activation_func_clamp_value", None)) is not None:
                x_glu, x_linear = x_glu.clamp(max=clamp), x_linear.clamp(min=-clamp, max=clamp)
            x = cfg.activation_func(x_glu) * (x_linear + cfg.glu_linear_offset)
        else:
            x = cfg.activation_func(x)
        return (x * probs.unsqueeze(-1)).to(x.dtype)

    def backward_dw(self):
        """Weight gradients come from autograd with the rest of the backward."""


class DeviceCountsDispatcher(MoEAlltoAllTokenDispatcher):
    """mcore's all-to-all dispatcher that hands the experts their counts on the device: no copy
    to the host and no wait for it. Valid only where nothing else reads them on the host (one
    EP rank, expert-TP 1, dropless, unpadded); `uses_device_counts` says where that holds."""

    def _maybe_dtoh_and_synchronize(self, point, tokens_per_expert=None):
        return tokens_per_expert


def uses_device_counts(dispatcher, config) -> bool:
    return (type(dispatcher) is MoEAlltoAllTokenDispatcher and dispatcher.ep_size == 1
            and dispatcher.tp_size == 1 and not dispatcher.drop_and_pad
            and config.moe_expert_capacity_factor is None
            and not getattr(config, "moe_router_padding_for_quantization", False))


class TorchGroupedMoELayer(MoELayer):
    """mcore's MoE layer whose dispatcher, where the counts need not reach the host, is the
    DeviceCountsDispatcher (the same object mcore built; only the host copy is left out); while
    generating, where it can, the GenerationDispatcher (model/generation_dispatcher.py)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if uses_device_counts(self.token_dispatcher, self.config):
            self.token_dispatcher.__class__ = DeviceCountsDispatcher
        self.training_dispatcher = self.token_dispatcher
        self.generation_dispatcher = None
        if serves_generation(self.token_dispatcher, self.config):
            self.generation_dispatcher = GenerationDispatcher(self.config, self.token_dispatcher)

    def forward(self, hidden_states, *args, **kwargs):
        generating = self.generation_dispatcher is not None and inference_context.is_active()
        self.token_dispatcher = self.generation_dispatcher if generating else self.training_dispatcher
        return super().forward(hidden_states, *args, **kwargs)


def with_torch_experts(spec: ModuleSpec) -> ModuleSpec:
    """A layer spec whose MoE MLP runs its routed experts on torch's grouped GEMM. `spec` comes
    from mcore's builders with moe_grouped_gemm=False (a SequentialMLP); its expert linears become
    mcore's own, as the grouped GEMM reads only their weights. mcore writes the MoE MLP as a
    partial of MoELayer."""
    spec = copy.deepcopy(spec)
    mlp = spec.submodules.mlp
    if mlp.func is not MoELayer:
        raise ValueError(f"torch experts replace an MoELayer, not {mlp.func!r}.")
    linears = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
    moe = dataclasses.replace(mlp.keywords["submodules"],
                              experts=functools.partial(TorchGroupedMLP, submodules=linears))
    spec.submodules.mlp = functools.partial(TorchGroupedMoELayer, *mlp.args, **{**mlp.keywords, "submodules": moe})
    return spec
