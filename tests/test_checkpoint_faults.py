"""Acceptance (issue 43, items 2 and 4): async saves faster than their writer, kills at each
stage of a save, and stop signals never publish half a checkpoint, never hang, and end a
stopped run with a non-zero exit code.

A checkpoint counts as complete when torch's own dcp metadata lists shards that are all there
at full length, and both ranks' RNG files and common.pt are in place; the newest one must
also resume.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import forked_process
from forked_process import ForkedProcess, script
from lightning_mcore.strategy.safe_files import load_plain, read_dcp_metadata
from toy import fit_with_checkpoints

HERE = Path(__file__).parent
pytestmark = pytest.mark.distributed


_STARTED: list = []


@pytest.fixture(autouse=True)
def _no_run_outlives_its_test():
    """A failed test's run (a hang is the failure some of these look for) is killed with its
    forked ranks and writers."""
    yield
    while _STARTED:
        child = _STARTED.pop()
        if child.poll() is None or not group_gone(child.pid, timeout=0):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGKILL)
            child.communicate()


def start(tmp: Path, mode: str, **env) -> subprocess.Popen | ForkedProcess:
    """async_save_run.py in a session of its own: forked from this process (forked_process.py), or
    a fresh interpreter where rank 1 re-runs it (START_METHOD popen, the default, on 2 ranks)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", **env}
    argv = [str(HERE / "async_save_run.py"), str(tmp), mode]
    if env.get("START_METHOD", "popen") == "popen" and mode != "slurm":
        child = subprocess.Popen([sys.executable, *argv], env=env, cwd=tmp, start_new_session=True,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    else:
        child = ForkedProcess(script(argv[0]), argv, cwd=tmp, env=env, start_new_session=True)
    _STARTED.append(child)
    return child


def wait_for(child: subprocess.Popen, ready, what: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        assert child.poll() is None, f"the run ended before {what}: {child.communicate()[1][-3000:]}"
        assert time.monotonic() < deadline, f"no {what} within {timeout} s"
        time.sleep(0.05)


def writes(tmp: Path) -> int:
    return len((tmp / "writes").read_text().splitlines()) if (tmp / "writes").exists() else 0


def group_gone(pgid: int, timeout: float = 60) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.2)


def complete_step(ckpt: Path, ranks: int = 2) -> int:
    """The global step of a complete checkpoint; fails on a partial one."""
    step = load_plain(ckpt / "common.pt")["global_step"]
    metadata = read_dcp_metadata(ckpt / "weights" / ".metadata")
    for info in metadata.storage_data.values():
        shard = ckpt / "weights" / info.relative_path
        assert shard.is_file() and shard.stat().st_size >= info.offset + info.length, (ckpt, info)
    assert all((ckpt / f"rng_{rank}.pt").is_file() for rank in range(ranks)), ckpt
    return step


def published(tmp: Path) -> dict[Path, int]:
    """Every checkpoint under its final name, with its step; all must be complete."""
    return {ckpt: complete_step(ckpt) for d in ("fast", "run-ckpts") if (tmp / d).is_dir()
            for ckpt in sorted((tmp / d).glob("*.ckpt"))}


def resumes(tmp: Path, ckpt: Path, step: int) -> None:
    """The checkpoint (saved at DP=2) resumes in this process, at DP=1, to the run's end."""
    losses = fit_with_checkpoints(tmp, "resumed", devices=1, ckpt_path=str(ckpt))
    assert len(losses) == 6 - step


def test_saves_faster_than_the_writer(tmp_path):
    """Each step saves step=N.ckpt (the previous one removed, maybe still being written) and
    last.ckpt (again, while the last one is written): the run finishes, only the newest
    checkpoints remain and all are complete; no temporary directory is left."""
    child = start(tmp_path, "slow", START_METHOD="cli")  # rank 1 forked: the launcher is not the subject
    out, err = child.communicate(timeout=600)
    assert child.returncode == 0, err[-3000:]
    ckpts = published(tmp_path)
    names = sorted(str(p.relative_to(tmp_path)) for p in ckpts)
    assert names == ["fast/epoch=0-step=6.ckpt", "fast/last.ckpt", "run-ckpts/epoch=0-step=3.ckpt",
                     "run-ckpts/epoch=0-step=6.ckpt", "run-ckpts/last.ckpt"], names
    assert ckpts[tmp_path / "fast" / "last.ckpt"] == 6
    assert not list(tmp_path.glob("*/.tmp-*"))


@pytest.mark.parametrize("mode", ["freeze-writing", "freeze-publishing"])
def test_kill_during_an_async_save(tmp_path, mode):
    """SIGKILL while a save is written, or after it is written and before it is renamed:
    every checkpoint in place is complete and the newest resumes."""
    child = start(tmp_path, mode, START_METHOD="cli")  # the kill takes the whole process group
    wait_for(child, (tmp_path / "frozen").exists, "the frozen save")
    os.killpg(child.pid, signal.SIGKILL)
    child.communicate()
    assert group_gone(child.pid)
    ckpts = published(tmp_path)
    assert tmp_path / "fast" / "last.ckpt" in ckpts
    newest = max(ckpts, key=lambda p: (ckpts[p], p.name == "last.ckpt"))
    assert ckpts[tmp_path / "fast" / "last.ckpt"] == ckpts[newest]
    resumes(tmp_path, tmp_path / "fast" / "last.ckpt", ckpts[newest])


@pytest.mark.parametrize("target", ["group", "rank 0"])
def test_sigterm_during_an_async_save(tmp_path, target):
    """A scheduler's SIGTERM to every process (or to rank 0 alone) while saves are written: the
    run finishes them, publishes them, and exits 143; no process is left; last.ckpt is the
    newest complete checkpoint. Rank 1 re-runs the program (popen, the launcher on GPU) for the
    group; for rank 0 alone it is forked as the CLI forks it on CPU, and rank 0 forwards the
    signal to it."""
    child = start(tmp_path, "slow", START_METHOD="popen" if target == "group" else "cli")
    wait_for(child, lambda: writes(tmp_path) >= 6, "the third save")
    (os.killpg if target == "group" else os.kill)(child.pid, signal.SIGTERM)
    _, err = child.communicate(timeout=240)
    assert child.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert "stopped by SIGTERM" in err
    assert group_gone(child.pid), "processes of the run are still alive"
    ckpts = published(tmp_path)
    fast = {p: s for p, s in ckpts.items() if p.parent.name == "fast"}
    assert fast[tmp_path / "fast" / "last.ckpt"] == max(fast.values()) < 6
    assert not list(tmp_path.glob("*/.tmp-*")), "a save in flight was left unfinished"


def test_slurm_requeue_signal(tmp_path):
    """SLURM's requeue signal (SIGUSR1) mid-run, one SLURM task: hpc_ckpt_1.ckpt is saved in the
    run's root directory (where Lightning looks when the job starts again) and the job is
    requeued with `scontrol requeue JOB` (a stand-in scontrol records its arguments); the run
    goes on to its end."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(f"#!/bin/sh\necho \"$@\" >> {tmp_path / 'scontrol.log'}\n")
    (bin_dir / "scontrol").chmod(0o755)
    slurm = dict(SLURM_NTASKS="1", SLURM_NTASKS_PER_NODE="1", SLURM_NNODES="1", SLURM_NODEID="0",
                 SLURM_PROCID="0", SLURM_LOCALID="0", SLURM_JOB_ID="4242", SLURM_JOB_NAME="train.sbatch",
                 SLURM_NODELIST="localhost", PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    child = start(tmp_path, "slurm", **slurm)
    wait_for(child, lambda: writes(tmp_path) >= 2, "the second save")
    child.send_signal(signal.SIGUSR1)
    _, err = child.communicate(timeout=300)
    assert child.returncode == 0, err[-3000:]
    assert (tmp_path / "scontrol.log").read_text().split() == ["requeue", "4242"]
    step = complete_step(tmp_path / "hpc_ckpt_1.ckpt", ranks=1)
    assert 1 <= step < 6


def forked(body) -> tuple[int, str]:
    """`body()` in a process forked from this one (nothing to import again): its exit code
    (SystemExit's, 1 for an error, 0 if it returns) and what it wrote to stderr."""
    result = forked_process.run(body, [body.__name__])
    return result.returncode, result.stderr


def test_a_stopped_run_leaves_no_deadline_behind(monkeypatch):
    """After a run stopped on a signal, the process may go on (a notebook, a script after fit):
    the deadline that ends a rank stuck after a signal goes with the run's handlers."""
    from lightning_mcore.strategy import signals

    def run() -> None:
        monkeypatch.setattr(signals, "GRACE_S", 0.2)
        watch = signals.SignalWatch()
        watch.install(None, None)
        os.kill(os.getpid(), signal.SIGTERM)
        assert watch.agreed() == (signal.SIGTERM, False)
        watch.uninstall()
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
        time.sleep(1.0)

    code, err = forked(run)
    assert code == 0, err[-2000:]


def test_a_rank_that_never_reaches_a_step_boundary_ends_itself(monkeypatch):
    """After a stop signal, a rank stuck where it cannot learn of it (a collective whose peer is
    gone: here a sleep) ends itself with the signal's exit code once the deadline passes."""
    from lightning_mcore.strategy import signals

    def run() -> None:
        monkeypatch.setattr(signals, "GRACE_S", 0.3)
        signals.SignalWatch().install(None, None)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)

    code, err = forked(run)
    assert code == 128 + signal.SIGTERM, err[-2000:]
    assert err.strip().splitlines()[-1].startswith("error: stopped by SIGTERM, but this rank did "
                                                   "not reach a step boundary within 0.3 s")
