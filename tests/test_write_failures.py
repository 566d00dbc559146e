"""What a checkpoint write the disk refused says, for the shapes mcore 0.19's save threads and
torch's writers give it (the launched runs in test_worker_errors.py need a tmpfs mount)."""

from __future__ import annotations

import errno
from unittest import mock

from torch.distributed.checkpoint.api import CheckpointException

from lightning_mcore import refusals

THREAD_ERROR = "Worker failure: An error is caught while starting worker 0, error: <class 'OSError'>"


def save_failure(message: str) -> CheckpointException:
    """torch dcp's error as rank 0 sees it: each rank's failure (error, its traceback)."""
    return CheckpointException("save", {0: (RuntimeError(message), None), 1: (RuntimeError("other"), None)})


def test_a_save_thread_error_on_a_full_disk_names_the_disk_full(tmp_path):
    with mock.patch.object(refusals, "_saving", return_value=str(tmp_path / "last.ckpt")), \
            mock.patch.object(refusals, "_free_bytes", return_value=0):
        line = refusals.write_failure(save_failure(THREAD_ERROR))
    assert line.startswith(f"cannot write {tmp_path}/last.ckpt: the disk is full"), line


def test_a_save_thread_error_with_room_left_is_a_failed_write(tmp_path):
    with mock.patch.object(refusals, "_saving", return_value=str(tmp_path / "last.ckpt")), \
            mock.patch.object(refusals, "_free_bytes", return_value=10 * 2**30):
        line = refusals.write_failure(save_failure(THREAD_ERROR))
    assert line.startswith(f"cannot write {tmp_path}/last.ckpt: a write failed") and "full" not in line, line


def test_an_errno_in_the_text_wins(tmp_path):
    error = save_failure(f"Worker failure: [Errno {errno.EROFS}] Read-only file system: '{tmp_path}/x'")
    with mock.patch.object(refusals, "_saving", return_value=str(tmp_path / "last.ckpt")):
        line = refusals.write_failure(error)
    assert line.startswith(f"cannot write {tmp_path}/last.ckpt: Read-only file system"), line


def test_other_errors_are_not_write_failures():
    assert refusals.write_failure(save_failure("Worker failure: shapes differ")) is None
    assert refusals.write_failure(RuntimeError("error: <class 'OSError'> in the middle")) is None
