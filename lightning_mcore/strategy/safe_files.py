"""Reading the files of a checkpoint a user hands us without running code from them.

A checkpoint directory may come from anywhere (a colleague, a hub, a crafted file). Every file
in it that some reader would unpickle is checked here first, in the reading process:

    common.pt, rng_<rank>.pt     torch's weights-only unpickler (tensors, plain containers)
    weights/common.pt            mcore's plain part: the same
    weights/.metadata            torch dcp's index, read with plain `pickle` by its reader:
                                 here with an unpickler that resolves only the classes dcp
                                 metadata is made of (METADATA_GLOBALS)
    weights/*.distcp, entries    mcore's sharded objects (e.g. layers' `_extra_state`), which
    of bytes                     dcp's load planner reads with torch.load(weights_only=False):
                                 each entry's bytes are read here with weights_only=True first;
                                 a layer's `_extra_state`, which Transformer Engine unpickles
                                 with plain pickle, must be empty (check_extra_state)

Anything else is refused with a CheckpointLoadError naming the file and the blocked global.
"""

from __future__ import annotations

import functools
import io
import os
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata


class CheckpointLoadError(ValueError):
    """A ckpt_path that does not exist, is not our checkpoint, belongs to another model, or holds
    something that loading it could run."""


_DCP = "torch.distributed.checkpoint."
# What torch's dcp `.metadata` is made of (torch 2.4-2.13): its dataclasses and enums, torch.Size,
# layouts by name, dtypes (checked to be dtypes in `_MetadataUnpickler.find_class`), and the
# path a StorageMeta may record.
METADATA_GLOBALS = {
    _DCP + "metadata": {"Metadata", "MetadataIndex", "StorageMeta", "TensorProperties",
                        "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                        "_MEM_FORMAT_ENCODING"},
    _DCP + "planner": {"SavePlan", "LoadPlan", "WriteItem", "WriteItemType", "ReadItem",
                       "LoadItemType", "TensorWriteData", "BytesIOWriteData"},
    _DCP + "filesystem": {"_StorageInfo"},
    "torch": {"Size"},
    "torch.serialization": {"_get_layout"},
    "pathlib": {"PosixPath", "PurePosixPath", "Path"},
    "collections": {"OrderedDict"},
}


class UnsafeFileError(CheckpointLoadError):
    """A checkpoint file that names a global its format never holds."""


def _refusal(file, what: str) -> UnsafeFileError:
    return UnsafeFileError(
        f"{file} holds {what}; refusing to load it, as that could run arbitrary code. "
        f"MegatronStrategy never writes such objects: this file was not written by "
        f"lightning-mcore (or torch's distributed checkpoint), or was changed.")


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file, path: Path):
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        if name in METADATA_GLOBALS.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise _refusal(self.path, f"the Python global {module}.{name}, which torch's "
                                  f"distributed-checkpoint metadata never holds")


def read_dcp_metadata(file: Path):
    """torch dcp's Metadata from `file` (a `.metadata`), resolving only METADATA_GLOBALS."""
    try:
        with open(file, "rb") as stream:
            return _MetadataUnpickler(stream, file).load()
    except CheckpointLoadError:
        raise
    except (pickle.UnpicklingError, EOFError, OSError, ValueError, TypeError, AttributeError) as error:
        raise CheckpointLoadError(f"{file} cannot be read ({type(error).__name__}: {error}); the "
                                  f"checkpoint is incomplete or damaged.") from None


def load_plain(file: Path, data: bytes | None = None, name: str | None = None) -> Any:
    """A checkpoint file (or `data`, bytes stored in it, called `name` in messages) of tensors,
    plain containers and primitives. torch's weights-only unpickler refuses anything else, so a
    crafted file cannot run code in this process."""
    name = name or str(file)
    try:
        return torch.load(io.BytesIO(data) if data is not None else file, map_location="cpu",
                          weights_only=True)
    except pickle.UnpicklingError as error:
        lines = [line.strip() for line in str(error).splitlines() if "GLOBAL" in line]
        reason = (lines[0] if lines else "unsupported content")[:200]
        raise _refusal(name, f"Python objects other than tensors and plain containers ({reason})") from None
    except (EOFError, RuntimeError, OSError) as error:
        detail = (str(error).splitlines() or [""])[0]
        raise CheckpointLoadError(f"{name} cannot be read ({type(error).__name__}: {detail}); the "
                                  f"checkpoint is incomplete or damaged.") from None


def check_weights(weights: Path) -> None:
    """Refuse a `weights/` directory (mcore torch_dist) holding anything its readers would
    unpickle unrestricted (see the module docstring). Cached per state of the directory's files
    (a changed file is checked again): every loader calls it, so the launching process and
    each rank check once."""
    weights = Path(weights)
    files = sorted(weights.iterdir()) if weights.is_dir() else []
    _check_weights(weights, tuple(_signature(f) for f in files))


def _signature(file: Path) -> tuple:
    try:
        stat = file.stat()
    except OSError:
        return (str(file), None)
    return (str(file), stat.st_size, stat.st_mtime_ns, stat.st_ino)


@functools.lru_cache(maxsize=16)
def _check_weights(weights: Path, _files: tuple) -> None:
    if (weights / "common.pt").is_file():
        load_plain(weights / "common.pt")
    index = weights / ".metadata"
    if not index.is_file():
        return  # not torch_dist: mcore's own reader refuses the directory
    metadata = read_dcp_metadata(index)
    byte_keys = {key for key, entry in (getattr(metadata, "state_dict_metadata", None) or {}).items()
                 if isinstance(entry, BytesStorageMetadata)}
    for where, info in (getattr(metadata, "storage_data", None) or {}).items():
        if getattr(where, "fqn", None) in byte_keys:
            _check_bytes_entry(weights, where.fqn, info)


def _check_bytes_entry(weights: Path, key: str, info) -> None:
    """The bytes of one sharded object, read with weights_only=True as the planner would read
    them without it."""
    shard = weights / str(info.relative_path)
    if os.path.dirname(str(info.relative_path)) or getattr(info, "transform_descriptors", None):
        raise _refusal(weights / ".metadata", f"an entry for {key!r} stored as {info}, which torch's "
                                              f"distributed checkpoint writes only with a plain file name")
    try:
        with open(shard, "rb") as stream:
            stream.seek(int(info.offset))
            data = stream.read(int(info.length))
    except OSError as error:
        raise CheckpointLoadError(f"{shard} cannot be read ({type(error).__name__}: {error}); the "
                                  f"checkpoint is incomplete or damaged.") from None
    load_plain(shard, data, name=f"{shard} (entry {key!r})")


def check_extra_state(state: dict, weights: Path) -> None:
    """Refuse a loaded model state whose layers carry `_extra_state`: Transformer Engine reads a
    non-empty one (FP8 scaling state) with plain `pickle.loads`. lightning-mcore trains no FP8,
    so it saves None (local layers) or an empty tensor (TE layers)."""
    for key, value in state.items():
        if key.endswith("_extra_state") and not (
                value is None or isinstance(value, torch.Tensor) and value.numel() == 0):
            raise _refusal(weights, f"a non-empty {key} ({type(value).__name__}), which Transformer "
                                    f"Engine would unpickle")
