"""Child process of test_checkpoint's SIGKILL test: trains the tiny model with checkpoints every
3 steps and freezes inside a save (writes `<tmp>/frozen`, then sleeps) so that the test can
SIGKILL it right there. argv: tmp dir, point ("writing": step 6's shards not yet written;
"renaming": last.ckpt of step 6 complete in its temporary directory, not yet swapped in)."""

import sys
import time
from pathlib import Path

from megatron.core import dist_checkpointing

from lightning_mcore.strategy import checkpoint_io
from toy import fit_with_checkpoints

tmp, point = Path(sys.argv[1]), sys.argv[2]
calls = {"save": 0, "last": 0}


def freeze() -> None:
    (tmp / "frozen").write_text(point)
    time.sleep(600)


def save(*args, **kwargs):
    calls["save"] += 1  # step 3: step=3.ckpt, last.ckpt; step 6: step=6.ckpt, last.ckpt
    if point == "writing" and calls["save"] == 3:
        freeze()
    return original_save(*args, **kwargs)


def replace_dir(src, final):
    calls["last"] += final.name == "last.ckpt"
    if point == "renaming" and calls["last"] == 2:
        freeze()
    return original_replace(src, final)


original_save, dist_checkpointing.save = dist_checkpointing.save, save
original_replace, checkpoint_io.replace_dir = checkpoint_io.replace_dir, replace_dir
fit_with_checkpoints(tmp, "crash", devices=1, start_method="popen")
