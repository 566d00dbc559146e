"""Write LoRA adapters as a PEFT adapter directory that `peft.PeftModel.from_pretrained` loads.

Each adapter is gathered over its tensor-parallel ranks and mapped to HF names with the same
transforms as the weights (hf/mappings.py): the fused linear_qkv's B splits into q/k/v rows per
query group and linear_fc1's B into gate/up ([gate_i; up_i] per rank), all sharing the one A
(B_q A x is exactly the q rows of B A x); row-parallel A shards join along the input dim.

    adapter_model.safetensors: base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight ...
    adapter_config.json:       peft's LoraConfig (r, lora_alpha, target_modules in HF names, ...)

Routed experts (one adapter per expert on its EP rank, gathered over expert-TP) map per expert
as their weights do (...mlp.experts.<e>.gate_proj: the layout of per-expert linears, vLLM's);
with `experts="fused"` rank 0 then stacks them the way peft adapts transformers 5's fused 3-D
expert parameters (`target_parameters`, one ParamWrapper per parameter, nested in declaration
order: the first is innermost, under `base_layer.`):

    lora_A [E*r, in]:  expert e's A in rows e*r .. e*r+r-1
    lora_B [out, r*E]: column k*E + e is column k of expert e's B
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Iterable, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from safetensors.torch import save_file

from lightning_mcore.hf.export import copy_files, gather_shards
from lightning_mcore.hf.export_dir import TOKENIZER_FILES, check_target, staged_dir
from lightning_mcore.hf.mappings import Entry, FusedExperts
from lightning_mcore.hf.transforms import Dims
from lightning_mcore.lora.adapters import adapters_of, base_path, global_expert
from lightning_mcore.lora.config import TARGETS

EXPERT_LAYOUTS = ("fused", "per_expert")


class PeftExportError(ValueError):
    """A PEFT export the model cannot produce (found before anything is written)."""


def experts_layout(layout: Optional[str], mode: str, has_expert_adapters: bool,
                   fused: Optional[FusedExperts]) -> str:
    """The layout of the routed experts' adapters in an export (`lora_experts_layout`): "fused"
    (peft's target_parameters on transformers 5's 3-D experts; the default) or "per_expert"
    (vLLM's per-expert linears). Refused where the export cannot hold it: an export other than
    PEFT, a model without expert adapters, fused for a family with no fused layout registered."""
    if layout is None:
        return "fused"
    if layout not in EXPERT_LAYOUTS:
        raise PeftExportError(f"lora_experts_layout must be one of {', '.join(EXPERT_LAYOUTS)}, got {layout!r}.")
    if mode != "peft":
        raise PeftExportError(
            f"lora_experts_layout={layout!r} applies to PEFT exports of expert adapters; a "
            f"{mode!r} export holds the adapters merged into the weights: leave it unset, or "
            f"export with mode 'peft'.")
    if not has_expert_adapters:
        raise PeftExportError(
            f"lora_experts_layout={layout!r}, but the model has no LoRA adapters on routed experts "
            f"(no MoE experts, LoRA experts=False, or targets without linear_fc1/linear_fc2): "
            f"leave it unset.")
    if layout == "fused" and fused is None:
        raise PeftExportError(
            "lora_experts_layout='fused': this model family has no fused expert layout known to "
            "peft here; use lora_experts_layout='per_expert' (per-expert names, as vLLM loads "
            "them), or export merged.")
    return layout


def adapter_tensors(chunks, cfg, weights: list[Entry]) -> tuple[dict, dict]:
    """This rank's adapters as full PEFT-named tensors (CPU, fp32 kept as is): (dense ones, on
    every TP rank; routed experts' ones, per expert, on the expert's EP rank)."""
    entries = {e.mcore: e for e in weights}
    dims = Dims(cfg.num_attention_heads, cfg.num_query_groups or cfg.num_attention_heads,
                cfg.head_dim, cfg.vocab_size, cfg.vocab_size)
    dense, experts = {}, {}
    for name, adapter, model in adapters_of(chunks):
        path = base_path(name)  # decoder.layers.<L>.self_attention.linear_qkv, ...mlp.experts.linear_fc1
        layer, (head, short) = int(path.split(".")[2]), path.split(".", 3)[3].rsplit(".", 1)
        local = f"{head}.local_experts.{{E}}.{short}" if adapter.expert else f"{head}.{short}"
        entry = entries["decoder.layers.{L}." + local + ".weight"]
        column = TARGETS[short][0] == "column"
        sharded, whole = (adapter.lora_B, adapter.lora_A) if column else (adapter.lora_A, adapter.lora_B)
        shards = gather_shards(sharded, adapter.expert)
        out = experts if adapter.expert else dense
        for e in range(adapter.experts) if adapter.expert else [None]:  # experts: stacked, local index
            names = entry.hf_names(layer, None if e is None else global_expert(e, model.config))
            saved = entry.transform.save(shards if e is None else [s[e] for s in shards], names, dims)
            other = whole.detach() if e is None else whole[e].detach()
            for hf_name in names:
                a, b = (other, saved[hf_name]) if column else (saved[hf_name], other)
                stem = "base_model.model." + hf_name.removesuffix(".weight")
                # copies: an expert's factor is a view of the stacked one (safetensors refuses shared storage)
                out[f"{stem}.lora_A.weight"] = a.to("cpu", copy=True).contiguous()
                out[f"{stem}.lora_B.weight"] = b.to("cpu", copy=True).contiguous()
    return dense, experts


def _is_expert(key: str) -> bool:
    return re.search(r"\.experts\.\d+\.", key) is not None


def fuse_experts(tensors: dict, layout: FusedExperts, num_experts: int) -> tuple[dict, list[str]]:
    """Per-expert adapter tensors -> peft's target_parameters tensors for `layout` (the module
    doc); the others pass through. Also the target_parameters (peft's sorted order)."""
    out = {k: v for k, v in tensors.items()}
    prefix = "base_model.model." + layout.module
    source = "base_model.model." + layout.source
    pattern = re.compile(re.escape(source).replace(r"\{L\}", r"(?P<L>\d+)")
                         + r"\.(?P<E>\d+)\.(?P<n>[^.]+)\.lora_(?P<ab>[AB])\.weight$")
    found: dict[tuple[int, str], dict[int, dict[str, torch.Tensor]]] = {}
    for key in tensors:
        m = pattern.match(key)
        if m:
            found.setdefault((int(m["L"]), m["n"]), {}).setdefault(int(m["E"]), {})[m["ab"]] = out.pop(key)
    layers = sorted({layer for layer, _ in found})
    targeted = [(p, parts) for p, parts in layout.params if any((layers[0], n) in found for n in parts)] if layers else []
    for layer in layers:
        module = prefix.format(L=layer)
        for depth, (param, parts) in enumerate(targeted):
            stem = module + "." + "base_layer." * (len(targeted) - 1 - depth)
            per = [found.pop((layer, n)) for n in parts]
            if any(sorted(p) != list(range(num_experts)) for p in per):
                raise ValueError(f"{module}.{param}: adapters of some experts are missing.")
            a = torch.stack([per[0][e]["A"] for e in range(num_experts)])  # [E, r, in]
            b = torch.stack([torch.cat([p[e]["B"] for p in per]) for e in range(num_experts)], -1)
            out[stem + "lora_A.weight"] = a.reshape(-1, a.shape[-1]).contiguous()
            out[stem + "lora_B.weight"] = b.reshape(b.shape[0], -1).contiguous()  # [out, r*E]
    if found:
        raise ValueError(f"expert adapters {sorted(found)[:3]} are not all of {layout.params}.")
    module = layout.module.rsplit(".", 2)[-2:]  # e.g. mlp.experts
    return out, sorted(".".join(module) + "." + p for p, _ in targeted)


def scoped_targets(scope: str, names: list[str]) -> str:
    """peft's regex form of target_modules (full match on a module path): `names` under `scope`,
    e.g. model\\.language_model\\..*\\.(?:q_proj|v_proj)."""
    return re.escape(scope) + r".*\.(?:" + "|".join(re.escape(n) for n in names) + ")"


def export_peft(chunks, cfg, weights: list[Entry], lora, out_dir, base_model: Optional[str] = None,
                overwrite: bool = False, protected: Iterable = (),
                tokenizer_dir=None, fused_experts: Optional[FusedExperts] = None,
                experts: str = "fused", scope: Optional[str] = None) -> Optional[Path]:
    """Collective: every rank sends its stage's adapters to rank 0, which writes the directory
    under a temporary name and renames it when complete. `out_dir` must be new or empty, or
    (with `overwrite`) an earlier export, and not hold or sit inside `base_model`/`protected`.
    The tokenizer files of `tokenizer_dir` (or of `base_model`) are copied along. Expert
    adapters: `experts="fused"` in `fused_experts`' layout (what peft loads on transformers 5),
    or "per_expert" (per-expert linears, as vLLM's MoE LoRA loader names them). `scope` (the
    decoder's module path beside a vision encoder, e.g. "model.language_model."): target_modules
    is then a regex that matches the adapted linears under it only (a vision block's
    mlp.gate_proj must stay untouched)."""
    from peft import LoraConfig  # lazy: peft's import takes ~0.35 s, needed by a PEFT export only

    if experts not in EXPERT_LAYOUTS:
        raise ValueError(f"experts must be one of {EXPERT_LAYOUTS}, got {experts!r}.")
    out_dir = check_target(out_dir, overwrite, [base_model, *protected])
    dense, expert_tensors = adapter_tensors(chunks, cfg, weights)
    mine = {}
    if ps.get_data_parallel_rank() == 0 and ps.get_tensor_model_parallel_rank() == 0:
        mine.update(dense)
    if ps.get_expert_data_parallel_rank() == 0 and ps.get_expert_tensor_parallel_rank() == 0:
        mine.update(expert_tensors)
    parts = [None] * dist.get_world_size() if dist.is_initialized() else [mine]
    if dist.is_initialized():
        dist.gather_object(mine, parts if dist.get_rank() == 0 else None, dst=0)
        if dist.get_rank() != 0:
            dist.barrier()
            return None
    tensors = {k: v for part in parts for k, v in part.items()}
    target_parameters, fused = None, set()
    if experts == "fused" and any(_is_expert(k) for k in tensors):
        if fused_experts is None:
            raise ValueError("expert adapters need the family's FusedExperts layout for a fused "
                             "PEFT export; export per_expert or merged.")
        before = set(tensors)
        tensors, target_parameters = fuse_experts(tensors, fused_experts, cfg.num_moe_experts)
        fused = set(tensors) - before
    # PEFT matches modules by the last part of their HF name (q_proj, ...; the family's names).
    hf_targets = sorted({name.rsplit(".", 3)[-3] for name in tensors if name not in fused})
    targets = scoped_targets(scope, hf_targets) if scope and hf_targets else (hf_targets or None)
    # the base the adapters were trained against (peft's own config has no field for it)
    with staged_dir(out_dir, {"format": "peft", "lora_base_precision": lora.base_precision}) as tmp:
        save_file(tensors, tmp / "adapter_model.safetensors", metadata={"format": "pt"})
        LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                   use_rslora=lora.use_rslora, target_modules=targets,
                   target_parameters=target_parameters, task_type="CAUSAL_LM",
                   base_model_name_or_path=str(base_model) if base_model else None).save_pretrained(tmp)
        copy_files(tokenizer_dir or base_model, tmp, TOKENIZER_FILES)
    if dist.is_initialized():
        dist.barrier()
    return out_dir
