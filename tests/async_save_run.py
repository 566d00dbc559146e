"""Child process of test_checkpoint_faults: 6 steps of the tiny model on 2 ranks (DP=2) with async saves every step (save_top_k=1, last.ckpt)
under `<tmp>/fast` and every 3 steps under `<tmp>/run-ckpts`, the writer slowed so that saves
come faster than it writes. argv: tmp dir, mode:
  "slow"              finish normally (or be signalled by the test);
  "freeze-writing"    the writer of run-ckpts/epoch=0-step=6.ckpt freezes mid-write (`<tmp>/frozen`
                      appears) once fast/last.ckpt of step 5 is published, so that the saves
                      before it are all in place whenever the test kills the run;
  "freeze-publishing" the 2nd publication of fast/last.ckpt freezes before its rename, its
                      shards and metadata complete in the temporary directory;
  "slurm"             one rank (a single SLURM task: the test sets SLURM's environment).
START_METHOD in the environment: how the ranks start, "popen" (default: the signal tests are
about the ranks the CLI starts, on GPU), "cli" (rank 1 forked from this process, as the CLI
starts it on CPU: the tests of what a kill leaves on disk) or "fork" (Lightning's: both ranks
forked, this process runs none).
Each writer call appends a line to `<tmp>/writes` before it writes (one per save: at DP=2 every
tensor is replicated and rank 0 writes it)."""

import os
import sys
import time
from pathlib import Path

from lightning.pytorch.callbacks import ModelCheckpoint
from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

from lightning_mcore.strategy import checkpoint_io
from lightning_mcore.strategy.checkpoint_io import CheckpointOptions
from lightning_mcore.strategy.forked_ranks import ending_forked_rank
from toy import fit_with_checkpoints

DELAY_S = 0.5
tmp, mode = Path(sys.argv[1]), sys.argv[2]


def freeze() -> None:
    (tmp / "frozen").write_text(mode)
    time.sleep(600)


def lines(name: str) -> int:
    return len((tmp / name).read_text().splitlines()) if (tmp / name).exists() else 0


def writing(buckets, directory: str, name: str) -> bool:
    """Whether the writer's buckets go to the temporary directory of `directory/name`."""
    prefix = checkpoint_io.temporary_prefix(name)
    return any(Path(f).parents[2] == tmp / directory and Path(f).parents[1].name.startswith(prefix)
               for f, *_ in buckets)  # <directory>/.tmp-<digest>-<uuid>/weights/<shard>


def slow_writer(*args, **kwargs):
    write_buckets = kwargs.get("write_buckets", args[3] if len(args) > 3 else [])
    with open(tmp / "writes", "a") as log:
        log.write("write\n")
    if mode == "freeze-writing" and writing(write_buckets, "run-ckpts", "epoch=0-step=6.ckpt"):
        deadline = time.monotonic() + 300
        while lines("publications") < 5 and time.monotonic() < deadline:
            time.sleep(0.05)
        freeze()
    time.sleep(DELAY_S)
    return original_writer(*args, **kwargs)


def replace_dir(src, final):
    if final.name == "last.ckpt" and final.parent.name == "fast":
        with open(tmp / "publications", "a") as log:
            log.write("last\n")
        if mode == "freeze-publishing" and lines("publications") == 2:
            freeze()
    return original_replace(src, final)


original_writer = FileSystemWriterAsync.write_preloaded_data_multithread
FileSystemWriterAsync.write_preloaded_data_multithread = staticmethod(slow_writer)
original_replace, checkpoint_io.replace_dir = checkpoint_io.replace_dir, replace_dir
fast = ModelCheckpoint(dirpath=tmp / "fast", every_n_train_steps=1, save_top_k=1, save_last=True)
start = os.environ.get("START_METHOD", "popen")
with ending_forked_rank():
    fit_with_checkpoints(tmp, "run", devices=1 if mode == "slurm" else 2,
                         start_method=None if start == "cli" else start, fork_ranks=start == "cli",
                         tensor_model_parallel_size=1, checkpoint=CheckpointOptions(async_save=True),
                         callbacks=(fast,))
