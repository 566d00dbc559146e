"""Load a Hugging Face checkpoint into this rank's mcore chunks, reading only its own slices."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from lightning_mcore.hf.checkpoint import CheckpointError, ExpertView, SafetensorsReader
from lightning_mcore.hf.mappings import Entry, local_name, shape_symbols
from lightning_mcore.hf.mxfp4 import quantized_view
from lightning_mcore.hf.transforms import Dims

_SAFETENSORS_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}
# The config.json fields behind the shape symbols of the mapping tables.
_FIELDS = {"h": "hidden_size", "q": "num_attention_heads*head_dim", "kv": "num_key_value_heads*head_dim",
           "d": "head_dim", "f": "intermediate_size", "mf": "moe_intermediate_size",
           "V": "vocab_size", "E": "num_experts", "nh": "num_attention_heads",
           "2mf": "2*moe_intermediate_size", "2f": "2*intermediate_size",
           "q+2kv": "(num_attention_heads+2*num_key_value_heads)*head_dim",
           "sf": "shared_expert_intermediate_size", "1": "1",
           "ql": "q_lora_rank", "kvl": "kv_lora_rank", "kva": "kv_lora_rank+qk_rope_head_dim",
           "qh": "num_attention_heads*(qk_nope_head_dim+qk_rope_head_dim)",
           "kvb": "num_attention_heads*(qk_nope_head_dim+v_head_dim)",
           "o": "num_attention_heads*v_head_dim", "q2": "2*num_attention_heads*head_dim",
           "lk": "linear_num_key_heads*linear_key_head_dim",
           "lv": "linear_num_value_heads*linear_value_head_dim", "lh": "linear_num_value_heads",
           "lc": "2*linear_num_key_heads*linear_key_head_dim+linear_num_value_heads*linear_value_head_dim",
           "dv": "linear_value_head_dim",
           "lc+lv": "2*linear_num_key_heads*linear_key_head_dim+2*linear_num_value_heads*linear_value_head_dim",
           "2lh": "2*linear_num_value_heads", "ck": "linear_conv_kernel_dim"}


def dims_of(cfg, padded_vocab: int) -> Dims:
    return Dims(
        num_heads=cfg.num_attention_heads,
        num_groups=cfg.num_query_groups or cfg.num_attention_heads,
        head_dim=cfg.head_dim,
        vocab=cfg.vocab_size,
        padded_vocab=padded_vocab,
    )


def unwrap(chunk):
    """The GPTModel inside an mcore DDP wrapper (or the chunk itself)."""
    return getattr(chunk, "module", chunk)


def parallel_ranks() -> dict[str, tuple[int, int]]:
    return {
        "tp": (ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()),
        "etp": (ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size()),
        "ep": (ps.get_expert_model_parallel_rank(), ps.get_expert_model_parallel_world_size()),
    }


def chunk_parameters(chunk, entries: list[Entry], cfg, ep: tuple[int, int]):
    """(mcore param, entry, global layer, global expert) for every parameter of one chunk."""
    model = unwrap(chunk)
    layers = [layer.layer_number - 1 for layer in model.decoder.layers] if hasattr(model, "decoder") else []
    per_rank = (cfg.num_moe_experts or 0) // ep[1]
    compiled = [(e.pattern(), e) for e in entries]
    for name, param in named_weights(model):
        if name.startswith("lora."):
            continue  # LoRA adapters: merged into the weights or exported by hf/peft_export.py
        key = local_name(name)
        for pattern, entry in compiled:
            match = pattern.match(key)
            if match:
                groups = match.groupdict()
                layer = layers[int(groups["L"])] if "L" in groups else None
                expert = ep[0] * per_rank + int(groups["E"]) if "E" in groups else None
                yield param, entry, layer, expert
                break
        else:
            raise CheckpointError(f"mcore parameter {name!r} has no Hugging Face counterpart.")


def named_weights(model):
    """Parameters, then persistent buffers: the MoE router's expert_bias is one (mcore updates
    it outside the optimizer; HF saves it as e_score_correction_bias)."""
    yield from model.named_parameters()
    for prefix, module in model.named_modules():
        for name, buffer in module.named_buffers(prefix=prefix, recurse=False):
            if name.rsplit(".", 1)[-1] not in module._non_persistent_buffers_set:
                yield name, buffer


def size_of(symbol: str, symbols: dict) -> int:
    """A shape symbol's size; a number stands for itself (a vision encoder's own sizes)."""
    return int(symbol) if symbol.isdigit() else symbols[symbol]


def _check(reader: SafetensorsReader, names, entry: Entry, symbols, dtype) -> None:
    for name, shape in zip(names, entry.shapes):
        want = tuple(size_of(s, symbols) for s in shape)
        got = reader.shape(name)
        if got != want:
            raise CheckpointError(
                f"{name} in {reader.files[name].name} has shape {list(got)}, but config.json "
                f"implies {list(want)} ({' x '.join(_FIELDS.get(s, s) for s in shape)}). The checkpoint "
                f"and its config disagree."
            )
        want_dtype = entry.dtype or dtype
        if want_dtype and reader.dtype(name) != want_dtype:
            raise CheckpointError(
                f"{name} in {reader.files[name].name} is {reader.dtype(name)}, but "
                + (f"it is kept in {want_dtype}." if entry.dtype else f"config.json says dtype {dtype}.")
            )


@torch.no_grad()
def load_hf_weights(chunks, directory, cfg, weights: list[Entry], padded_vocab: int,
                    carried: tuple[str, ...] = ()) -> None:
    """Fill `chunks` (this rank's mcore models) from the HF checkpoint in `directory`, by the
    weight table `weights` (its family module's); tensors named with a `carried` prefix are
    left for the export to copy (hf/export.py)."""
    directory = Path(directory)
    config = json.loads((directory / "config.json").read_text())
    dtype = _SAFETENSORS_DTYPES.get(str(config.get("dtype") or config.get("torch_dtype")))
    ranks = parallel_ranks()
    entries = weights
    dims, symbols = dims_of(cfg, padded_vocab), shape_symbols(cfg)
    read: set[str] = set()
    with SafetensorsReader(directory) as raw:
        reader = quantized_view(raw, config, dtype)
        for chunk in chunks:
            for param, entry, layer, expert in chunk_parameters(chunk, entries, cfg, ranks["ep"]):
                names = entry.hf_names(layer, expert)
                _check(reader, names, entry, symbols, dtype)
                rank, size = ranks["etp"] if entry.expert else ranks["tp"]
                source = ExpertView(reader, expert) if entry.stacked else reader
                shard = entry.transform.load(source, names, rank, size, dims)
                if tuple(shard.shape) != tuple(param.shape):
                    raise CheckpointError(
                        f"{', '.join(names)} give a shard of shape {list(shard.shape)} for mcore "
                        f"{entry.mcore} of shape {list(param.shape)}."
                    )
                param.copy_(shard)
                read.update(names)
        kept = [n for n in reader.files if n.startswith(carried)] if carried else []
        _refuse_unread(directory, reader.files, read | set(kept), cfg.tie_word_embeddings)


def _refuse_unread(directory: Path, in_checkpoint, read: set, tied: bool) -> None:
    """Every checkpoint tensor must have a place in the model (over all ranks together): one
    that nothing reads would be silently dropped, and the model would compute something else
    (a bias or norm the family table does not know). Collective when distributed."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, sorted(read))
        read = set().union(*everyone)
    left = sorted(n for n in in_checkpoint if n not in read
                  and not n.endswith("rotary_emb.inv_freq")  # a buffer older exports carry
                  and not (tied and n == "lm_head.weight"))  # transformers ties it over
    if left:
        more = f" and {len(left) - 3} more" if len(left) > 3 else ""
        raise CheckpointError(
            f"{directory}: {len(left)} tensor(s) have no place in the model built from its "
            f"config.json: {', '.join(left[:3])}{more}. Refusing to drop them (the model would "
            f"compute something else); the checkpoint and its config.json disagree, or it holds "
            f"parts this architecture's table does not map."
        )
