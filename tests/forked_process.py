"""A command run in a process forked from the test's instead of a fresh interpreter: the same exit
code, stdout and stderr as `python -m lightning_mcore.cli ...` or `python script.py`, without its
~11 s of imports (torch, Lightning, mcore, transformers) on the 2-core CI machine.

For tests of what a command does and reports, not of how a process starts: those keep a fresh
interpreter (the README's own commands, torchrun, srun, and ranks that re-run the command,
`start_method: popen`, since they re-run what a fresh interpreter was given).

The child is made to look like a fresh process before the command runs:
- stdin from /dev/null, stdout and stderr to files (fds 1 and 2 and Python's streams; not pytest's
  capture), and log handlers that a fresh import would have pointed at stderr;
- the given environment and working directory, its own argv;
- signals at their defaults (pytest's faulthandler off), and a session of its own if asked;
- none of the test process's exit handlers: they are dropped, and only those the command
  registers run when it ends (as when an interpreter exits), then `os._exit` with its code.
Warnings: the callers set PYTHONWARNINGS=ignore, applied here as a filter (pytest records warnings
in its own list, which a fresh interpreter would print).
"""

from __future__ import annotations

import atexit
import faulthandler
import logging
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
import weakref
from pathlib import Path
from typing import Callable, Optional, Union

CLI = Path(__file__).parents[1] / "lightning_mcore" / "cli.py"


def cli_command() -> None:
    """What `python -m lightning_mcore.cli ...` runs, the imports already done."""
    from lightning_mcore.cli import command

    command()


def script(path: Union[str, Path]) -> Callable[[], None]:
    """What `python path ...` runs."""
    return lambda: runpy.run_path(str(path), run_name="__main__")


class ForkedProcess:
    """`body()` in a forked child, with subprocess.Popen's poll, wait, communicate, returncode,
    pid, send_signal and kill (text output, read once the child has ended)."""

    def __init__(self, body: Callable[[], None], argv: list[str], cwd: Union[str, Path, None] = None,
                 env: Optional[dict] = None, start_new_session: bool = False) -> None:
        self.args, self.returncode = argv, None
        self._out, self._err = tempfile.TemporaryFile(), tempfile.TemporaryFile()
        self.pid = os.fork()
        if self.pid == 0:  # the child never returns into pytest
            code = 1
            try:
                code = _child(body, argv, cwd, env, start_new_session, self._out.fileno(), self._err.fileno())
            finally:
                os._exit(code)

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.05)
        return self.returncode

    def communicate(self, timeout: Optional[float] = None) -> tuple[str, str]:
        self.wait(timeout)
        return _read(self._out), _read(self._err)

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def run(body: Callable[[], None], argv: list[str], cwd: Union[str, Path, None] = None,
        env: Optional[dict] = None, timeout: Optional[float] = None) -> subprocess.CompletedProcess:
    """subprocess.run(argv, capture_output=True, text=True) for a forked `body`."""
    child = ForkedProcess(body, argv, cwd, env)
    try:
        out, err = child.communicate(timeout)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()
        raise
    return subprocess.CompletedProcess(argv, child.returncode, out, err)


def _read(file) -> str:
    file.seek(0)
    return file.read().decode(errors="replace")


def _child(body, argv, cwd, env, new_session: bool, out_fd: int, err_fd: int) -> int:
    try:
        _as_a_fresh_process(argv, cwd, env, new_session, out_fd, err_fd)
    except BaseException:  # noqa: BLE001 - a fault of this module: told on the command's stderr
        os.write(err_fd, traceback.format_exc().encode())
        return 1
    code = 1
    try:
        body()
        code = 0
    except SystemExit as stop:
        code = _exit_code(stop.code)
    except BaseException:  # noqa: BLE001 - reported as an interpreter reports it
        traceback.print_exc()
    atexit._run_exitfuncs()  # the command's own exit handlers (the test process's were dropped)
    weakref.finalize._exitfunc()  # each handler's error is printed there, not raised
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed stream: nothing left to write
            pass
    return code


def _exit_code(code) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _as_a_fresh_process(argv, cwd, env, new_session: bool, out_fd: int, err_fd: int) -> None:
    if new_session:
        os.setsid()
    faulthandler.disable()
    for signum in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(signum, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    atexit._clear()
    for finalizer in list(weakref.finalize._registry):  # the test process's temporary dirs and such
        weakref.finalize._registry[finalizer].atexit = False
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(out_fd, 1)
    os.dup2(err_fd, 2)
    old = [sys.stdout, sys.__stdout__, sys.stderr, sys.__stderr__]
    sys.stdin = sys.__stdin__ = open(0, closefd=False)
    sys.stdout = sys.__stdout__ = open(1, "w", closefd=False)
    sys.stderr = sys.__stderr__ = open(2, "w", buffering=1, closefd=False)
    _fresh_logging({id(s): new for s, new in zip(old, [sys.stdout] * 2 + [sys.stderr] * 2) if s is not None})
    if env is not None:
        os.environ.clear()
        os.environ.update(env)
    if "ignore" in os.environ.get("PYTHONWARNINGS", "").split(","):
        warnings.simplefilter("ignore")
    if cwd is not None:
        os.chdir(cwd)
    sys.argv = list(argv)


def _fresh_logging(replaced: dict) -> None:
    """pytest's capture handlers gone; handlers that wrote to the old stdout/stderr (or pytest's
    stand-ins for them) write to the new ones; Lightning's logger as its import sets it up when
    the root logger has no handler (pytest's had one when Lightning was imported here)."""
    loggers = [logging.root, *(v for v in logging.root.manager.loggerDict.values() if isinstance(v, logging.Logger))]
    for logger in loggers:
        for handler in list(logger.handlers):
            if type(handler).__module__.startswith("_pytest"):
                logger.removeHandler(handler)
            elif type(handler) is logging.StreamHandler and (
                    id(handler.stream) in replaced or type(handler.stream).__module__.startswith("_pytest")):
                handler.stream = replaced.get(id(handler.stream), sys.stderr)  # the old one may be closed
    for name in ("lightning.pytorch", "lightning.fabric"):
        logger = logging.getLogger(name)
        if not logger.handlers:
            logger.addHandler(logging.StreamHandler())
            logger.propagate = False
