"""Directories that appear complete or not at all."""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path


def replace_dir(tmp: Path, final: Path) -> None:
    """Move the finished `tmp` to `final`; an existing `final` is removed only afterwards, so a
    crash at any point leaves either the old or the new directory complete under `final`."""
    old = None
    if final.exists():
        # The old name contains neither "last" nor ".ckpt": never taken for a checkpoint.
        old = final.parent / f".tmp-old-{uuid.uuid4().hex[:8]}"
        os.replace(final, old)
    os.replace(tmp, final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
