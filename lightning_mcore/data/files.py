"""Which data files a path or glob names, and which `datasets` builder reads each (by suffix):
shared by preprocessing and by the cheap first-record checks of data/peek.py."""

from __future__ import annotations

import glob
import os
from typing import Sequence, Union

BUILDERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}


def resolve_files(paths: Union[str, Sequence[str]]) -> list[str]:
    """Expand files and globs in order; fail on a path that matches nothing or an unknown type."""
    files: list[str] = []
    for path in [paths] if isinstance(paths, str) else list(paths):
        matches = sorted(glob.glob(os.path.expanduser(path), recursive=True))
        matches = [m for m in matches if os.path.isfile(m)]
        if not matches:
            raise FileNotFoundError(f"no file matches {path!r}{relative_to(path)}")
        for match in matches:
            if os.path.splitext(match)[1].lower() not in BUILDERS:
                raise ValueError(
                    f"unsupported file type {match!r}: use one of {', '.join(sorted(BUILDERS))}"
                )
            if match not in files:
                files.append(match)
    return files


def relative_to(path: str) -> str:
    """For an error about a relative path: the working directory it was looked for in."""
    return "" if os.path.isabs(os.path.expanduser(path)) else f" (relative to the working directory {os.getcwd()})"
