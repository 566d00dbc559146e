"""LoRA adapters on mcore's tensor-parallel linears (local spec and Transformer Engine spec).

y = W x + scale * B A x, with scale = alpha / r (rsLoRA: alpha / sqrt(r)). Which of A and B is
sharded follows the base layer, so no rank ever holds a full base-sized product:

    column-parallel (linear_qkv, linear_fc1): W [out/tp, in]   A [r, in] replicated, B [out/tp, r]
        h = A x, then copy to TP ranks (backward all-reduce) or, with sequence parallel,
        all-gather h over the sequence (A's gradient is then per sequence shard: summed over TP
        by mcore's finalize_model_grads, as for norms)
    row-parallel (linear_proj, linear_fc2):   W [out, in/tp]   A [r, in/tp], B [out, r] replicated
        h = A x is partial: all-reduce it (sequence parallel: reduce-scatter over the sequence,
        and B's gradient is summed over TP like A's above)

MoE experts get one A/B per expert, stacked per layer and linear: mlp.experts.linear_fc1's
lora_A [local experts, r, in] and lora_B [local experts, out, r] on each EP rank, saved as one
tensor over all experts ([experts, r, in], this rank's at its EP offset), so checkpoints reshard
across EP and load into either expert implementation. One parameter per layer and factor, not
per expert: 128 experts x 48 layers would otherwise make ~25k tiny tensors, more than Transformer
Engine's multi-tensor optimizer kernels take in one call (its handle pool) and a host loop per
tensor in mcore's optimizer. The local SequentialMLP hooks each expert's linear with its slice;
Transformer Engine's grouped GEMM (TEGroupedMLP: one linear over all local experts, weight<e>
each, tokens in expert order with per-expert counts m_splits) takes one hook that splits its
input by m_splits and runs each expert's factors on its rows (lora/grouped.py). Their linears do no communication themselves (the token
dispatcher does), so neither does their adapter; they are marked like mcore's expert weights
(`allreduce = False`: gradients reduced over the expert-data-parallel group).

With expert tensor parallelism (ETP ranks e0, e1 hold one expert's shards) the adapter shards
like the expert's linears and, like them, works on the dispatched tokens that every ETP rank of
the expert sees in full; the dispatcher sums the ranks' partial outputs (its reduce-scatter) and
their partial input gradients (the backward of its all-gather):

    fc1 (column): W [out/etp, in] (SwiGLU: rows [gate_i; up_i])  A [r, in] replicated  B_i [out/etp, r]
        e_i: y_i = W_i x + B_i A x   (rows of the output; grad x = A^T B_i^T g_i is partial, as
        the base's). grad A = sum_i B_i^T g_i x^T: each rank holds one term.
    fc2 (row):    W [out, in/etp]    A_i [r, in/etp]  B [out, r] replicated
        e_i: y_i = W_i x_i + B A_i x_i   (partial, summed by the dispatcher with the base's).
        grad B = g sum_i (A_i x_i)^T: each rank holds one term.

So the replicated factor's gradient is partial over the expert-TP group (`expert_tp_partial_grad`)
and is summed there once per step, after mcore's finalize_model_grads (`with_expert_tp_grad_sums`:
mcore sums only dense `sequence_parallel` gradients, over the TP group). Both sums are linear, so
summing after the expert-data-parallel reduction is the same, and it comes after the asynchronous
bucket reductions (overlap_grad_reduce) are finished.

Adapters live in one `lora` submodule per model chunk (keys carry the global layer number, so
checkpoints reshard across PP) and run from forward hooks on the base layers, whose own
parameters, names and checkpoint keys stay untouched and frozen. Only adapter parameters reach
mcore's DDP buffers and optimizer. TE's fused LayerNorm+Linear returns its normalised input
(`return_layernorm_output`), which is what the adapter reads.
"""

from __future__ import annotations

import contextlib
import math
import zlib
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
from megatron.core.tensor_parallel import mappings
from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from lightning_mcore.lora.config import TARGETS, LoRAConfig, LoRAError, adapts_experts, resolve_targets
from lightning_mcore.lora.fp8_gemm import use_fp8_gemm
from lightning_mcore.lora.grouped_base import compute_from_record
from lightning_mcore.lora.grouped import expert_weights, grouped_hook, is_grouped_linear
from lightning_mcore.lora.quantized_base import CODECS, Codec, QuantizationError, merge, quantize_module, unmerge
from lightning_mcore.model.torch_experts import TorchGroupedMLP


class LoRAAdapter(torch.nn.Module):
    """A, B of one base linear; `forward(x)` is the scaled low-rank update of its output. With
    `experts` > 0, the A, B of that many local experts' linears, stacked on a leading dimension
    (`forward(x, e)`: expert e's update)."""

    def __init__(self, kind: str, in_features: int, out_features: int, lora: LoRAConfig,
                 sequence_parallel: bool, dtype: torch.dtype, device, gated: bool = False,
                 experts: int = 0) -> None:
        super().__init__()
        self.gated = gated  # linear_fc1 of SwiGLU: output rows are [gate; up] per TP rank
        self.expert = expert = experts > 0  # routed experts' linears: sharded over expert-TP
        self.experts = experts
        tp = _tp_size(expert)
        self.kind, self.scale, self.sequence_parallel = kind, lora.scale, sequence_parallel
        a_in = in_features // tp if kind == "row" else in_features
        b_out = out_features // tp if kind == "column" else out_features
        lead = (experts,) if expert else ()
        self.lora_A = torch.nn.Parameter(torch.empty(*lead, lora.rank, a_in, dtype=dtype, device=device))
        self.lora_B = torch.nn.Parameter(torch.zeros(*lead, b_out, lora.rank, dtype=dtype, device=device))
        self.bases: list[tuple[str, str]] = []  # (base module path in its layer, weight name) per expert
        # Replicated parameters used on sequence shards: mcore sums their gradients over TP.
        (self.lora_A if kind == "column" else self.lora_B).sequence_parallel = sequence_parallel
        (self.lora_B if kind == "column" else self.lora_A).lora_sharded = tp > 1
        if tp > 1 and not expert:
            # The gradient norm counts a parameter on TP rank 0 only unless it is marked
            # tensor-parallel: the sharded factor is (each rank's shard counts once).
            (self.lora_B if kind == "column" else self.lora_A).tensor_model_parallel = True
        if expert:  # mcore's marker of expert weights: reduced over expert-DP, not DP
            self.lora_A.allreduce = self.lora_B.allreduce = False
            replicated, sharded = (self.lora_A, self.lora_B) if kind == "column" else (self.lora_B, self.lora_A)
            # Replicated over expert-TP with a partial gradient per rank (module docstring).
            replicated.expert_tp_partial_grad = tp > 1
            # The gradient norm counts each expert's factors once per expert-TP group (mcore
            # counts a parameter on TP rank 0 only, on every rank if `tensor_model_parallel`,
            # never if `shared`; the TP rank says nothing about experts).
            sharded.tensor_model_parallel = True
            if _tp_rank(True) == 0:
                replicated.tensor_model_parallel = True
            else:
                replicated.shared = True
        self.dropout = lora.dropout
        self.merged, self.original = False, None
        self.enabled = True  # False: the base model alone (DPO's reference)

    @property
    def tp_axis(self) -> dict:
        """The factor sharded over TP and its axis (of one expert's factor for experts)."""
        return {"lora_B": 0} if self.kind == "column" else {"lora_A": 1}

    def forward(self, x: torch.Tensor, expert: Optional[int] = None) -> torch.Tensor:
        if expert is None:
            return self.update(x, self.lora_A, self.lora_B)
        return self.update(x, self.lora_A[expert], self.lora_B[expert])

    def update(self, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """scale * b a x (dropout on x): `a`, `b` are this adapter's factors or one expert's."""
        if self.dropout and self.training:
            x = F.dropout(x, self.dropout)
        h = F.linear(x, a)
        if self.expert:  # tokens already dispatched to this expert; its linears do no comms
            pass
        elif self.kind == "column":
            h = (mappings.gather_from_sequence_parallel_region(h) if self.sequence_parallel
                 else mappings.copy_to_tensor_model_parallel_region(h))
        else:
            h = (mappings.reduce_scatter_to_sequence_parallel_region(h) if self.sequence_parallel
                 else mappings.reduce_from_tensor_model_parallel_region(h))
        return F.linear(h, b) * self.scale

    def delta(self, expert: Optional[int] = None) -> torch.Tensor:
        """scale * B A for this rank's shard of the base weight (of local expert `expert`)."""
        a, b = (self.lora_A, self.lora_B) if expert is None else (self.lora_A[expert], self.lora_B[expert])
        return (b.float() @ a.float()) * self.scale

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None) -> dict:
        if self.expert:
            return self._expert_sharded_state_dict(prefix)
        out = make_sharded_tensors_for_checkpoint(self.state_dict(keep_vars=True), prefix, self.tp_axis, ())
        if self.gated:  # B's rows are [gate_i; up_i] per rank: saved as [gate; up] at any TP
            out[f"{prefix}lora_B"] = apply_swiglu_sharded_factory(out[f"{prefix}lora_B"], ())
        return out

    def _expert_sharded_state_dict(self, prefix: str) -> dict:
        """A and B as tensors over all experts ([experts, r, in], [experts, out, r]) with this
        rank's experts at its EP offset; the sharded factor also at its expert-TP offset, the
        replicated one whole (a replica on every expert-TP rank but the first); replicated over
        the expert-data-parallel group. So checkpoints reshard across EP and expert-TP.

            fc1 B, ETP=2, EP=2:  global [E, 2*ffn, r] = rows [gate; up] of every expert
              (ep0, etp0) holds experts [0, E/2), rows [gate_0; up_0]  (gate_0 = gate rows 0..ffn/2)
        """
        etp, etp_rank = _tp_size(True), _tp_rank(True)
        dp_rank = parallel_state.get_expert_data_parallel_rank()
        by_ep = (0, parallel_state.get_expert_model_parallel_rank(),
                 parallel_state.get_expert_model_parallel_world_size())
        (sharded, axis), = self.tp_axis.items()
        out = {}
        for n, p in self.named_parameters():
            key = f"{prefix}{n}"
            if n != sharded or etp == 1:
                replica = etp_rank if n != sharded else 0
                out[key] = ShardedTensor.from_rank_offsets(key, p, by_ep, replica_id=(0, replica, dp_rank))
            elif self.gated:  # B's rows are [gate_i; up_i] per rank: saved as [gate; up]
                out[key] = _gated_rows_factory(key, p, by_ep, etp_rank, etp, (0, 0, dp_rank))
            else:
                out[key] = ShardedTensor.from_rank_offsets(key, p, by_ep, (axis + 1, etp_rank, etp),
                                                           replica_id=(0, 0, dp_rank))
        return out


class LoRAAdapters(torch.nn.ModuleDict):
    """The adapters of one model chunk, named by the global path of their base layer."""

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None) -> dict:
        out = {}
        for name, adapter in self.items():
            out.update(adapter.sharded_state_dict(f"{prefix}{name}."))
        return out


def _gated_rows_factory(key: str, data: torch.Tensor, by_ep: tuple, rank: int, size: int, replica_id):
    """Stacked SwiGLU fc1 B [experts, 2*ffn/etp, r] holding rows [gate_i; up_i] of ETP rank i,
    saved as the global [experts, 2*ffn, r] with rows [gate; up]: the two halves are separate
    shards of axis 1 (mcore's apply_swiglu_sharded_factory, on axis 1 of a stacked tensor)."""
    def build(key, t, replica_id, flattened_range):
        gate, up = torch.chunk(t, 2, dim=1)
        return [ShardedTensor.from_rank_offsets(key, gate, by_ep, (1, rank, 2 * size), replica_id=replica_id),
                ShardedTensor.from_rank_offsets(key, up, by_ep, (1, rank + size, 2 * size), replica_id=replica_id)]

    def merge(parts):
        return torch.cat(parts, dim=1)

    return ShardedTensorFactory(key, data, build, merge, replica_id)


def adapter_name(layer_number: int, path: str) -> str:
    """'decoder.layers.<global layer, 0-based>.<path>' with dots as '__' (a ModuleDict key)."""
    return f"decoder.layers.{layer_number - 1}.{path}".replace(".", "__")


def base_path(name: str) -> str:
    return name.replace("__", ".")


def apply_lora(chunks: Sequence[torch.nn.Module], lora: LoRAConfig, seed: int) -> dict[str, float]:
    """Freeze every base parameter (and MoE routing bias) and attach adapters to the targeted
    layers; with base_precision "fp8", "nf4" or "mxfp4", quantize the adapted base weights
    (lora/quantized_base.py) and return the relative error of each kind of them (collective
    then), else {}."""
    adapt_experts = adapts_experts(lora)
    targets = resolve_targets(lora.target_modules)
    for chunk in chunks:
        for p in chunk.parameters():
            p.requires_grad_(False)
        for module in chunk.modules():
            if getattr(module, "expert_bias", None) is not None:
                # mcore moves the aux-loss-free routing bias by token counts after each step,
                # outside the optimizer; a PEFT adapter could not carry that change. Frozen: no
                # update; not enabled: the router no longer counts tokens that nothing reads.
                module.frozen_expert_bias = True
                module.enable_expert_bias = False
        adapters = LoRAAdapters()
        for layer in chunk.decoder.layers:
            for path, module in layer.named_modules():
                short = path.rsplit(".", 1)[-1]
                if short not in targets:
                    continue
                if ".experts." in f".{path}.":
                    if not adapt_experts:
                        continue  # experts=False: the dense and shared-expert MLPs only
                    _check_experts(path, module, lora)
                    _attach_expert(adapters, layer, path, module, lora, seed)
                    continue
                _attach(adapters, layer.layer_number, path, module, lora, seed)
            if adapt_experts:
                _refuse_unadapted_experts(layer, adapters)
        chunk.add_module("lora", adapters)
        embedding = getattr(chunk, "embedding", None)
        if embedding is not None and chunk.config.recompute_granularity is not None:
            embedding.register_forward_hook(_embeddings_require_grad)
    if lora.experts and chunks and not chunks[0].config.num_moe_experts:
        raise LoRAError("LoRA experts=True, but the model has no MoE experts; leave experts unset.")
    if lora.base_precision not in CODECS:
        return {}
    return quantize_bases(chunks, CODECS[lora.base_precision], fp8_gemm=lora.base_gemm == "fp8")


def _embeddings_require_grad(module, args, output):
    """The frozen embedding's output, marked as needing a gradient (what peft's
    enable_input_require_grads does for HF). Recompute runs the layers inside an autograd
    function whose output needs a gradient only if one of its inputs does; the adapters inside
    do not count. With every base weight frozen, the decoder's input needs none, so without this
    no gradient would reach any adapter of a recomputed layer: on one H200 a Qwen3-30B-A3B LoRA
    with full recompute trained at a gradient norm of exactly 0 (RESULTS.md session 27)."""
    if torch.is_grad_enabled() and isinstance(output, torch.Tensor) and not output.requires_grad \
            and output.grad_fn is None:  # (generation runs without grad: no graph to mark)
        output.requires_grad_(True)
    return output


def quantize_bases(chunks, codec: Codec = CODECS["fp8"], fp8_gemm: bool = False) -> dict[str, float]:
    """Hold every adapted base weight as `codec`'s codes (lora/quantized_base.py; torch's grouped
    experts compute from them directly: lora/grouped_base.py), multiplied by FP8 GEMMs with
    `fp8_gemm` (lora/fp8_gemm.py); returns the relative Frobenius error against the loaded weights
    per kind ('linear_qkv', 'experts.linear_fc1', ...), over all ranks (collective)."""
    errors: dict[str, QuantizationError] = {}
    done: set = set()
    for name, adapter, model in adapters_of(chunks):
        layer_index, path = _split(name)
        kind = path.rsplit(".", 2)[-2] + "." + path.rsplit(".", 1)[-1] if adapter.expert else path.rsplit(".", 1)[-1]
        group = None
        if adapter.kind == "row":  # a shard holds part of each row: its max over the TP group
            group = (parallel_state.get_expert_tensor_parallel_group() if adapter.expert
                     else parallel_state.get_tensor_model_parallel_group())
        for base, weight_name in adapter.bases:
            module = _base_module(model, layer_index, base)
            weight = getattr(module, weight_name)
            if id(weight) in done:
                continue
            _check_block_width(codec, weight, f"decoder.layers.{layer_index}.{base}.{weight_name}")
            experts = _base_module(model, layer_index, base.split(".local_experts.")[0]) if adapter.expert else None
            if isinstance(experts, TorchGroupedMLP):  # one block [E, out, in] read by the grouped GEMM
                short = base.rsplit(".", 1)[-1]
                params = [getattr(e, short).weight for e in experts.local_experts]
                block = torch.stack([p.detach() for p in params])
                record = quantize_module(experts, short, params, block, group, codec)
                if fp8_gemm:
                    use_fp8_gemm(experts, record, group, experts_linear=short)
                else:
                    compute_from_record(experts, short, record)
                done.update(id(p) for p in params)
                errors.setdefault(kind, QuantizationError()).add(block, record)
            elif is_grouped_linear(module):
                raise LoRAError(f"LoRA base_precision={codec.name!r} is not done for Transformer Engine's "
                                "grouped experts yet: use moe_grouped_gemm_backend='torch' or base_precision='bf16'.")
            else:
                original = weight.detach().clone()
                record = quantize_module(module, "weight", [weight], original, group, codec)
                if fp8_gemm:
                    use_fp8_gemm(module, record, group)
                done.add(id(weight))
                errors.setdefault(kind, QuantizationError()).add(original, record)
    return _relative_errors(errors)


def _check_block_width(codec: Codec, weight, where: str) -> None:
    """A block of `codec` (nf4: 64 inputs) never straddles a shard, so the codes are the same at
    any layout: this shard's input width must hold whole blocks."""
    width = weight.shape[-1]
    if codec.block and width % codec.block:
        raise LoRAError(
            f"LoRA base_precision={codec.name!r} quantizes blocks of {codec.block} inputs, but {where} "
            f"holds {width} inputs on this rank (not a multiple of {codec.block}): use a tensor-parallel "
            f"size that leaves whole blocks, leave this layer out of target_modules, or use "
            f"base_precision='fp8'.")


def _relative_errors(errors: dict) -> dict[str, float]:
    """Each kind's relative error over all ranks (a kind's replicas count alike on both sides)."""
    kinds = sorted(errors)
    if torch.distributed.is_initialized():
        everyone = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(everyone, {k: (e.error, e.norm) for k, e in errors.items()})
        kinds = sorted({k for part in everyone for k in part})
        errors = {k: QuantizationError(sum(p[k][0] for p in everyone if k in p),
                                       sum(p[k][1] for p in everyone if k in p)) for k in kinds}
    return {k: errors[k].relative for k in kinds}


def _check_experts(path: str, module, lora: LoRAConfig) -> None:
    """Expert adapters exist for the local SequentialMLP and TE's grouped experts, with a rank
    no larger than the expert's (unsharded) dimensions."""
    shape = _full_shape(TARGETS[path.rsplit(".", 1)[-1]][0], expert_weights(module)[0], True)
    if lora.rank > min(shape):
        raise LoRAError(
            f"LoRA rank {lora.rank} is larger than the expert linear {path} "
            f"({shape}): use rank <= {min(shape)}, or experts=False.")


def _tp_size(expert: bool) -> int:
    """The tensor-parallel size of a base linear: expert-TP for a routed expert's, else TP (1
    before mcore's groups exist)."""
    if expert:
        return parallel_state.get_expert_tensor_parallel_world_size() or 1
    return parallel_state.get_tensor_model_parallel_world_size() or 1


def _tp_rank(expert: bool) -> int:
    if expert:
        return parallel_state.get_expert_tensor_parallel_rank() or 0
    return parallel_state.get_tensor_model_parallel_rank() or 0


def _full_shape(kind: str, weight: torch.Tensor, expert: bool) -> tuple[int, int]:
    """(out, in) of the whole linear whose shard is `weight`."""
    tp = _tp_size(expert)
    out_f, in_f = weight.shape
    return (out_f * tp, in_f) if kind == "column" else (out_f, in_f * tp)


def _refuse_unadapted_experts(layer, adapters) -> None:
    """An MoE layer whose experts took no adapter has experts of a kind without linear_fc1 /
    linear_fc2 modules (mcore's legacy GroupedMLP): training would leave them frozen unasked."""
    experts = getattr(getattr(layer, "mlp", None), "experts", None)
    if experts is None:
        return
    prefix = adapter_name(layer.layer_number, "mlp.experts.")
    if not any(name.startswith(prefix) for name in adapters):
        raise LoRAError(
            f"LoRA cannot adapt the experts of layer {layer.layer_number - 1} "
            f"({type(experts).__name__}): use the local SequentialMLP (moe_grouped_gemm=False) or "
            f"Transformer Engine's grouped experts, or LoRAConfig(experts=False).")


def _attach(adapters, layer_number: int, path: str, module, lora: LoRAConfig, seed: int) -> None:
    kind = TARGETS[path.rsplit(".", 1)[-1]][0]
    weight = getattr(module, "weight", None)
    if weight is None or weight.dim() != 2:
        raise LoRAError(f"LoRA cannot adapt {path} ({type(module).__name__}): no 2-D weight.")
    out_f, in_f = _full_shape(kind, weight, False)
    sp = bool(getattr(module.config, "sequence_parallel", False))
    gated = path.endswith("linear_fc1") and bool(getattr(module.config, "gated_linear_unit", False))
    adapter = LoRAAdapter(kind, in_f, out_f, lora, sp, weight.dtype, weight.device, gated)
    adapter.bases = [(path, "weight")]
    name = adapter_name(layer_number, path)
    _init_a(adapter.lora_A, name, in_f, seed, kind, False)
    adapters[name] = adapter
    fused_norm = hasattr(module, "return_layernorm_output")  # TE LayerNorm+Linear
    if fused_norm:
        module.return_layernorm_output = True
    # First among the linear's hooks: a post norm hook (model/post_norm.py) normalises W x + B A x;
    # MLA's kv down projection gathers W x + B A x over TP (model/mla.py).
    module.register_forward_hook(_hook(adapter, fused_norm), with_kwargs=True, prepend=True)


def _attach_expert(adapters, layer, path: str, module, lora: LoRAConfig, seed: int) -> None:
    """Hook a routed expert linear to the layer's stacked adapter (mlp.experts.linear_fc1 /
    fc2), made when the first of its experts is met: SequentialMLP's local_experts.<e>.linear_fc1
    runs slice e; TE's grouped linear (all local experts, weight<e>) runs each slice on its
    expert's rows; torch's grouped experts (TorchGroupedMLP) run the stack in grouped GEMMs."""
    short = path.rsplit(".", 1)[-1]
    head = path.split(".local_experts.")[0] if ".local_experts." in path else path.rsplit(".", 1)[0]  # mlp.experts
    experts = layer.get_submodule(head)
    name = adapter_name(layer.layer_number, f"{head}.{short}")
    if name not in adapters:
        kind = TARGETS[short][0]
        weight = expert_weights(module)[0]
        out_f, in_f = _full_shape(kind, weight, True)
        gated = short == "linear_fc1" and bool(getattr(module.config, "gated_linear_unit", False))
        count = experts.num_local_experts
        adapter = LoRAAdapter(kind, in_f, out_f, lora, False, weight.dtype, weight.device, gated, count)
        adapter.bases = [("", "")] * count
        for local in range(count):  # each expert's A as its own adapter would draw it
            expert_name = adapter_name(layer.layer_number, f"{head}.local_experts."
                                       f"{global_expert(local, module.config)}.{short}")
            _init_a(adapter.lora_A[local], expert_name, in_f, seed, kind, True)
        adapters[name] = adapter
    adapter = adapters[name]
    if is_grouped_linear(module):
        adapter.bases = [(path, f"weight{e}") for e in range(adapter.experts)]
        module.register_forward_hook(grouped_hook(adapter), with_kwargs=True, prepend=True)
        return
    local = int(path.split(".local_experts.")[1].split(".")[0])
    adapter.bases[local] = (path, "weight")
    if isinstance(experts, TorchGroupedMLP):  # reads the linears' weights, never calls them
        experts.lora_adapters = {**experts.lora_adapters, short: adapter}
    else:
        module.register_forward_hook(_hook(adapter, False, local), with_kwargs=True, prepend=True)


def global_expert(local: int, config) -> int:
    per_rank = config.num_moe_experts // parallel_state.get_expert_model_parallel_world_size()
    return parallel_state.get_expert_model_parallel_rank() * per_rank + local


def _hook(adapter: LoRAAdapter, fused_norm: bool, expert: Optional[int] = None):
    def hook(module, args, kwargs, output):
        out, bias = output if isinstance(output, tuple) else (output, None)
        if fused_norm:
            out, x = out
        else:
            x = args[0] if args else next(iter(kwargs.values()))
        if adapter.enabled and not adapter.merged:
            out = out + adapter(x, expert).to(out.dtype)
        return out, bias

    return hook


@torch.no_grad()
def _init_a(a: torch.Tensor, name: str, in_features: int, seed: int, kind: str, expert: bool) -> None:
    """peft's kaiming-uniform(a=sqrt(5)) for A (`a`: an adapter's, or one expert's slice), drawn
    for the full A from a generator seeded by the adapter's name (an expert's: as if it had its
    own adapter), then sliced: the same adapters at any TP/PP/EP layout. B starts at 0."""
    gen = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
    bound = 1.0 / math.sqrt(in_features)  # kaiming_uniform_(a=sqrt(5)) on fan_in
    full = torch.empty(a.shape[0], in_features, device="cpu").uniform_(-bound, bound, generator=gen)
    if kind == "row":  # A is sharded along the input, over TP (experts: expert-TP)
        full = full.chunk(_tp_size(expert), dim=1)[_tp_rank(expert)]
    a.copy_(full)


def with_expert_tp_grad_sums(finalize_model_grads):
    """mcore's finalize_model_grads, then the expert-TP sum of the gradients that are partial
    there (`expert_tp_partial_grad`: replicated expert adapter factors; module docstring)."""

    def finalize(model, *args, **kwargs):
        out = finalize_model_grads(model, *args, **kwargs)
        sum_expert_tp_partial_grads(model)
        return out

    return finalize


def sum_expert_tp_partial_grads(chunks) -> None:
    """All-reduce (sum) the marked parameters' gradients (mcore's main_grad) over expert-TP."""
    if _tp_size(True) == 1:
        return
    grads = [getattr(p, "main_grad", p.grad) for c in chunks for p in c.parameters()
             if p.requires_grad and getattr(p, "expert_tp_partial_grad", False)]
    grads = [g for g in grads if g is not None]
    if not grads:
        return
    flat = _flatten_dense_tensors(grads)
    torch.distributed.all_reduce(flat, group=parallel_state.get_expert_tensor_parallel_group())
    for grad, summed in zip(grads, _unflatten_dense_tensors(flat, grads)):
        grad.copy_(summed)


def adapters_of(chunks) -> list[tuple[str, LoRAAdapter, torch.nn.Module]]:
    out = []
    for chunk in chunks:
        model = getattr(chunk, "module", chunk)
        for name, adapter in getattr(model, "lora", {}).items():
            out.append((name, adapter, model))
    return out


@torch.no_grad()
def set_merged(chunks, merged: bool) -> None:
    """Merge scale * B A into every adapted base weight (the adapters then stop adding it), or
    unmerge: the base weights come back bit for bit from a host copy taken at merge time
    (W + d - d is not W in floating point). A quantized base is merged into its dequantized weight,
    as new data beside the codes, and unmerged by dropping that data."""
    for name, adapter, model in adapters_of(chunks):
        if adapter.merged == merged:
            continue
        layer_index, _ = _split(name)
        originals = []
        for i, (path, weight_name) in enumerate(adapter.bases):  # experts: one per local expert
            weight = getattr(_base_module(model, layer_index, path), weight_name)  # grouped: weight<e>
            if getattr(weight, "quantized_base", None) is not None:  # quantized base: the codes stay
                if merged:
                    merge(weight, adapter.delta(i if adapter.expert else None))
                else:
                    unmerge(weight)
                continue
            if merged:
                originals.append(weight.detach().to("cpu", copy=True))
                weight.copy_((weight.float() + adapter.delta(i if adapter.expert else None)).to(weight.dtype))
            else:
                weight.copy_(adapter.original[i].to(weight.device))
        adapter.original = originals if merged else None
        adapter.merged = merged


@contextlib.contextmanager
def adapters_disabled(chunks):
    """The frozen base model, for as long as the context lasts (no copy of the weights)."""
    adapters = [a for _, a, _ in adapters_of(chunks)]
    for adapter in adapters:
        adapter.enabled = False
    try:
        yield
    finally:
        for adapter in adapters:
            adapter.enabled = True


def _split(name: str) -> tuple[int, str]:
    parts = base_path(name).split(".")  # decoder.layers.<L>.<path...>
    return int(parts[2]), ".".join(parts[3:])


def _base_module(model, global_layer: int, path: str):
    for layer in model.decoder.layers:
        if layer.layer_number - 1 == global_layer:
            return layer.get_submodule(path)
    raise KeyError(global_layer)
