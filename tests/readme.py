"""The commands and code of the README and of the guides in docs/, read from the files themselves,
and run as a user runs them: in a fresh directory holding a copy of configs/, in a clean
environment."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[1]
README = (ROOT / "README.md").read_text()
DOCS = ROOT / "docs"

# Earlier in-process launches leave these in this process's environment; a child that inherits
# them believes it was launched by torchrun (or is reseeded).
LAUNCH_VARS = {"MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "NODE_RANK", "RANK", "WORLD_SIZE",
               "LOCAL_WORLD_SIZE", "GROUP_RANK", "PL_GLOBAL_SEED", "PL_SEED_WORKERS", "PL_TRAINER_GPUS",
               "TORCHELASTIC_RUN_ID"}


def page(name: str = "README.md") -> str:
    """The text of README.md, or of a page of docs/ (`"sft.md"`)."""
    return README if name == "README.md" else (DOCS / name).read_text()


def section(title: str, page_name: str = "README.md") -> str:
    """The text of the section headed `## title` (up to the next `## `) of the README, or of the
    docs/ page `page_name`."""
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", page(page_name), re.S | re.M)
    assert match, f"{page_name} has no section '## {title}'"
    return match.group(1)


def sections(text: str) -> dict[str, str]:
    """Every `## ` section of a page's text, by title."""
    return {m.group(1): m.group(2) for m in re.finditer(r"^## ([^\n]*)\n(.*?)(?=^## |\Z)", text, re.S | re.M)}


def code_blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", text, re.S | re.M)


def commands(text: str, program: str = "lightning-mcore") -> list[list[str]]:
    """The shell commands of `text`'s bash blocks that start with `program`, split into argv
    (backslash continuations joined, comments dropped)."""
    found = []
    for block in code_blocks(text, "bash"):
        for line in block.replace("\\\n", " ").splitlines():
            argv = shlex.split(line, comments=True)
            if argv and argv[0] == program:
                found.append(argv)
    return found


def as_python(argv: list[str]) -> list[str]:
    """`lightning-mcore ...` / `torchrun ...` through this interpreter (the checkout's package)."""
    programs = {"lightning-mcore": ["-m", "lightning_mcore.cli"], "torchrun": ["-m", "torch.distributed.run"]}
    return [sys.executable, *programs[argv[0]], *argv[1:]]


def user_dir(path: Path) -> Path:
    """A fresh working directory as a user's checkout has it: configs/ (copied, so runs/ lands here)."""
    shutil.copytree(ROOT / "configs", path / "configs")
    return path


def clean_env(tmp: Path, **extra: str) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in LAUNCH_VARS and k != "TORCH_COMPILE_DISABLE" and not k.startswith("SLURM_")}
    env.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               HF_DATASETS_CACHE=str(tmp / ".datasets-cache"), **extra)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return env


def free_port() -> int:
    """A localhost port nothing listens on now, for a launch's rendezvous (MASTER_PORT)."""
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def warnings_in(text: str) -> list[str]:
    """Lines of a console output that report a warning (Python's format or Lightning's) or a
    deprecation (a library's logger says so in words alone)."""
    return [line for line in text.splitlines()
            if re.search(r"\w*Warning\b|\.py:\d+: |(?i:\bdeprecated\b)", line)]


def run(argv: list[str], cwd: Path, timeout: int = 600, **env: str) -> subprocess.CompletedProcess:
    proc = subprocess.run(as_python(argv), cwd=cwd, env=clean_env(cwd, **env), capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, f"{shlex.join(argv)}\n{proc.stderr[-4000:]}"
    return proc
