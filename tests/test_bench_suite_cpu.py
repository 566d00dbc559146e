"""benchmarks/suite_cpu.py: the per-file CPU seconds it reports, against a sum by hand, and the
seconds it records for a test that burns CPU in a forked child (counted once the child is
waited for)."""

import json
import os
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))
from suite_cpu import per_file  # noqa: E402


def test_per_file_sums_own_and_children_seconds(tmp_path):
    rows = [("tests/a.py::x", 1.0, 2.0), ("tests/a.py::y[p]", 0.5, 0.0), ("tests/b.py::z", 0.25, 4.0)]
    path = tmp_path / "cpu.jsonl"
    path.write_text("".join(json.dumps({"id": i, "self": s, "children": c, "wall": 9.0}) + "\n" for i, s, c in rows))
    assert per_file(str(path)) == {"tests/a.py": 3.5, "tests/b.py": 4.25}


def test_a_forked_childs_cpu_is_counted(tmp_path):
    (tmp_path / "test_burn.py").write_text(
        "import os, time\n"
        "def test_burn():\n"
        "    pid = os.fork()\n"
        "    if pid == 0:\n"
        "        end = time.process_time() + 0.5\n"
        "        while time.process_time() < end:\n"
        "            pass\n"
        "        os._exit(0)\n"
        "    os.waitpid(pid, 0)\n"
        "def test_idle():\n"
        "    time.sleep(0.5)\n")
    out = tmp_path / "cpu.jsonl"
    env = dict(os.environ, PYTHONPATH=str(BENCH), SUITE_CPU_OUT=str(out))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "suite_cpu", "-p", "no:cacheprovider",
                           str(tmp_path / "test_burn.py")], env=env, cwd=tmp_path, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-2000:]
    rows = {r["id"].split("::")[1]: r for r in map(json.loads, out.read_text().splitlines())}
    assert rows["test_burn"]["children"] >= 0.45
    assert rows["test_idle"]["children"] == 0 and rows["test_idle"]["wall"] >= 0.5 > rows["test_idle"]["self"]
