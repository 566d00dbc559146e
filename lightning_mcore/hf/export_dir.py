"""Where an export may land: never over something this library did not write.

An export directory carries MARKER, a small JSON note of what wrote it and the files it wrote.
An existing target is used only when it is empty, or replaced when the caller asks for
`overwrite` *and* it carries the marker *and* it holds nothing the export did not write (a
user's notes or evaluation results added later would go with it: the first such file is named
instead). A marker from before the file list was kept (no "files") vouches only for the names
an export writes: config, weights and their index, tokenizer, processor and adapter files,
with no subdirectory. A file, a directory of someone else's files, or a directory holding (or
held by) the checkpoint or HF model being exported from is refused, with or without `overwrite`.

The directory is written under a temporary sibling name and renamed into place when complete
(atomic.replace_dir); a failure removes the temporary directory, which holds only what this
export wrote.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import uuid
from pathlib import Path
from typing import Iterable, Iterator, Optional

import torch.distributed as dist

from lightning_mcore.atomic import replace_dir

MARKER = "lightning_mcore_export.json"
# The tokenizer files an export copies beside the weights.
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
    "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json",
)
# A multimodal model's processor (image/video preprocessing) travels with it too.
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json")


class ExportTargetError(ValueError):
    """The export's output path holds something that must not be replaced."""


def target_problem(output, overwrite: bool = False, protected: Iterable = ()) -> Optional[str]:
    """Why `output` may not be written (a sentence naming it and the fix), or None."""
    out = Path(output).expanduser().resolve()  # ".", "..", symlinks: the real directory
    for keep in protected:
        if keep is None:
            continue
        keep = Path(keep).expanduser().resolve()
        if out == keep or keep in out.parents or out in keep.parents:
            relation = "is" if out == keep else "is inside" if keep in out.parents else "contains"
            return (f"output {output} {relation} {keep}, which this export reads from; "
                    f"choose an output directory outside it.")
    cwd = Path.cwd().resolve()
    if out == cwd or out in cwd.parents:
        return (f"output {output} is the current directory or holds it, and an export replaces "
                f"its output as a whole; choose a subdirectory (e.g. {Path(output) / 'hf'}).")
    if not out.exists():
        return None
    if not out.is_dir():
        return f"output {output} exists and is not a directory; choose another output path."
    if not any(out.iterdir()):
        return None
    if not overwrite:
        return (f"output {output} exists and is not empty; choose a new directory, or pass "
                f"overwrite (--overwrite) to replace an earlier lightning-mcore export.")
    if not (out / MARKER).is_file():
        return (f"output {output} is not a lightning-mcore export (it has no {MARKER}), so it is "
                f"never replaced, even with overwrite; choose another output directory.")
    foreign = first_foreign(out)
    if foreign is not None:
        return (f"output {output} holds {Path(output) / foreign}, which the earlier export did not "
                f"write, and overwrite replaces the directory as a whole; move it (and anything else "
                f"of yours) out of {output}, or choose another output directory.")
    return None


# The names an export writes (hf/export.py, hf/peft_export.py), besides tokenizer and processor
# files: all that a marker without a file list vouches for.
_EXPORT_NAME = re.compile(r"(config|generation_config|adapter_config)\.json|model\.safetensors"
                          r"|model-\d{5}-of-\d{5}\.safetensors|model\.safetensors\.index\.json"
                          r"|adapter_model\.safetensors")


def first_foreign(directory: Path) -> Optional[str]:
    """The first path under `directory` (relative, sorted; files before directories)
    that the export its MARKER describes did not write; None when there is none."""
    listed = _listed_files(directory)
    if listed is None:
        known = {*TOKENIZER_FILES, *PROCESSOR_FILES}
        listed = {p.name for p in directory.iterdir() if p.name in known or _EXPORT_NAME.fullmatch(p.name)}
    parents = {parent.as_posix() for name in listed for parent in Path(name).parents}
    paths = sorted(p.relative_to(directory).as_posix() for p in directory.rglob("*"))
    files = [p for p in paths if not (directory / p).is_dir() and p not in listed and p != MARKER]
    dirs = [p for p in paths if (directory / p).is_dir() and p not in parents]
    return (files or dirs or [None])[0]


def _listed_files(directory: Path) -> Optional[set]:
    """The files MARKER says the export wrote; None for a marker without a readable list."""
    try:
        files = json.loads((directory / MARKER).read_text()).get("files")
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(files, list) or not all(isinstance(f, str) for f in files):
        return None
    return set(files)


def check_target(output, overwrite: bool = False, protected: Iterable = ()) -> Path:
    """The absolute output path, or ExportTargetError. Collective inside a distributed run:
    global rank 0 looks (it is the rank that writes) and every rank gets its verdict."""
    check_targets([output], overwrite, protected)
    return Path(output).expanduser().resolve()


def check_targets(outputs: Iterable, overwrite: bool = False, protected: Iterable = ()) -> None:
    """ExportTargetError for the first of `outputs` that may not be written; one collective
    (a broadcast from global rank 0) for all of them."""
    protected = list(protected)
    problem = next((p for p in (target_problem(o, overwrite, protected) for o in outputs) if p), None)
    if dist.is_initialized() and dist.get_world_size() > 1:
        verdict = [problem]
        dist.broadcast_object_list(verdict, src=0)
        problem = verdict[0]
    if problem:
        raise ExportTargetError(problem)


@contextlib.contextmanager
def staged_dir(output: Path, note: dict) -> Iterator[Path]:
    """A fresh temporary sibling of `output` to write into. On success MARKER (with `note` and
    the list of files written, which a later overwrite checks) is added, files are made
    world-readable, and the directory replaces `output`; on any error it is removed. Call
    `check_target` first."""
    output = Path(output)
    tmp = output.parent / f".{output.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir(parents=True)
    try:
        yield tmp
        files = sorted(p.relative_to(tmp).as_posix() for p in tmp.rglob("*") if not p.is_dir())
        (tmp / MARKER).write_text(json.dumps({"written_by": "lightning-mcore", **note, "files": files},
                                             indent=2))
        for path in [tmp, *tmp.rglob("*")]:
            os.chmod(path, 0o755 if path.is_dir() else 0o644)
        replace_dir(tmp, output)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
