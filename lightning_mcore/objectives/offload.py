"""Frozen weights kept in (pinned) CPU memory between uses: a DPO or GRPO reference model holds
GPU memory only while its forward pass runs, not all step long."""

from __future__ import annotations

import contextlib
from typing import ContextManager, Iterable, Iterator, Optional, Union

import torch


class OffloadedWeights:
    """Every parameter and buffer of `chunks`, moved to CPU memory once (pinned when CUDA is
    available, so that copies to the GPU run asynchronously) and on `device` only inside
    ``with weights.on(device):``.

    Moves assign ``tensor.data``: the modules keep the same Parameter and buffer objects, so
    nothing that holds them (hooks, tied weights, the model itself) needs rebuilding. For frozen
    weights only: leaving the block drops the device copies without copying them back, because
    the CPU copy is still current (no optimizer or gradient ever writes a frozen reference); a
    write inside the block is lost."""

    def __init__(self, chunks: Iterable[torch.nn.Module]) -> None:
        tensors: dict[int, torch.Tensor] = {}  # by identity: a tied weight moves once
        for chunk in chunks:
            for tensor in (*chunk.parameters(), *chunk.buffers()):
                tensors.setdefault(id(tensor), tensor)
        self._tensors = list(tensors.values())
        pin = torch.cuda.is_available()
        self._host = [torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin).copy_(t.detach())
                      for t in self._tensors]
        self._assign(self._host)

    @property
    def nbytes(self) -> int:
        """CPU memory the weights take."""
        return sum(h.numel() * h.element_size() for h in self._host)

    @contextlib.contextmanager
    def on(self, device: Union[str, torch.device]) -> Iterator[None]:
        """The weights on `device` for the block; in CPU memory again after it (even on error)."""
        copies = [torch.empty(h.shape, dtype=h.dtype, device=device).copy_(h, non_blocking=True)
                  for h in self._host]
        self._assign(copies)
        try:
            yield
        finally:
            self._assign(self._host)

    def _assign(self, storage: list[torch.Tensor]) -> None:
        for tensor, data in zip(self._tensors, storage):
            tensor.data = data


def on_device(weights: Optional[OffloadedWeights], device: Union[str, torch.device]) -> ContextManager:
    """`weights.on(device)`; nothing to move for weights that are not offloaded (None)."""
    return contextlib.nullcontext() if weights is None else weights.on(device)
