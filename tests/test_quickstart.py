"""The README's main job, through the real console script: 2 CPU processes, TP=2, loss falls."""

import csv
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[1]


def test_quickstart_trains_and_loss_falls(tmp_path):
    cmd = [
        sys.executable, "-m", "lightning_mcore.cli", "fit", "--config", "configs/quickstart.yaml",
        "--trainer.max_steps", "30", "--trainer.val_check_interval", "30",
        "--trainer.log_every_n_steps", "5",
        "--trainer.logger.init_args.save_dir", str(tmp_path),
        "--data.init_args.cache_dir", str(tmp_path / "cache"),
    ]
    # Earlier in-process launches leave MASTER_PORT / LOCAL_RANK / WORLD_SIZE in this process's
    # environment; a child that inherits them believes it was launched by torchrun.
    launch_vars = {"MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "NODE_RANK", "RANK", "WORLD_SIZE",
                   "LOCAL_WORLD_SIZE", "GROUP_RANK", "PL_GLOBAL_SEED", "PL_TRAINER_GPUS"}
    env = {k: v for k, v in os.environ.items() if k not in launch_vars}
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = list(csv.DictReader(open(next(tmp_path.rglob("metrics.csv")))))
    losses = [float(r["train/loss"]) for r in rows if r.get("train/loss")]
    assert len(losses) >= 5
    assert losses[-1] < losses[0] - 1.0, losses
    assert any(r.get("val/loss") for r in rows)
