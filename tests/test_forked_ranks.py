"""Ranks the CLI forks from its own process on CPU (strategy/forked_ranks.py): a forked rank goes
on as a re-run one would and ends where the program ends, with the program's exit code, never
through the launching process's exit handlers; the CLI's run trains as with re-run ranks."""

from __future__ import annotations

import atexit
import os
import re
import signal
import time
from pathlib import Path
from unittest import mock

import pytest
import torch
from lightning.fabric.plugins.environments import LightningEnvironment
from torch.distributed.checkpoint import FileSystemReader

from lightning_mcore.strategy import forked_ranks
from lightning_mcore.strategy.forked_ranks import ForkedRank, ForkedRanksLauncher, ending_forked_rank
from test_bad_inputs import launch, write_config


def wait(rank: ForkedRank, timeout: float = 60) -> int:
    deadline = time.monotonic() + timeout
    while rank.poll() is None:
        assert time.monotonic() < deadline, "the forked rank did not end"
        time.sleep(0.02)
    return rank.returncode


def in_forked_rank(body) -> ForkedRank:
    """`body` in a child forked as the launcher forks a rank, inside the program's
    `ending_forked_rank`."""
    pid = os.fork()
    if pid == 0:
        forked_ranks._forked_rank = 1
        with ending_forked_rank():
            body()
        os._exit(99)  # not reached: the rank ends in ending_forked_rank
    return ForkedRank(pid)


def refuse():
    raise SystemExit(3)


def say_and_stop():
    raise SystemExit("stopped: a message")


def fail():
    raise ZeroDivisionError("a bug")


@pytest.mark.parametrize("body, code, printed", [
    (lambda: None, 0, None),
    (refuse, 3, None),
    (say_and_stop, 1, "stopped: a message"),
    (fail, 1, "ZeroDivisionError: a bug"),
])
def test_a_forked_rank_ends_with_the_exit_code_of_the_program(capfd, body, code, printed):
    """As Python ends a program: SystemExit's code (a message printed, code 1), a traceback
    and 1 for an error, 0 at the end."""
    assert wait(in_forked_rank(body)) == code
    err = capfd.readouterr().err
    assert (printed in err) if printed else "Traceback" not in err, err
    if body is fail:
        assert "Traceback (most recent call last)" in err


def test_a_forked_rank_runs_none_of_the_launching_process_exit_handlers(tmp_path):
    """The launching process's exit handlers (a temporary directory's finalizer among them) are
    its own: the forked rank ends without running them."""
    marker = tmp_path / "ran"

    def handler():
        marker.write_text(str(os.getpid()))

    atexit.register(handler)
    try:
        assert wait(in_forked_rank(lambda: None)) == 0
    finally:
        atexit.unregister(handler)
    assert not marker.exists()


def test_outside_a_forked_rank_the_program_ends_as_it_would():
    with pytest.raises(SystemExit) as stop, ending_forked_rank():
        raise SystemExit(2)
    assert stop.value.code == 2
    with ending_forked_rank():
        pass  # no exit here


def test_a_rank_ended_by_a_signal_reports_it_as_popen_does():
    rank = in_forked_rank(lambda: time.sleep(60))
    rank.send_signal(signal.SIGTERM)
    assert wait(rank) == -signal.SIGTERM
    rank.send_signal(signal.SIGTERM)  # ended: nothing is sent (its pid may be another's by now)


def test_the_launcher_forks_the_other_ranks_which_go_on_as_a_re_run_program(tmp_path):
    """Rank 1 is forked when the Trainer call starts, with LOCAL_RANK=1 and the launch's
    environment; it runs the call, then the rest of the program, and ends there. A second call
    is refused: its ranks have ended."""
    launcher = ForkedRanksLauncher(LightningEnvironment(), num_processes=2, num_nodes=1)

    def call(tag):
        (tmp_path / f"{tag}-{os.environ['LOCAL_RANK']}").write_text(f"{os.getpid()} {os.environ['WORLD_SIZE']}")
        return tag

    with mock.patch.dict(os.environ), ending_forked_rank():
        os.environ.pop("LOCAL_RANK", None)
        assert launcher.launch(call, "fit") == "fit"
        (tmp_path / f"after-{os.environ['LOCAL_RANK']}").write_text(str(os.getpid()))
    assert forked_ranks.forked_rank() is None  # the launching process
    (rank,) = launcher.procs
    assert wait(rank) == 0
    assert (tmp_path / "fit-0").read_text() == f"{os.getpid()} 2"
    assert (tmp_path / "fit-1").read_text() == f"{rank.pid} 2"
    assert (tmp_path / "after-1").read_text() == str(rank.pid)
    with pytest.raises(RuntimeError, match="already made a Trainer call"):
        launcher.launch(call, "test")


def test_the_launcher_refuses_to_fork_ranks_that_would_run_on_into_the_caller():
    launcher = ForkedRanksLauncher(LightningEnvironment(), num_processes=2, num_nodes=1)
    with mock.patch.dict(os.environ), pytest.raises(RuntimeError, match="ending_forked_rank"):
        os.environ.pop("LOCAL_RANK", None)
        launcher.launch(lambda: None)
    assert launcher.procs == []


def shards(checkpoint: Path) -> dict:
    """Every tensor of a distributed checkpoint's weights."""
    reader = FileSystemReader(str(checkpoint / "weights"))
    metadata = reader.read_metadata()
    names = [k for k, v in metadata.state_dict_metadata.items() if hasattr(v, "size")]
    state = {k: torch.empty(metadata.state_dict_metadata[k].size,
                            dtype=metadata.state_dict_metadata[k].properties.dtype) for k in names}
    torch.distributed.checkpoint.load(state, storage_reader=reader, no_dist=True)
    return state


@pytest.mark.distributed
def test_the_cli_forks_rank_one_on_cpu_and_trains_as_with_a_re_run_one(tmp_path):
    """The CLI's default on CPU (rank 1 forked: the command's start, seeding included, is not
    run again) trains to the weights of the popen run (rank 1 re-runs the command), bit for bit."""
    runs = {}
    for start in (None, "popen"):
        directory = tmp_path / str(start)
        directory.mkdir()
        result = launch(write_config(directory), start=start)
        assert result.returncode == 0, result.stderr[-3000:]
        runs[start] = (directory / "run" / "last.ckpt", result.stderr)
    assert len(re.findall(r"Seed set to", runs[None][1])) == 1, runs[None][1][-3000:]
    assert len(re.findall(r"Seed set to", runs["popen"][1])) == 2  # "[rank: 1] Seed set to ..."
    forked, popen = shards(runs[None][0]), shards(runs["popen"][0])
    assert forked.keys() == popen.keys() and len(forked) > 4
    for name in forked:
        assert torch.equal(forked[name], popen[name]), name
