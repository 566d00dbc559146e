"""Write LoRA adapters as a PEFT adapter directory that `peft.PeftModel.from_pretrained` loads.

Each adapter is gathered over its tensor-parallel ranks and mapped to HF names with the same
transforms as the weights (hf/mappings.py): the fused linear_qkv's B splits into q/k/v rows per
query group and linear_fc1's B into gate/up ([gate_i; up_i] per rank), all sharing the one A
(B_q A x is exactly the q rows of B A x); row-parallel A shards join along the input dim.

    adapter_model.safetensors: base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight ...
    adapter_config.json:       peft's LoraConfig (r, lora_alpha, target_modules in HF names, ...)
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Optional

import torch
import torch.distributed as dist

from lightning_mcore.hf.export import TOKENIZER_FILES, copy_files
from lightning_mcore.hf.export_dir import check_target, staged_dir
from lightning_mcore.hf.mappings import Entry
from lightning_mcore.hf.transforms import Dims
from lightning_mcore.model.lora import TARGETS, adapters_of, base_path


def _gather(t: torch.Tensor, dim: int) -> list[torch.Tensor]:
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    size = dist.get_world_size(group) if dist.is_initialized() else 1
    if size == 1:
        return [t.detach()]
    shards = [torch.empty_like(t) for _ in range(size)]
    dist.all_gather(shards, t.detach().contiguous(), group=group)
    return shards


def adapter_tensors(chunks, cfg, weights: list[Entry]) -> dict[str, torch.Tensor]:
    """This rank's adapters as full PEFT-named tensors (on every TP rank; CPU, fp32 kept as is)."""
    entries = {e.mcore: e for e in weights}
    dims = Dims(cfg.num_attention_heads, cfg.num_query_groups or cfg.num_attention_heads,
                cfg.head_dim, cfg.vocab_size, cfg.vocab_size)
    out = {}
    for name, adapter, _ in adapters_of(chunks):
        path = base_path(name)  # decoder.layers.<L>.self_attention.linear_qkv
        layer = int(path.split(".")[2])
        short = path.rsplit(".", 1)[-1]
        entry = entries["decoder.layers.{L}." + path.split(".", 3)[3] + ".weight"]
        names = entry.hf_names(layer)
        if TARGETS[short][0] == "column":
            bs = entry.transform.save(_gather(adapter.lora_B, 0), names, dims)
            pieces = {n: (adapter.lora_A.detach(), bs[n]) for n in names}
        else:
            a = entry.transform.save(_gather(adapter.lora_A, 1), names, dims)
            pieces = {n: (a[n], adapter.lora_B.detach()) for n in names}
        for hf_name, (a, b) in pieces.items():
            stem = "base_model.model." + hf_name.removesuffix(".weight")
            out[f"{stem}.lora_A.weight"] = a.cpu().contiguous()
            out[f"{stem}.lora_B.weight"] = b.cpu().contiguous()
    return out


def export_peft(chunks, cfg, weights: list[Entry], lora, out_dir, base_model: Optional[str] = None,
                overwrite: bool = False, protected: Iterable = (),
                tokenizer_dir=None) -> Optional[Path]:
    """Collective: every rank sends its stage's adapters to rank 0, which writes the directory
    under a temporary name and renames it when complete. `out_dir` must be new or empty, or
    (with `overwrite`) an earlier export, and not hold or sit inside `base_model`/`protected`.
    The tokenizer files of `tokenizer_dir` (or of `base_model`) are copied along."""
    from megatron.core import parallel_state
    from peft import LoraConfig
    from safetensors.torch import save_file

    out_dir = check_target(out_dir, overwrite, [base_model, *protected])
    mine = {}
    if parallel_state.get_data_parallel_rank() == 0:
        tensors = adapter_tensors(chunks, cfg, weights)
        if parallel_state.get_tensor_model_parallel_rank() == 0:
            mine = tensors
    parts = [None] * dist.get_world_size() if dist.is_initialized() else [mine]
    if dist.is_initialized():
        dist.gather_object(mine, parts if dist.get_rank() == 0 else None, dst=0)
        if dist.get_rank() != 0:
            dist.barrier()
            return None
    tensors = {k: v for part in parts for k, v in part.items()}
    # PEFT matches modules by the last part of their HF name (q_proj, ...; the family's names).
    hf_targets = sorted({name.rsplit(".", 3)[-3] for name in tensors})
    with staged_dir(out_dir, {"format": "peft"}) as tmp:
        save_file(tensors, tmp / "adapter_model.safetensors", metadata={"format": "pt"})
        LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                   use_rslora=lora.use_rslora, target_modules=hf_targets, task_type="CAUSAL_LM",
                   base_model_name_or_path=str(base_model) if base_model else None).save_pretrained(tmp)
        copy_files(tokenizer_dir or base_model, tmp, TOKENIZER_FILES)
    if dist.is_initialized():
        dist.barrier()
    return out_dir
