"""Directories that appear complete or not at all."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import shutil
import uuid
from pathlib import Path

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one step (Linux renameat2 RENAME_EXCHANGE); False where unsupported."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    return renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0


def replace_dir(tmp: Path, final: Path) -> None:
    """Move the finished `tmp` to `final`. An existing `final` is swapped out in one atomic
    step where the OS allows it, so a crash at any moment leaves a complete directory under
    `final` (the old or the new one); elsewhere it is renamed aside first (a window of two
    renames) and removed only after the new one is in place."""
    tmp, final = Path(tmp), Path(final)
    if final.exists() and _exchange(tmp, final):
        shutil.rmtree(tmp, ignore_errors=True)  # now holds the old directory
        return
    old = None
    if final.exists():
        # The old name contains neither "last" nor ".ckpt": never taken for a checkpoint.
        old = final.parent / f".tmp-old-{uuid.uuid4().hex[:8]}"
        os.replace(final, old)
    os.replace(tmp, final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
