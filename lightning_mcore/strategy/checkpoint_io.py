"""Sharded checkpoints on mcore dist_checkpointing (torch_dist), written atomically.

A checkpoint is a directory (Lightning's `*.ckpt` path):

    step=3.ckpt/
      common.pt        Lightning's loops, callbacks, datamodule state; our model config,
                       LR schedule; written by rank 0
      weights/         dist_checkpointing: model chunks (+ optimizer), each rank its shards
      rng_<rank>.pt    torch and mcore RNG tracker states of every rank

It is written under a temporary sibling name and renamed when complete, so a crash mid-save
leaves the previous checkpoint as the newest complete one; the temporary name contains neither
"last" nor ".ckpt", so Lightning never takes it for a checkpoint. Loading rebuilds the sharded
state dict of the *current* layout, so a TP=2 x PP=2 checkpoint resumes at TP=1 or PP=2.
"""

from __future__ import annotations

import dataclasses
import hashlib
import multiprocessing as mp
import queue
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, tensor_parallel
from megatron.core.dist_checkpointing.strategies import filesystem_async
from megatron.core.dist_checkpointing.utils import add_prefix_for_sharding
from megatron.core.optimizer import distrib_optimizer
from torch.distributed.checkpoint.api import CheckpointException

from lightning_mcore.atomic import replace_dir
# CheckpointLoadError and load_plain live in safe_files; callers read them from here too.
from lightning_mcore.lora.config import adapts_experts, resolve_targets, saved_lora
from lightning_mcore.model.config import GPTConfig
from lightning_mcore.strategy.optimizer import mcore_parts
from lightning_mcore.strategy.safe_files import (
    CheckpointLoadError,
    check_extra_state,
    check_weights,
    load_plain,
)

COMMON = "common.pt"
WEIGHTS = "weights"
# fully_reshardable: optimizer state can be loaded under another TP/PP/DP layout.
OPTIM_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}


@dataclass(frozen=True)
class CheckpointOptions:
    """What a checkpoint holds and how it is written (Megatron's --no-save-optim, --no-save-rng,
    --async-save). A checkpoint without optimizer state resumes with a fresh optimizer (the LR
    schedule and step count still continue)."""

    save_optimizer: bool = True
    save_rng: bool = True
    async_save: bool = False


def temporary_prefix(name: str) -> str:
    """How the temporary directories of saves of checkpoint `name` begin (`temporary_path`)."""
    return f".tmp-{hashlib.sha1(name.encode()).hexdigest()[:10]}-"


def temporary_path(path: Path, rank: int) -> Path:
    """A temporary sibling of `path` of its own for each save, the same on every rank (rank 0
    draws it): two saves of one name (last.ckpt, while an async save of it is still writing)
    never share one."""
    name = [temporary_prefix(path.name) + uuid.uuid4().hex[:8] if rank == 0 else None]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(name, src=0)
    return path.parent / name[0]


def model_sharded_state_dict(chunks) -> dict:
    """Keys of the bare GPTModel chunks: Lightning restores weights before the strategy wraps
    the chunks in DDP and the optimizer after, so the wrapper's "module." prefix is left out.
    A chunk with LoRA adapters contributes its adapters only: the base is frozen and comes from
    its own source (HF directory or checkpoint) when the run starts."""
    models = [getattr(chunk, "module", chunk) for chunk in chunks]
    states = [_model_state(model) for model in models]
    if len(models) == 1:
        return {"model": states[0]}
    return {f"model{i}": state for i, state in enumerate(states)}


def _model_state(model) -> dict:
    state = model.sharded_state_dict()
    if getattr(model, "lora", None) is not None:
        state = {k: v for k, v in state.items() if k.startswith("lora.")}
    return state


def sharded_state_dict(chunks, optimizer, is_loading: bool) -> dict:
    state = model_sharded_state_dict(chunks)
    if optimizer is not None:
        state["optimizer"] = optimizer_sharded_state_dict(optimizer, dict(state), is_loading)
    return state


def _stubs(optimizer) -> list[bool]:
    """Which parts of mcore's optimizer chain are stubs (no parameters, no torch optimizer:
    the dense part when LoRA adapts MoE experts only). mcore's ChainedOptimizer cannot save
    or load a chain with one (its step sync reads the stub's missing torch optimizer)."""
    return [getattr(o, "is_stub_optimizer", False) for o in getattr(optimizer, "chained_optimizers", [])]


def optimizer_sharded_state_dict(optimizer, model_state: dict, is_loading: bool) -> dict:
    """mcore's optimizer sharded state dict; a chain with stubs: its other parts under the
    keys mcore gives them (`chained_<index>.`), the stubs left out."""
    plain = (lambda state: state) if is_loading else _without_classes
    stubs = _stubs(optimizer)
    if not any(stubs):
        return plain(optimizer.sharded_state_dict(model_state, is_loading=is_loading, metadata=OPTIM_METADATA))

    out = {}
    for index, (part, stub) in enumerate(zip(optimizer.chained_optimizers, stubs)):
        if not stub:
            out[index] = part.sharded_state_dict(model_state, is_loading=is_loading, metadata=OPTIM_METADATA)
            add_prefix_for_sharding(out[index], f"chained_{index}.")
    return plain(out)


def _without_classes(state):
    """A state to save with no classes in its param groups: mcore's HybridDeviceOptimizer
    (optimizer cpu_offload) keeps its CPU and GPU optimizer classes there, and mcore reads a
    checkpoint's plain part back with weights_only=True, which refuses them. The run's own groups
    keep theirs (MegatronOptimizer.resume puts this run's group settings back after loading)."""
    if isinstance(state, dict):
        return {key: [{k: v for k, v in group.items() if not isinstance(v, type)} for group in value]
                if key == "param_groups" and isinstance(value, list) else _without_classes(value)
                for key, value in state.items()}
    return state


def load_optimizer_state_dict(optimizer, state: dict) -> None:
    """`optimizer.load_state_dict(state)`; a chain with stubs: each other part its own state."""
    stubs = _stubs(optimizer)
    if not any(stubs):
        optimizer.load_state_dict(state)
        return
    for index, (part, stub) in enumerate(zip(optimizer.chained_optimizers, stubs)):
        if not stub:
            part.load_state_dict(state[index])


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def _results_queue(async_save: bool) -> None:
    """mcore's default queue for write results is a spawn-context Manager queue
    (filesystem_async._results_queue): ~12 s to start, and spawning re-imports __main__, so an
    unguarded training script starts again inside the save. A synchronous save puts its results
    in this very process (a plain queue; a multiprocessing queue may still look empty right
    after the put); an async save puts them from a child forked after this point."""
    filesystem_async._results_queue = mp.get_context("fork").Queue() if async_save else queue.Queue()


def save(path: Path, common: dict, chunks, optimizer, rank: int,
         options: CheckpointOptions = CheckpointOptions(), wanted: Callable[[], bool] = lambda: True):
    """Collective: every rank writes its shards into a temporary directory of this save's own,
    rank 0 renames it once all are written.

    With `options.async_save` the shards are written by a forked process and the returned
    mcore AsyncRequest publishes the directory once every rank is done (the caller schedules
    it; mcore runs its own finalize first, which writes the metadata). Should `wanted()` say
    False by then (Lightning removed the checkpoint while it was being written), rank 0 removes
    the temporary directory instead. A crash leaves it under its `.tmp-` name, never taken for
    a checkpoint.
    """
    _results_queue(options.async_save)
    path = Path(path)
    tmp = temporary_path(path, rank)
    if rank == 0:
        (tmp / WEIGHTS).mkdir(parents=True)
    dist.barrier()
    if options.save_rng:
        torch.save(rng_state(), tmp / f"rng_{rank}.pt")
    if rank == 0:
        torch.save(common, tmp / COMMON)  # check_plain(common) ran in strip_for_common
    state = sharded_state_dict(chunks, optimizer if options.save_optimizer else None, is_loading=False)
    # async_strategy: mcore writes async saves with nvidia-resiliency-ext unless told otherwise
    # ("nvrx", a package we do not depend on); its own forked writer is the one `_results_queue`
    # is set up for
    request = dist_checkpointing.save(state, str(tmp / WEIGHTS), async_sharded_save=options.async_save,
                                      async_strategy="mcore")

    def publish() -> None:
        dist.barrier()
        if rank == 0:
            if wanted():
                replace_dir(tmp, path)
            else:
                shutil.rmtree(tmp, ignore_errors=True)  # this save's own directory
        dist.barrier()

    if request is None:
        publish()
        return None
    request.add_finalize_fn(publish)
    return request


def is_checkpoint(path) -> bool:
    return (Path(path) / COMMON).is_file() and (Path(path) / WEIGHTS).is_dir()


def _load_common(path: Path, name: str = "ckpt_path") -> dict:
    """`name`: what the user gave the path as, for the errors (`--checkpoint` in export)."""
    if not path.exists():
        raise CheckpointLoadError(f"{name} {path} does not exist.")
    if not is_checkpoint(path):
        raise CheckpointLoadError(
            f"{name} {path} is not a MegatronStrategy checkpoint (expected a directory with "
            f"{COMMON} and {WEIGHTS}/)."
        )
    common = load_plain(path / COMMON)
    check_weights(path / WEIGHTS)  # before any reader of ours or of mcore's opens them
    return common


def check_plain(obj: Any, where: str = "checkpoint") -> None:
    """ValueError naming the first entry of `obj` that `load_plain` would refuse."""
    if isinstance(obj, dict):
        for key, value in obj.items():
            check_plain(key, f"{where} (a key)")
            check_plain(value, f"{where}[{key!r}]")
    elif isinstance(obj, (list, tuple, set)):
        for i, value in enumerate(obj):
            check_plain(value, f"{where}[{i}]")
    elif not isinstance(obj, _PLAIN):
        raise ValueError(
            f"{where} is a {type(obj).__module__}.{type(obj).__qualname__}; checkpoints hold only "
            f"tensors, plain containers and primitives (so that loading them runs no code): "
            f"store it as one of those (e.g. str(path), dataclasses.asdict(config))."
        )


_PLAIN = (torch.Tensor, str, bytes, int, float, bool, type(None), torch.dtype, torch.device, torch.Size)


@dataclass(frozen=True)
class SavedModel:
    """What a checkpoint says about its model: enough to rebuild it without training code."""

    config: Any  # GPTConfig
    hf_family: str
    hf_path: Any  # the HF directory the run started from (tokenizer, generation config), or None
    dtype: torch.dtype
    padded_vocab_size: int  # embedding rows as saved (the vocab is padded per TP size)
    lora: Any = None  # LoRAConfig fields of a LoRA run (its checkpoint holds the adapters only)
    init_checkpoint: Any = None  # the checkpoint a fine-tuning run took its base weights from
    tokenizer_path: Any = None  # the data's tokenizer directory (exports copy it), or None
    head: str = "lm"  # the module's output_head: "lm", or "score" (a reward model)


def read_saved_model(path, name: str = "ckpt_path") -> SavedModel:
    extra = _load_common(Path(path), name).get("megatron", {})
    config = GPTConfig(**extra["model_config"])
    return SavedModel(config, extra.get("hf_family"), extra.get("hf_path"),
                      getattr(torch, extra.get("dtype", "float32")), _saved_padded_vocab(extra, config),
                      extra.get("lora"), extra.get("init_checkpoint"), extra.get("tokenizer_path"),
                      extra.get("head", "lm"))


def _saved_padded_vocab(extra: dict, config) -> int:
    return config.padded_vocab_size(extra.get("parallel", {}).get("tensor_model_parallel_size", 1))


def read_common(path: Path, model_config, tensor_parallel_size: int = 1) -> dict:
    """Lightning's part of the checkpoint, after checking it is one of ours for this model."""
    path = Path(path)
    common = _load_common(path)
    saved = common.get("megatron", {}).get("model_config", {})
    current = dataclasses.asdict(model_config)
    # Fields that do not change the weights: a resumed or fine-tuned run may set them anew.
    ignore = {"transformer_impl", "recompute_granularity", "recompute_method", "recompute_num_layers",
              "recompute_modules", "activation_offload_layers", "cuda_graphs", "extra", "seq_length",
              "attention_dropout", "hidden_dropout",
              # mcore's SequentialMLP, TE's grouped experts and torch's save the same sharded tensors
              "moe_grouped_gemm", "moe_grouped_gemm_backend", "moe_router_dtype"}
    differ = [f"{k}: checkpoint {saved.get(k)!r} vs model {v!r}" for k, v in current.items()
              if k not in ignore and k in saved and saved[k] != v]
    if differ:
        raise CheckpointLoadError(
            f"ckpt_path {path} was saved with a different model config: " + "; ".join(differ) + "."
        )
    rows = model_config.padded_vocab_size(tensor_parallel_size)
    saved_rows = _saved_padded_vocab(common.get("megatron", {}), model_config)
    if saved_rows != rows:
        raise CheckpointLoadError(
            f"ckpt_path {path} pads the vocab ({model_config.vocab_size}) to {saved_rows} rows, "
            f"tensor_model_parallel_size={tensor_parallel_size} pads it to {rows}: set "
            f"make_vocab_size_divisible_by so that both sizes agree (e.g. a multiple of "
            f"{model_config.make_vocab_size_divisible_by} * the larger TP size)."
        )
    return common


def read_resumed(path: Path, model_config, tensor_parallel_size: int, lora) -> dict:
    """`read_common` for a run that resumes `path`, whose adapters must be the checkpoint's."""
    common = read_common(path, model_config, tensor_parallel_size)
    check_resumed_lora(path, common.get("megatron", {}).get("lora"), lora, model_config)
    return common


def check_resumed_lora(path, saved, lora, model_config) -> None:
    """Refuse a resume whose LoRA config (`lora`) builds other adapters than the checkpoint's
    (`saved`, its recorded fields): they would miss from it or go untrained. A checkpoint from
    before expert adapters recorded no `experts`: its experts stayed frozen (experts=False)."""
    if (saved is None) != (lora is None):
        raise CheckpointLoadError(
            f"ckpt_path {path} was saved {'without' if saved is None else 'with'} LoRA, this run has "
            f"lora={'None' if lora is None else 'set'}: resume with the checkpoint's lora setting (to "
            f"start a new LoRA run from its weights, give the checkpoint as the model instead).")
    if lora is None:
        return
    old = saved_lora(saved)
    differ = [f"{k}: checkpoint {getattr(old, k)!r} vs run {getattr(lora, k)!r}"
              for k in ("rank", "alpha", "use_rslora", "base_precision") if getattr(old, k) != getattr(lora, k)]
    if resolve_targets(old.target_modules) != resolve_targets(lora.target_modules):
        differ.append(f"target_modules: checkpoint {old.target_modules!r} vs run {lora.target_modules!r}")
    if adapts_experts(old, model_config) != adapts_experts(lora, model_config):
        recorded = repr(saved["experts"]) if "experts" in saved else \
            "unset (saved before expert adapters existed: experts=False)"
        differ.append(f"experts: checkpoint {recorded}, the MoE experts "
                      f"{'adapted' if old.experts is not False else 'frozen'}, vs run {lora.experts!r}")
    if differ:
        raise CheckpointLoadError(
            f"ckpt_path {path} holds LoRA adapters of another LoRA config: " + "; ".join(differ) +
            ". Resume with the checkpoint's settings" +
            (" (LoRAConfig experts=False)" if old.experts is False and lora.experts is not False else "") +
            ", or start a new run.")


def _load_sharded(state: dict, path: Path) -> dict:
    """dist_checkpointing.load, with a damaged shard (every rank learns of any rank's failure)
    reported as a CheckpointLoadError naming the checkpoint."""
    check_weights(Path(path) / WEIGHTS)
    try:
        return dist_checkpointing.load(state, str(Path(path) / WEIGHTS))
    except CheckpointException as error:
        failures = getattr(error, "failures", {}) or {}
        first = next(iter(failures.values()), None)
        first = first[0] if isinstance(first, tuple) else first
        what = f"{type(first).__name__}: {first}".rstrip(": ") if first is not None else str(error)
        raise CheckpointLoadError(
            f"{Path(path) / WEIGHTS} cannot be read (on rank(s) {sorted(failures)}: {what}): a "
            f"shard file is truncated or damaged; use another checkpoint."
        ) from None


def load_model(path: Path, chunks) -> None:
    state = model_sharded_state_dict(chunks)
    loaded = _load_sharded(state, path)
    for key, chunk in zip(sorted(k for k in loaded if k.startswith("model")), chunks):
        model = getattr(chunk, "module", chunk)
        adapters_only = getattr(model, "lora", None) is not None
        check_extra_state(loaded[key], Path(path) / WEIGHTS)
        missing, unexpected = model.load_state_dict(loaded[key], strict=not adapters_only)
        missing = [k for k in missing if k.startswith("lora.")]
        if missing or unexpected:
            raise CheckpointLoadError(f"{path}: missing keys {missing}, unexpected keys {unexpected}.")


def load_optimizer(path: Path, chunks, optimizer) -> None:
    parts = mcore_parts(optimizer)
    if not distrib_optimizer.HAVE_APEX_OR_TE and any(
        isinstance(o, distrib_optimizer.DistributedOptimizer) for o in parts
    ):
        raise NotImplementedError(
            "Resuming the distributed optimizer's state needs Transformer Engine or Apex Adam: with "
            "torch's Adam (e.g. on CPU) megatron-core cannot load it (distrib_optimizer "
            "asserts on Adam's 'step'). Resume with use_distributed_optimizer=False, or weights only."
        )
    model_state = model_sharded_state_dict(chunks)
    state = {"optimizer": optimizer_sharded_state_dict(optimizer, model_state, is_loading=True)}
    loaded = _load_sharded(state, path)
    load_optimizer_state_dict(optimizer, loaded["optimizer"])


def load_rng(path: Path, rank: int) -> None:
    file = Path(path) / f"rng_{rank}.pt"
    if file.is_file():
        set_rng_state(load_plain(file))


def strip_for_common(checkpoint: dict[str, Any], extra: dict) -> dict:
    common = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
    common["megatron"] = extra
    check_plain(common)
    return common

