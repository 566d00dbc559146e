"""Where a `fit` writes its checkpoints, held by one run at a time, and the checkpoint that
`ckpt_path="last"` resumes, found before any worker starts (the CLI's checks).

Two runs started at once in one directory would both write `last.ckpt` (Lightning versions it
as `last-v1.ckpt` only against a checkpoint already there when a run starts), each replacing
the other's. The launching process of a run holds an exclusive `flock` on each checkpoint
directory for as long as the run lasts: a second run's is refused. The lock is on the directory
itself, so no file is created; the kernel drops it when the process ends, however it ends, so a
crashed run leaves nothing stale behind.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import warnings
from pathlib import Path
from typing import Any, Iterator, Optional

from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch.callbacks import ModelCheckpoint, OnExceptionCheckpoint


class CheckpointDirError(OSError):
    """A checkpoint directory the run cannot write into, or another run writes into now."""


def checkpoint_dir(callback: ModelCheckpoint, trainer: Any) -> str:
    """The directory `callback` saves into, resolved as ModelCheckpoint does at setup (its
    documented order): its dirpath, else the first logger's `save_dir/name/version/checkpoints`,
    else `default_root_dir/checkpoints`."""
    if callback.dirpath is not None:
        return str(callback.dirpath)
    if trainer.loggers:
        logger = trainer.loggers[0]
        version = logger.version if isinstance(logger.version, str) else f"version_{logger.version}"
        save_dir = logger.save_dir or trainer.default_root_dir
        return os.path.join(save_dir, str(logger.name), version, "checkpoints")
    return os.path.join(trainer.default_root_dir, "checkpoints")


def checkpoint_dirs(trainer: Any) -> list[str]:
    """The distinct directories of the trainer's ModelCheckpoints, in order."""
    callbacks = [c for c in trainer.checkpoint_callbacks if isinstance(c, ModelCheckpoint)]
    dirs = [checkpoint_dir(c, trainer) for c in callbacks]
    return list(dict.fromkeys(os.path.abspath(d) for d in dirs))


def last_checkpoint(trainer: Any) -> Optional[str]:
    """The checkpoint `ckpt_path="last"` resumes, or None where there is none: the rule of
    Lightning's checkpoint connector (the newest by modification time of every ModelCheckpoint's
    `last*.ckpt` and every OnExceptionCheckpoint's file), through ModelCheckpoint's own listing."""
    candidates = {c.ckpt_path for c in trainer.callbacks if isinstance(c, OnExceptionCheckpoint)}
    for callback in trainer.checkpoint_callbacks:
        if isinstance(callback, ModelCheckpoint):
            candidates |= callback._find_last_checkpoints(trainer)
    times = {}
    for path in filter(None, candidates):
        fs = get_filesystem(path)
        if fs.exists(path):
            times[path] = fs.modified(path)
    return max(times, key=times.get) if times else None


def launching_rank_zero(trainer: Any) -> bool:
    """Whether this process starts the run (global rank 0 before the launch: not a process that
    Lightning's launcher started for another rank, nor the launcher of another node)."""
    env = getattr(trainer.strategy, "cluster_environment", None)
    if env is None:
        return trainer.global_rank == 0
    return env.global_rank() == 0 and env.node_rank() == 0 and env.local_rank() == 0


@contextlib.contextmanager
def held(directories: list[str]) -> Iterator[None]:
    """Hold each directory (created if missing) for the duration; CheckpointDirError names a
    directory that cannot be written or that another run holds."""
    with contextlib.ExitStack() as stack:
        for directory in directories:
            stack.enter_context(_held(Path(directory)))
        yield


@contextlib.contextmanager
def _held(directory: Path) -> Iterator[None]:
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise CheckpointDirError(
            f"{directory}: cannot create it ({error.strerror}: {error.filename})") from None
    if not os.access(directory, os.W_OK):
        code = errno.EROFS if _read_only_mount(directory) else errno.EACCES
        raise CheckpointDirError(f"{directory}: the run cannot write into it ({os.strerror(code)}); "
                                 f"make it writable or set another dirpath")
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise CheckpointDirError(f"{directory}: another run is writing its checkpoints there now (it "
                                 f"holds the directory's lock), and two runs in one directory "
                                 f"replace each other's last.ckpt. Wait for it to end, or set "
                                 f"another dirpath") from None
    except OSError as error:  # a filesystem that cannot lock a directory (some network mounts)
        warnings.warn(f"{directory}: cannot lock it ({error.strerror}); a second run started "
                      f"there at the same time would not be refused.", stacklevel=2)
    try:
        yield
    finally:
        os.close(fd)


def _read_only_mount(directory: Path) -> bool:
    try:
        return bool(os.statvfs(directory).f_flag & os.ST_RDONLY)
    except OSError:
        return False
