"""Faults that strike a run after it has started (tests/test_worker_errors.py)."""

import subprocess

import lightning as L


class RemountReadOnly(L.Callback):
    """When training starts, rank 0 remounts the checkpoint directory (a tmpfs) read-only, as a
    filesystem that meets an error may be (ext4's errors=remount-ro)."""

    def on_train_start(self, trainer, pl_module) -> None:
        if trainer.global_rank == 0:
            subprocess.run(["mount", "-o", "remount,ro", str(trainer.checkpoint_callback.dirpath)], check=True)
