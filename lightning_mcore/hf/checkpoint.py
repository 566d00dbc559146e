"""Lazy, sliced reads from a Hugging Face safetensors checkpoint directory.

Only the rows a rank owns are read (`safe_open(...).get_slice`), so no rank ever holds the whole
model. Single-file (`model.safetensors`) and sharded (`model.safetensors.index.json`) layouts.
"""

from __future__ import annotations

import json
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Optional

import torch
from safetensors import SafetensorError, safe_open

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


class CheckpointError(ValueError):
    """An HF checkpoint directory that cannot be read as asked; the message names the file."""


@contextmanager
def open_safetensors(path: Path):
    """safe_open(path), or a CheckpointError naming the file when its header is unreadable
    (a truncated download: safetensors checks that the header covers the whole file)."""
    try:
        handle = safe_open(path, framework="pt")
    except (SafetensorError, OSError) as error:
        raise CheckpointError(
            f"{path} cannot be read ({error}): the file is incomplete or damaged; download or "
            f"copy it again."
        ) from None
    with handle as f:
        yield f


def weight_map(directory: Path) -> dict[str, Path]:
    """Tensor name -> file, checking that every file the index names exists."""
    directory = Path(directory)
    if (directory / INDEX).is_file():
        names = json.loads((directory / INDEX).read_text())["weight_map"]
        files = {f: directory / f for f in set(names.values())}
        missing = sorted(f for f, p in files.items() if not p.is_file())
        if missing:
            raise CheckpointError(
                f"{directory / INDEX} names shard(s) that are not in the directory: "
                f"{', '.join(missing)}. The download or copy is incomplete."
            )
        return {name: files[f] for name, f in names.items()}
    if (directory / SINGLE).is_file():
        with open_safetensors(directory / SINGLE) as f:
            return {name: directory / SINGLE for name in f.keys()}
    raise CheckpointError(
        f"{directory} has neither {SINGLE} nor {INDEX}: not a safetensors checkpoint."
    )


class SafetensorsReader:
    """reader.get(name, dim, start, stop) / reader.shape(name) / reader.dtype(name)."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self.files = weight_map(self.directory)
        self._stack = ExitStack()
        self._open: dict[Path, object] = {}

    def __enter__(self) -> "SafetensorsReader":
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def _slice(self, name: str):
        if name not in self.files:
            raise CheckpointError(f"tensor {name!r} is not in the checkpoint {self.directory}.")
        path = self.files[name]
        if path not in self._open:
            self._open[path] = self._stack.enter_context(open_safetensors(path))
        return self._open[path].get_slice(name)

    def shape(self, name: str) -> tuple:
        return tuple(self._slice(name).get_shape())

    def dtype(self, name: str) -> str:
        return self._slice(name).get_dtype()

    def get(self, name: str, dim: int = 0, start: Optional[int] = None,
            stop: Optional[int] = None) -> torch.Tensor:
        sl = self._slice(name)
        if start is None and stop is None:
            return sl[:]
        index = [slice(None)] * len(sl.get_shape())
        index[dim] = slice(start, stop)
        return sl[tuple(index)]

    def get_expert(self, name: str, expert: int, dim: int = 0, start: Optional[int] = None,
                   stop: Optional[int] = None) -> torch.Tensor:
        """Rows [start, stop) along `dim` of `expert`'s slice of a tensor stacking every
        expert along dim 0 (reading that slice only)."""
        sl = self._slice(name)
        index = [slice(None)] * len(sl.get_shape())
        index[0] = slice(expert, expert + 1)
        index[dim + 1] = slice(start, stop)
        return sl[tuple(index)][0]


class ExpertView:
    """One expert of a reader whose tensors stack every expert along dim 0: the transforms'
    reader interface on [expert] (an Entry with stacked=True)."""

    def __init__(self, reader, expert: int) -> None:
        self.reader, self.expert = reader, expert

    def shape(self, name: str) -> tuple:
        return tuple(self.reader.shape(name)[1:])

    def get(self, name: str, dim: int = 0, start: Optional[int] = None,
            stop: Optional[int] = None) -> torch.Tensor:
        return self.reader.get_expert(name, self.expert, dim, start, stop)
