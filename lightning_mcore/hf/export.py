"""Write the sharded mcore model as a Hugging Face checkpoint directory.

Collective: every rank calls it. Tensors travel one at a time in a fixed global order (by
layer): the owning tensor-parallel group all-gathers its shards, its rank 0 rebuilds the HF
tensors and sends them to global rank 0, which writes a safetensors shard whenever
`max_shard_bytes` are buffered. Peak host memory on rank 0 is about one shard. The directory is
written under a temporary name and renamed when complete.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path
from typing import Iterable, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from safetensors.torch import save_file

from lightning_mcore.hf.checkpoint import SafetensorsReader
from lightning_mcore.hf.export_dir import PROCESSOR_FILES, TOKENIZER_FILES, check_target, staged_dir
from lightning_mcore.hf.load import chunk_parameters, dims_of, parallel_ranks, size_of
from lightning_mcore.hf.mappings import Entry, shape_symbols

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def _items(chunks, cfg, entries: list[Entry]):
    """This rank's (order key, param, entry, layer, expert), for the tensors its group owns."""
    ranks = parallel_ranks()
    dense_owner = ps.get_data_parallel_rank(with_context_parallel=True) == 0
    expert_owner = ps.get_expert_data_parallel_rank() == 0
    position = {e.mcore: i for i, e in enumerate(entries)}
    out = []
    for chunk in chunks:
        for param, entry, layer, expert in chunk_parameters(chunk, entries, cfg, ranks["ep"]):
            if not entry.export or not (expert_owner if entry.expert else dense_owner):
                continue
            stage = 0 if entry.mcore.startswith("embedding") else 2 if layer is None else 1
            key = (stage, -1 if layer is None else layer, position[entry.mcore], expert or 0)
            out.append((key, param, entry, layer, expert))
    return sorted(out, key=lambda item: item[0])


def _refuse_incomplete(weights: list[Entry], plan) -> None:
    """Every tensor of the table outside the layers (embedding, final norm, a vision encoder...)
    must have an owner on some rank: a model built without one (e.g. a vision encoder never
    attached) would otherwise give a directory that transformers fills with random weights."""
    written = {name for _, _, names, *_ in plan for name in names}
    missing = sorted(n for e in weights if e.export and "{L}" not in e.mcore and "{E}" not in e.mcore
                     for n in e.hf_names() if n not in written)
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise RuntimeError(f"the model holds no parameter for {len(missing)} tensor(s) of its HF layout: "
                           f"{', '.join(missing[:3])}{more}; refusing to write an incomplete export.")


def gather_shards(param: torch.Tensor, expert: bool) -> list[torch.Tensor]:
    """The shards of `param` over TP (a routed expert's: over expert-TP), in rank order."""
    group = ps.get_expert_tensor_parallel_group() if expert else ps.get_tensor_model_parallel_group()
    size = dist.get_world_size(group) if dist.is_initialized() else 1
    if size == 1:
        return [param.detach()]
    shards = [torch.empty_like(param) for _ in range(size)]
    dist.all_gather(shards, param.detach().contiguous(), group=group)
    return shards


class _ShardWriter:
    """Buffers tensors on rank 0 and writes a safetensors file each time the buffer is full."""

    def __init__(self, directory: Path, max_bytes: int) -> None:
        self.directory, self.max_bytes = directory, max_bytes
        self.buffer: dict[str, torch.Tensor] = {}
        self.files: list[tuple[str, list[str]]] = []
        self.pieces: dict[str, list[torch.Tensor]] = {}  # experts of a stacked tensor so far

    def add(self, name: str, tensor: torch.Tensor, stack: int = 0) -> None:
        """Buffer `name`; with `stack` > 0, `tensor` is the next of `stack` experts' slices of
        it (they arrive in expert order), written stacked once all have come."""
        tensor = tensor.detach().to("cpu")
        if stack:
            self.pieces.setdefault(name, []).append(tensor)
            if len(self.pieces[name]) < stack:
                return
            tensor = torch.stack(self.pieces.pop(name))
        self.buffer[name] = tensor.contiguous()
        if sum(t.numel() * t.element_size() for t in self.buffer.values()) >= self.max_bytes:
            self.flush()

    def flush(self) -> None:
        if not self.buffer:
            return
        name = f"part-{len(self.files):05d}.safetensors"
        save_file(self.buffer, str(self.directory / name), metadata={"format": "pt"})
        self.files.append((name, list(self.buffer)))
        self.buffer = {}

    def finish(self) -> None:
        if self.pieces:
            raise RuntimeError(f"export: {', '.join(sorted(self.pieces))} did not receive every expert.")
        self.flush()
        total = len(self.files)
        if total == 1:
            os.replace(self.directory / self.files[0][0], self.directory / "model.safetensors")
            return
        weight_map, size = {}, 0
        for i, (tmp, names) in enumerate(self.files, start=1):
            final = f"model-{i:05d}-of-{total:05d}.safetensors"
            os.replace(self.directory / tmp, self.directory / final)
            size += (self.directory / final).stat().st_size
            weight_map.update({n: final for n in names})
        index = {"metadata": {"total_size": size}, "weight_map": dict(sorted(weight_map.items()))}
        (self.directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def export_hf(
    chunks,
    cfg,
    weights: list[Entry],
    hf_config: Optional[dict],
    out_dir,
    padded_vocab: int,
    source_dir: Optional[os.PathLike] = None,
    max_shard_bytes: int = 5 * 2**30,
    overwrite: bool = False,
    tokenizer_dir: Optional[os.PathLike] = None,
    protected: Iterable = (),
    carried: tuple[str, ...] = (),
    lora_base_precision: Optional[str] = None,
) -> Optional[Path]:
    """Write an HF directory at `out_dir` (config, weights, tokenizer); returns it on rank 0.

    `out_dir` must be new or empty, or (with `overwrite`) an earlier export (hf/export_dir.py);
    it may not hold or sit inside `source_dir` or the `protected` paths. `weights` is the
    family's weight table, `hf_config` the config.json to write (None: `source_dir`'s).
    Tokenizer files come from `source_dir`, else from `tokenizer_dir`; so do the tensors named
    with a `carried` prefix (parts the model keeps but does not compute), copied unchanged.
    `lora_base_precision` (a LoRA run's merged export): the base precision the adapters were
    trained against ("fp8": merged into the dequantized base), noted in the export's marker."""
    out_dir = check_target(out_dir, overwrite, [source_dir, *protected])
    rank = dist.get_rank() if dist.is_initialized() else 0
    items = _items(chunks, cfg, weights)
    dims, symbols = dims_of(cfg, padded_vocab), shape_symbols(cfg)

    # Who sends what: (key, source rank, HF names, their shapes, dtype, experts stacked into each
    # name: 0 for none) from every rank's items.
    mine = [(key, entry.hf_names(layer, expert),
             [tuple(size_of(s, symbols) for s in shape[entry.stacked:]) for shape in entry.shapes],
             str(param.dtype).removeprefix("torch."), cfg.num_moe_experts if entry.stacked else 0)
            for key, param, entry, layer, expert in items if _is_sender(entry.expert)]
    everyone = [None] * dist.get_world_size() if dist.is_initialized() else [mine]
    if dist.is_initialized():
        dist.all_gather_object(everyone, mine)
    plan = sorted((key, src, names, shapes, dt, stack)
                  for src, lst in enumerate(everyone) for key, names, shapes, dt, stack in lst)
    _refuse_incomplete(weights, plan)

    note = {"format": "transformers", **({"lora_base_precision": lora_base_precision} if lora_base_precision else {})}
    staging = staged_dir(out_dir, note) if rank == 0 else contextlib.nullcontext()
    with staging as tmp:
        if rank == 0:
            writer = _ShardWriter(tmp, max_shard_bytes)
        _send_tensors(items, plan, rank, dims, writer if rank == 0 else None)
        if rank == 0:
            _copy_carried(source_dir, carried, writer)
            writer.finish()
            _write_metadata(tmp, hf_config, source_dir, items[0][1].dtype, tokenizer_dir)
    if dist.is_initialized():
        dist.barrier()
    return out_dir if rank == 0 else None


def _send_tensors(items, plan, rank: int, dims, writer: Optional[_ShardWriter]) -> None:
    """Every owned tensor, in the plan's global order, into rank 0's writer."""
    own = iter(items)
    device = items[0][1].device if items else torch.device("cpu")
    for key, src, names, shapes, dt, stack in (
            plan if rank == 0 else [(k, rank, None, None, None, 0) for k, *_ in items]):
        if src == rank:
            _, param, entry, layer, expert = next(own)
            tensors = entry.transform.save(gather_shards(param, entry.expert), entry.hf_names(layer, expert), dims)
            if not _is_sender(entry.expert):
                continue
            for name, tensor in tensors.items():
                if rank == 0:
                    writer.add(name, tensor, stack)
                else:
                    dist.send(tensor.contiguous(), dst=0)
        else:  # rank 0 receives another group's tensors, in the sender's order
            for name, shape in zip(names, shapes):
                buf = torch.empty(shape, dtype=getattr(torch, dt), device=device)
                dist.recv(buf, src=src)
                writer.add(name, buf, stack)


def _is_sender(expert: bool) -> bool:
    """Rank 0 of the (expert-)tensor-parallel group sends what the group gathered."""
    ranks = parallel_ranks()
    return (ranks["etp"] if expert else ranks["tp"])[0] == 0


def _copy_carried(source_dir, carried: tuple[str, ...], writer: "_ShardWriter") -> None:
    """The source checkpoint's tensors under the `carried` prefixes, bit for bit."""
    if not carried or source_dir is None:  # (carried prefixes come from source_dir's config.json)
        return

    with SafetensorsReader(Path(source_dir)) as reader:
        for name in sorted(n for n in reader.files if n.startswith(carried)):
            writer.add(name, reader.get(name))


def _write_metadata(directory: Path, hf_config: Optional[dict], source_dir, dtype: torch.dtype,
                    tokenizer_dir=None) -> None:
    source = Path(source_dir) if source_dir else None
    if hf_config is None:
        config = json.loads((source / "config.json").read_text())
    else:
        config = dict(hf_config)
    config.pop("quantization_config", None)  # the weights are written unquantized (hf/mxfp4.py)
    config["dtype" if "dtype" in config or "torch_dtype" not in config else "torch_dtype"] = _DTYPE_NAMES[dtype]
    (directory / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    copy_files(source, directory, ("generation_config.json",) + TOKENIZER_FILES + PROCESSOR_FILES)
    if not any((directory / name).is_file() for name in TOKENIZER_FILES):
        copy_files(tokenizer_dir, directory, TOKENIZER_FILES)


def copy_files(source, directory: Path, names) -> None:
    """Those of `names` that `source` (a directory, or None) has, copied into `directory`."""
    if source is None or not Path(source).is_dir():
        return
    for name in names:
        if (Path(source) / name).is_file():
            shutil.copyfile(Path(source) / name, directory / name)
