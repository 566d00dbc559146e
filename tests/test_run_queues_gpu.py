"""benchmarks/run_queues_gpu.sh, a session's GPU queues, dry-run on CPU: every stage of every queue of
each plan exists, and every command it would run parses with its script's own argument parser (a typo
found here costs nothing; found on the device it costs the session's GPU time)."""

import os
import subprocess

from unittest import mock

import pytest
from test_run_issue47_gpu import PARSERS, ROOT


def planned(plan: str, queue: str, tmp_path) -> list[tuple[str, list[str]]]:
    """(script, arguments) of each command the queue would run."""
    listing = tmp_path / f"{plan}_{queue}.txt"
    env = {**os.environ, "DRY_RUN": str(listing), "PLAN": plan, "Q": str(tmp_path), "OUT": str(tmp_path)}
    done = subprocess.run(["bash", "benchmarks/run_queues_gpu.sh", "queue", queue], cwd=ROOT, env=env,
                          capture_output=True, text=True)
    assert done.returncode == 0 and "unknown" not in done.stdout + done.stderr, done.stdout + done.stderr
    assert (tmp_path / f"{queue}.done").exists()
    commands = []
    for line in listing.read_text().splitlines():
        words = line.split()[1:]  # after the GPU count (run_issue47_gpu.sh) or list (run_issue49_gpu.sh)
        if not line[:1].isdigit():
            continue  # the second line of run_issue49_gpu.sh's python -c (the GPU test)
        if words[:2] == ["python", "-c"]:
            assert "test_gpu_" in line
            continue
        while words[0] in ("python", "torchrun", "--standalone", "--nproc-per-node") or words[0].isdigit():
            words = words[1:]  # run_issue49_gpu.sh's launcher
        commands.append((os.path.basename(words[0]), words[1:]))
    return commands


@pytest.mark.parametrize("plan, queues", [("s29", ["q0", "q12", "q3"]), ("s30", ["q01", "q23"]), ("s30b", ["qa", "qb"]),
                                          ("s31", ["q01", "q23", "q4"]), ("s31b", ["q01", "q4"])])
def test_every_queued_command_parses(plan, queues, tmp_path):
    for queue in queues:
        (tmp_path / queue).mkdir()
        commands = planned(plan, queue, tmp_path / queue)
        assert commands, queue
        for script, argv in commands:
            if script in PARSERS:
                with mock.patch.dict(os.environ, {"WORLD_SIZE": "1"}):
                    PARSERS[script](argv)  # an argparse error exits 2: the test fails
            else:
                assert script == "dequant_speed.py", script
