"""CI installs and tests what the README tells a user to run: its set-up lines and test command
appear verbatim in .ci/run, and pyproject declares the Python and megatron-core that CI gets."""

from __future__ import annotations

import os
import subprocess
import tomllib

import pytest

from packaging.requirements import Requirement
from readme import ROOT, code_blocks, section

CI = (ROOT / ".ci" / "run").read_text().splitlines()


def test_ci_runs_the_readme_set_up_and_test_command_verbatim():
    (setup,) = code_blocks(section("Set up (fresh machine)"), "bash")
    (test,) = code_blocks(section("Test command"), "bash")
    lines = [line for line in (setup + test).splitlines() if line.strip()]
    assert lines and all(line in CI for line in lines), (lines, CI)
    assert CI.index(lines[0]) < CI.index(lines[1]) < CI.index(lines[-1])


def test_pyproject_declares_the_stack_ci_installs():
    """CI's venv is Python 3.12 and pip resolves megatron-core within the declared range: the
    range must start at the version tested (0.19.2) and hold no other minor release."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["requires-python"] == ">=3.12"
    (mcore,) = [Requirement(r) for r in project["dependencies"] if r.startswith("megatron-core")]
    assert mcore.specifier.contains("0.19.2") and not mcore.specifier.contains("0.19.1")
    assert not mcore.specifier.contains("0.20.0") and not mcore.specifier.contains("0.16.1")


def test_without_python_312_ci_stops_with_one_error_line(tmp_path):
    if any(os.path.exists(p) for p in ("/usr/bin/python3.12", "/usr/local/bin/python3.12")):
        pytest.skip("this machine's own python3.12 would be found")
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "PYENV_ROOT": str(tmp_path / "pyenv")}
    proc = subprocess.run(["bash", str(ROOT / ".ci" / "python312")], env=env, capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith("error: no CPython 3.12 found") and proc.stderr.count("\n") == 1


def test_python_312_found_is_3_12():
    proc = subprocess.run(["bash", str(ROOT / ".ci" / "python312")], capture_output=True, text=True)
    if proc.returncode == 2:
        return  # none on this machine: the test above covers that case
    version = subprocess.run([proc.stdout.strip(), "-c", "import sys; print(sys.version_info[:2])"],
                             capture_output=True, text=True).stdout
    assert version.strip() == "(3, 12)"
