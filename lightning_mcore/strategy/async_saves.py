"""The checkpoints a run is still writing asynchronously, published in the order they were saved.

Lightning may save a name again (last.ckpt) or remove a checkpoint (save_top_k) while an earlier
save is still being written by mcore's forked writer. Each save writes into its own temporary
directory (checkpoint_io.temporary_path); one removed before it was published is dropped at
publication instead of appearing afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue


@dataclass
class _Save:
    path: Path
    removed: bool = False


class AsyncSaves:
    def __init__(self) -> None:
        self._queue = None  # mcore's AsyncCallsQueue, made by the first save
        self._saves: list[_Save] = []

    @staticmethod
    def new(path) -> _Save:
        """A save about to start; its `removed` tells the publication whether it is still wanted."""
        return _Save(Path(path))

    def schedule(self, request, save: _Save) -> None:
        """Start writing `save` (collective). A None request: it already finished synchronously."""
        if request is None:
            return

        self._queue = self._queue or AsyncCallsQueue()
        self._queue.schedule_async_request(request)
        self._saves.append(save)

    def finalize(self, blocking: bool = False) -> None:
        """Publish the saves written on every rank, oldest first (collective)."""
        if self._queue is None or not self._queue.get_num_unfinalized_calls():
            return
        done = self._queue.maybe_finalize_async_calls(blocking=blocking)
        del self._saves[:len(done)]

    def remove(self, path) -> None:
        """`path`, should it still be written, will not be published."""
        for save in self._saves:
            if save.path == Path(path):
                save.removed = True

    def __len__(self) -> int:
        return len(self._saves)
