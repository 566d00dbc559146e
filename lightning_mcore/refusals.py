"""A refusal (this library's deliberate `raise` on a user mistake or a damaged file) told from a
bug, and reported once when it happens inside the ranks of a run.

Lightning's subprocess launcher (the CLI's default) makes the launching process rank 0 and
re-runs the command for the other ranks. A refusal every rank meets (a truncated checkpoint
shard, a text too short for one sequence) would print one traceback per rank; instead rank 0
prints one `error:` line, stops the ranks it started and exits 1. The other ranks stay quiet and
wait for that; one whose refusal rank 0 never meets (rank 0 waits for it in a collective)
reports it itself after REPORT_GRACE_S. A bug keeps its traceback (on a rank other than 0, after
the same wait: its error may follow from rank 0's, which rank 0 then reports).

Under Lightning's multiprocessing launcher (start_method fork/spawn: notebooks, tests) the
launching process runs no rank: a rank leaves its refusal's line for it (`report_in_rank`) and
raises on; the launching process prints that one line instead of the traceback torch hands it.

Reported the same way: a RunFailure (a NaN loss: the run cannot go on, though nothing is wrong
with the command) and a write the disk refuses (full, read-only, not permitted: `write_failure`
names the path), which torch and mcore raise as errors of their own, not ours.
"""

from __future__ import annotations

import errno
import linecache
import os
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

from torch.distributed.checkpoint.api import CheckpointException
from torch.multiprocessing.spawn import ProcessException

PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
# How long a rank other than 0 that refused waits for rank 0 to report and stop it.
REPORT_GRACE_S = 10.0
REFUSED_EXIT = 3  # the exit code of a rank other than 0 that reported a refusal itself
DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
NOT_WRITABLE = (errno.EROFS, errno.EACCES, errno.EPERM)
# torch's zip writer (inline_container.cc) when a write comes back short, with no errno
SHORT_WRITE = "unexpected pos"
# mcore's save threads pass on only the class of the error they hit (filesystem_async.py:
# "An error is caught while starting worker 0, error: <class 'OSError'>"); they log its text
UNNAMED_WRITE_ERRORS = ("error: <class 'OSError'>", "error: <class 'RuntimeError'>")
# below this much free space a short write means a full disk
FULL_BELOW_BYTES = 64 * 2**20


class RunFailure(Exception):
    """Base of this library's errors for a run that cannot go on though the command is right
    (a NaN loss): reported like a refusal, one line from rank 0."""


REFUSAL_TYPES = (ValueError, TypeError, OSError, NotImplementedError, RunFailure)


def traceback_frames(error: BaseException) -> list:
    """(frame, line number) of every traceback entry of `error`, outermost first."""
    frames, tb = [], error.__traceback__
    while tb is not None:
        frames.append((tb.tb_frame, tb.tb_lineno))
        tb = tb.tb_next
    return frames


def deliberate(error: BaseException) -> bool:
    """Raised by a `raise ...Error(...)` line of this library, not by an accident (a bug)."""
    frames = traceback_frames(error)
    if not frames:
        return False
    file, line = frames[-1][0].f_code.co_filename, frames[-1][1]
    return (os.path.abspath(file).startswith(PACKAGE_DIR)
            and linecache.getline(file, line).lstrip().startswith("raise"))


def report_refusals(trainer: Any, run: Callable, **kwargs: Any) -> None:
    """`run(**kwargs)` (trainer.fit, ...), a refusal inside it reported as described above."""
    try:
        run(**kwargs)
    except (Exception, CheckpointException) as error:  # noqa: BLE001 - re-raised unless a refusal
        rank, launcher = trainer.global_rank, trainer.strategy.launcher
        reported = _reported_in_a_rank(error, launcher)
        if reported is not None:
            _print_error(reported)
            raise SystemExit(1) from None
        message = refusal_message(error, trainer)
        if message is None:
            if rank == 0 and _another_rank_refused(launcher):
                raise SystemExit(1) from None  # that rank's `error:` line says why; this follows
            if rank != 0:  # it may only follow from rank 0's (a failed save, a peer gone from a
                time.sleep(REPORT_GRACE_S)  # collective): rank 0 reports that and stops us first
            raise
        if rank == 0:
            if launcher is not None:  # the ranks it started would only repeat the message
                launcher.kill(signal.SIGKILL)
            _print_error(message)  # the library's messages name the file at fault
            raise SystemExit(1) from None
        time.sleep(REPORT_GRACE_S)  # rank 0 meets the same refusal, reports it and stops us
        _print_error(f"(rank {rank}) {message}")
        raise SystemExit(REFUSED_EXIT) from None


def report_in_rank(reports: str, trainer: Any, run: Callable, *args: Any, **kwargs: Any) -> Any:
    """`run(*args, **kwargs)` in a rank a multiprocessing launcher started. A refusal's line is
    left in the directory `reports` (`rank-<n>`) for the launching process, and the error is
    raised on (torch hands its traceback to the launching process: a Python caller of
    Trainer.fit gets it as before). A rank other than 0 first waits REPORT_GRACE_S, so that rank
    0's line, if it meets the refusal too, is there before torch stops the ranks."""
    try:
        return run(*args, **kwargs)
    except (Exception, CheckpointException) as error:  # noqa: BLE001 - always re-raised
        message, rank = refusal_message(error, trainer), trainer.global_rank
        if message is not None:
            Path(reports, f"rank-{rank}").write_text(message)
            if rank != 0:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the launcher may stop us at once
                time.sleep(REPORT_GRACE_S)
        if not isinstance(error, Exception):  # torch hands on Exceptions only; this one the rank
            raise RuntimeError(f"{type(error).__name__}: {error}") from error  # would print itself
        raise


def _reported_in_a_rank(error: BaseException, launcher: Any) -> Optional[str]:
    """The line to print for a refusal a forked rank left (`report_in_rank`) when torch tells the
    launching process that a rank failed: rank 0's, else the lowest rank's, naming it."""
    refusals = getattr(launcher, "refusals", None) or {}
    if not isinstance(error, ProcessException) or not refusals:
        return None
    rank = min(refusals)
    return refusals[rank] if rank == 0 else f"(rank {rank}) {refusals[rank]}"


def refusal_message(error: BaseException, trainer: Any = None) -> Optional[str]:
    """The one line that reports `error` (a refusal or a write the disk refused), None for a bug."""
    if isinstance(error, REFUSAL_TYPES) and deliberate(error):
        return str(error)
    return write_failure(error, trainer)


def write_failure(error: BaseException, trainer: Any = None) -> Optional[str]:
    """What a write the disk refused (full, read-only, not permitted) says, naming the path:
    the error's own file name, else the checkpoint being saved, else the checkpoint directories.
    None for any other error."""
    for cause in _causes(error):
        code = _write_errno(cause)
        if code is None:
            continue
        path = getattr(cause, "filename", None) or _saving(error) or _checkpoint_dir(trainer) or "a file"
        free = _free_bytes(None if path == "a file" else path)
        on_disk = f"; {free} bytes free on it" if free >= 0 else ""
        if code in DISK_FULL or (code == 0 and 0 <= free < FULL_BELOW_BYTES):
            return (f"cannot write {path}: the disk is full ({os.strerror(code or errno.ENOSPC)}{on_disk}). "
                    f"Free space there or write the checkpoints elsewhere (ModelCheckpoint's dirpath).")
        if code == 0:
            return (f"cannot write {path}: a write failed ({cause}{on_disk}): the disk may be "
                    f"failing; the rank's log above may say more.")
        verb = "write" if code == errno.EROFS else "access"  # permission is refused to readers too
        return (f"cannot {verb} {path}: {os.strerror(code)}. Make it writable or write the "
                f"checkpoints elsewhere (ModelCheckpoint's dirpath).")
    return None


def _causes(error: BaseException) -> Iterator[BaseException]:
    """`error`, the errors it was raised from, and those of each rank a torch distributed
    checkpoint error (CheckpointException) carries."""
    seen, todo = set(), [error]
    while todo:
        error = todo.pop(0)
        if error is None or id(error) in seen:
            continue
        seen.add(id(error))
        yield error
        todo += [error.__cause__, error.__context__]
        failures = (getattr(error, "failures", None) or {}).values()  # rank: (error, its stack)
        todo += [failure[0] if isinstance(failure, tuple) else failure for failure in failures]


def _write_errno(error: BaseException) -> Optional[int]:
    """The errno of a refused write (0: a short write or a save thread's error, which carry
    none), or None."""
    codes = DISK_FULL + NOT_WRITABLE
    if isinstance(error, OSError) and error.errno in codes:
        return error.errno
    text = str(error) if isinstance(error, Exception) else ""
    found = [code for code in codes if f"[Errno {code}]" in text]
    if found:
        return found[0]
    unnamed = SHORT_WRITE in text or any(text.endswith(e) for e in UNNAMED_WRITE_ERRORS)
    return 0 if isinstance(error, RuntimeError) and unnamed else None


def _saving(error: BaseException) -> Optional[str]:
    """The checkpoint being saved when `error` was raised: `filepath` of the innermost
    save_checkpoint (Trainer's, the strategy's) in its traceback."""
    for frame, _ in reversed(traceback_frames(error)):
        if frame.f_code.co_name == "save_checkpoint" and "filepath" in frame.f_locals:
            return str(frame.f_locals["filepath"])
    return None


def _checkpoint_dir(trainer: Any) -> Optional[str]:
    """The directory of the trainer's (first) ModelCheckpoint."""
    callbacks = getattr(trainer, "checkpoint_callbacks", None) or []
    dirs = [c.dirpath for c in callbacks if getattr(c, "dirpath", None)]
    return str(dirs[0]) if dirs else None


def _free_bytes(path: Optional[str]) -> int:
    """Free space on the filesystem of `path` (its nearest existing parent); -1 if unknown."""
    if path is None:
        return -1
    existing = Path(path).absolute()
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    try:
        return shutil.disk_usage(existing).free
    except OSError:
        return -1


def _print_error(message: str) -> None:
    sys.stderr.write(f"error: {message}\n")
    sys.stderr.flush()


def _exit_code(proc: Any):
    """A started rank's exit code, or None while it runs: a Popen (the subprocess launcher) or
    a multiprocessing Process (start_method fork/spawn)."""
    return proc.poll() if hasattr(proc, "poll") else proc.exitcode


def _another_rank_refused(launcher: Any, wait_s: float = 3.0) -> bool:
    """Whether a rank that rank 0 started (Lightning's launchers keep them in `procs`) exited
    after reporting a refusal: rank 0's own error (a peer gone from a
    collective) only follows from it."""
    procs = getattr(launcher, "procs", None) or []
    deadline = time.monotonic() + wait_s
    while procs:
        if REFUSED_EXIT in [_exit_code(proc) for proc in procs]:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return False
