"""Ranks forked from the launching process, for a program that makes one Trainer call (the CLI).

Lightning's subprocess launcher (start_method "popen") keeps the launching process as rank 0
and starts ranks 1.. by running the program again in fresh interpreters: each pays torch's,
Lightning's, transformers' and mcore's imports again (~10 s on a 2-core machine) while rank 0
waits for it in the process group's rendezvous. This launcher keeps that layout but forks
ranks 1.. from the launching process when the Trainer call starts: imports done, the config
parsed and checked, no process group, no rank's model built. A forked rank goes on from there
as a re-run one would (the Trainer call, then the rest of the program) and ends where the
program does (`ending_forked_rank`), with os._exit: it never runs the launching process's exit
handlers (the finalizers of temporary directories that process made, among them).

    launching process = rank 0 ──fork──> rank 1 ... rank n-1   (at trainer.fit, one node)
      holds the checkpoint directories,      each: LOCAL_RANK set, the same Trainer call,
      watches the ranks (Lightning's         exits with the program's code
      process observer), forwards signals

On CPU only: a rank forked on a GPU machine would share the parent's CUDA and Transformer
Engine state, which neither supports. A program that makes a second Trainer call in the same
process is refused (its ranks have ended): it needs the subprocess launcher. So is a call outside
`ending_forked_rank`, whose forked ranks would return into the caller's code.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import traceback
from typing import Any, Callable, Iterator, NoReturn, Optional

from lightning.fabric.strategies.launchers.subprocess_script import _launch_process_observer
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher

_forked_rank: Optional[int] = None  # this process's local rank, in a rank forked by the launcher
_ends_here = 0  # how many `ending_forked_rank` blocks this process is in


def forked_rank() -> Optional[int]:
    """The local rank of this process if ForkedRanksLauncher forked it, else None."""
    return _forked_rank


class ForkedRank:
    """A forked rank as Lightning's process observer and launcher see a subprocess.Popen."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: Optional[int] = None
        self._lock = threading.Lock()  # the observer thread and rank 0's refusal check both poll

    def poll(self) -> Optional[int]:
        with self._lock:
            return self._poll()

    def _poll(self) -> Optional[int]:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped by someone else: its code is lost
                self.returncode = 0
                return self.returncode
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)  # -N: ended by signal N
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, signum)


class ForkedRanksLauncher(_SubprocessScriptLauncher):
    """Lightning's subprocess launcher with ranks 1.. forked instead of re-run (module docstring)."""

    def launch(self, function: Callable, *args: Any, trainer: Optional[Any] = None, **kwargs: Any) -> Any:
        self.cluster_environment.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
        if self.procs:
            raise RuntimeError("this process already made a Trainer call whose ranks it forked (the "
                               "CLI's launcher); a program that makes several needs start_method "
                               "'popen' without the CLI")
        if not self.cluster_environment.creates_processes_externally:
            if not _ends_here:
                raise RuntimeError("ranks forked from this process would run on into its caller: "
                                   "call the Trainer inside `with ending_forked_rank():` around "
                                   "the program's main, as lightning_mcore.cli.main does")
            self._fork_ranks()
            if _forked_rank is None:
                _launch_process_observer(self.procs)
        return function(*args, **kwargs)

    def _fork_ranks(self) -> None:
        """As Lightning's `_call_children_scripts`: the same environment, a fork per rank."""
        global _forked_rank
        self._check_can_spawn_children()
        env = self.cluster_environment
        os.environ.update(MASTER_ADDR=env.main_address, MASTER_PORT=str(env.main_port),
                          NODE_RANK=str(env.node_rank()), LOCAL_RANK=str(env.local_rank()),
                          WORLD_SIZE=str(self.num_processes * self.num_nodes))
        sys.stdout.flush()  # else what the buffers hold is printed once more by every rank
        sys.stderr.flush()
        for local_rank in range(1, self.num_processes):
            pid = os.fork()
            if pid == 0:
                _forked_rank = local_rank
                os.environ["LOCAL_RANK"] = str(local_rank)
                self.procs = []  # its siblings are the launching process's to watch
                return
            self.procs.append(ForkedRank(pid))


@contextlib.contextmanager
def ending_forked_rank() -> Iterator[None]:
    """Around a program's main: a rank forked inside it ends here, with the code the program
    would have exited with, by os._exit; in any other process this does nothing."""
    global _ends_here
    _ends_here += 1
    try:
        yield
    except BaseException as error:  # noqa: BLE001 - re-raised where no rank was forked
        if _forked_rank is None:
            raise
        _end(error)
    else:
        if _forked_rank is not None:
            _end(None)
    finally:
        _ends_here -= 1


def _end(error: Optional[BaseException]) -> NoReturn:
    code = 0
    if isinstance(error, SystemExit):
        if isinstance(error.code, int) or error.code is None:
            code = error.code or 0
        else:
            print(error.code, file=sys.stderr)
            code = 1
    elif isinstance(error, KeyboardInterrupt):
        code = 128 + signal.SIGINT
    elif error is not None:
        traceback.print_exception(error)
        code = 1
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)
