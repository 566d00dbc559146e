"""Stopping on SIGTERM / SIGINT (a scheduler's preemption, Ctrl+C) without hanging or losing a
checkpoint, and SLURM's requeue signal.

Lightning's own SIGTERM handler runs a collective (a broadcast) inside the handler, wherever each
rank happens to be: in the middle of a checkpoint save the ranks then wait in different
collectives forever. Its SIGTERMException also ends the process with exit code 0, so a
preempted run looks like a finished one. Here a handler only notes the signal (and rank 0 passes
it on to the ranks it started); at the start of the next training step every rank learns of any
rank's signal in one all-reduce and all stop together, after the checkpoints still being written
are finished and published (teardown), with exit code 128 + signal (143, 130), as a shell
reports a process ended by that signal. Should a rank never reach that point (a peer died in a
collective), it ends itself GRACE_S after the signal.

SLURM's requeue signal (SLURMEnvironment(auto_requeue=True), Lightning's default on SLURM) is
honoured as Lightning does: an `hpc_ckpt_<n>.ckpt` is saved in the run's root directory (which
Lightning resumes from when the job starts again) and rank 0 requeues the job, at the same step
boundary on every rank instead of inside the handler.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed as dist

GRACE_S = 300.0  # after a stop signal, the longest a rank waits to reach a step boundary
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopSignal(SystemExit):
    """The run stopped on a signal; its exit code is 128 + the signal's number."""

    def __init__(self, signum: int):
        super().__init__(128 + signum)
        self.signum = signum


class SignalWatch:
    """Notes stop and requeue signals in this process; `agreed()` tells every rank what any
    rank received (collective)."""

    def __init__(self) -> None:
        self._received = 0  # the first stop signal's number; 0 if none
        self._requeue = False
        self._previous: dict = {}
        self._pid = None
        self._forward: Optional[Callable[[int], None]] = None
        self._group = None
        self._timer: Optional[threading.Timer] = None

    def install(self, forward: Optional[Callable[[int], None]], requeue_signal: Optional[int],
                group=None) -> None:
        """Handle the stop signals (and `requeue_signal`) in this process from now on; `forward`
        passes a signal on to the ranks this process started; `group`: a CPU (gloo) group of
        all ranks for `agreed`, or None for the default one."""
        if threading.current_thread() is not threading.main_thread():
            return
        self._pid, self._forward, self._group = os.getpid(), forward, group
        self._received, self._requeue = 0, False
        for signum in (*STOP_SIGNALS, *([requeue_signal] if requeue_signal else [])):
            self._previous.setdefault(signum, signal.getsignal(signum))
            signal.signal(signum, self._on_signal)

    def uninstall(self) -> None:
        """Restore the handlers found at `install`; a stop's deadline no longer applies (the
        run has ended, the process may go on: a notebook, a script after fit)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        for signum, handler in self._previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        self._previous = {}

    def _on_signal(self, signum: int, _frame) -> None:
        if os.getpid() != self._pid:
            return  # a forked checkpoint writer: it finishes its files, its rank decides
        if signum not in STOP_SIGNALS:
            self._requeue = True
            return
        if self._received:
            return
        self._received = signum
        if self._forward is not None:
            self._forward(signum)
        self._timer = threading.Timer(GRACE_S, self._give_up, args=(signum,))
        self._timer.daemon = True
        self._timer.start()

    @staticmethod
    def _give_up(signum: int) -> None:
        sys.stderr.write(f"error: stopped by {signal.Signals(signum).name}, but this rank did not reach a "
                         f"step boundary within {GRACE_S:g} s (a peer rank is gone); exiting.\n")
        sys.stderr.flush()
        os._exit(128 + signum)

    def agreed(self) -> tuple[int, bool]:
        """(the stop signal any rank received or 0, whether any rank received the requeue
        signal): one all-reduce of two integers on the CPU."""
        flags = torch.tensor([self._received, int(self._requeue)], dtype=torch.int64)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self._group)
        self._requeue = False
        return int(flags[0]), bool(flags[1])


def hpc_checkpoint_path(root) -> Path:
    """The next `hpc_ckpt_<n>.ckpt` under `root`, numbered as Lightning numbers them (it resumes
    from the highest when a requeued SLURM job starts again)."""
    root = Path(root)
    numbers = [int(m.group(1)) for p in root.glob("hpc_ckpt_*.ckpt")
               if (m := re.fullmatch(r"hpc_ckpt_(\d+)\.ckpt", p.name))]
    return root / f"hpc_ckpt_{max(numbers, default=0) + 1}.ckpt"


def requeue_slurm_job() -> None:
    """`scontrol requeue` this job (an array job's task), as Lightning's SLURM handler does."""
    array_job = os.environ.get("SLURM_ARRAY_JOB_ID")
    job = f"{array_job}_{os.environ['SLURM_ARRAY_TASK_ID']}" if array_job else os.environ["SLURM_JOB_ID"]
    if not re.fullmatch(r"[0-9_]+", job):
        raise ValueError(f"SLURM job id {job!r} is not a number; not requeued.")
    result = subprocess.call(["scontrol", "requeue", job])
    if result != 0:
        sys.stderr.write(f"warning: `scontrol requeue {job}` failed with exit code {result}.\n")
