"""benchmarks/run_issue50_gpu.sh, dry-run on CPU: every command parses with bench_pretrain.py's own
argument parser and runs the layout issue 50 asks of a 4-GPU machine: Qwen3-30B-A3B at half depth at
TP=2 + SP x EP=2 and PP=2 x EP=2, Llama-3-8B at TP=2 x PP=2, full fine-tuning on real text with every
step's loss, each layout dividing the 4 GPUs."""

import os
import subprocess
import sys
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import bench_pretrain  # noqa: E402


def dry_run(stage: str, tmp_path: Path) -> list:
    listing = tmp_path / f"{stage}.txt"
    env = {**os.environ, "DRY_RUN": str(listing), "OUT": str(tmp_path)}
    done = subprocess.run(["bash", "benchmarks/run_issue50_gpu.sh", stage], cwd=ROOT, env=env,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    parsed = []
    for line in listing.read_text().splitlines():
        n, script, *argv = line.split()
        assert (n, script) == ("4", "bench_pretrain.py"), line
        with mock.patch.dict(os.environ, {"WORLD_SIZE": n}):
            parsed.append(bench_pretrain.parse_args(argv))
    return parsed


def test_layouts_are_issue_50s_at_half_size(tmp_path):
    moe = dry_run("moe30b", tmp_path)
    assert [(a.tp, a.pp, a.ep, a.no_sp) for a in moe] == [(2, 1, 2, False), (1, 2, 2, False)]
    for a in moe:
        assert (a.shape, a.layers, a.experts, a.recompute) == ("qwen3-30b-a3b", 24, "torch", "full")
    (dense,) = dry_run("dense8b", tmp_path)
    assert (dense.shape, dense.layers, dense.tp, dense.pp, dense.ep) == ("llama-8b", None, 2, 2, 1)
    for a in moe + [dense]:
        assert a.impl == "lightning" and a.losses and a.data == "/tmp/text" and a.seq == 4096
        assert a.gbs % (4 // (a.tp * a.pp)) == 0 and a.steps > a.warmup
