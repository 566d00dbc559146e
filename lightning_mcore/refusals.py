"""A refusal (this library's deliberate `raise` on a user mistake or a damaged file) told from a
bug, and reported once when it happens inside the ranks of a run.

Lightning's subprocess launcher (the CLI's default) makes the launching process rank 0 and
re-runs the command for the other ranks. A refusal every rank meets (a truncated checkpoint
shard, a text too short for one sequence) would print one traceback per rank; instead rank 0
prints one `error:` line, stops the ranks it started and exits 1. The other ranks stay quiet and
wait for that; one whose refusal rank 0 never meets (rank 0 waits for it in a collective)
reports it itself after REPORT_GRACE_S. A bug keeps its traceback.
"""

from __future__ import annotations

import linecache
import os
import signal
import sys
import time
from typing import Any, Callable

PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
# How long a rank other than 0 that refused waits for rank 0 to report and stop it.
REPORT_GRACE_S = 10.0
REFUSED_EXIT = 3  # the exit code of a rank other than 0 that reported a refusal itself
REFUSAL_TYPES = (ValueError, TypeError, OSError, NotImplementedError)


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
    except Exception as error:  # noqa: BLE001 - re-raised unless a refusal
        rank, launcher = trainer.global_rank, trainer.strategy.launcher
        if not (isinstance(error, REFUSAL_TYPES) and deliberate(error)):
            if rank == 0 and _another_rank_refused(launcher):
                raise SystemExit(1) from None  # that rank's `error:` line says why; this follows
            raise
        if rank == 0:
            if launcher is not None:  # the ranks it started would only repeat the message
                launcher.kill(signal.SIGKILL)
            _print_error(str(error))  # the library's messages name the file at fault
            raise SystemExit(1) from None
        time.sleep(REPORT_GRACE_S)  # rank 0 meets the same refusal, reports it and stops us
        _print_error(f"(rank {rank}) {error}")
        raise SystemExit(REFUSED_EXIT) from None


def _print_error(message: str) -> None:
    sys.stderr.write(f"error: {message}\n")
    sys.stderr.flush()


def _another_rank_refused(launcher: Any, wait_s: float = 3.0) -> bool:
    """Whether a rank that rank 0 started (Lightning's subprocess launcher keeps them in
    `procs`) exited after reporting a refusal: rank 0's own error (a peer gone from a
    collective) only follows from it."""
    procs = getattr(launcher, "procs", None) or []
    deadline = time.monotonic() + wait_s
    while procs:
        if REFUSED_EXIT in [proc.poll() for proc in procs]:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return False
