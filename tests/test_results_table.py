"""benchmarks/results_table.py and benchmarks/workloads.py: the committed table at the top of
RESULTS.md is the regeneration from the raw files (docs/testing.md's "Benchmark results" commands,
run as shown); a row's number, ratio and goals against a hand computation on a tiny raw file; every
workload's raw files exist and its commands name scripts that exist."""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from readme import ROOT, commands, section

sys.path.insert(0, str(ROOT / "benchmarks"))
import results_table  # noqa: E402
from workloads import WORKLOADS, Goal, Reading, Side, Workload  # noqa: E402

BENCH = ROOT / "benchmarks"


def copy_of_benchmarks(root: Path) -> Path:
    """The table's inputs as a checkout has them: its scripts, RESULTS.md and the raw files named."""
    for name in ("results_table.py", "workloads.py", "pairs.py", "RESULTS.md"):
        (root / "benchmarks").mkdir(exist_ok=True)
        shutil.copy(BENCH / name, root / "benchmarks" / name)
    for w in WORKLOADS:
        for side in (w.ours, w.baseline):
            for name in side.reading.files if side else ():
                (root / "benchmarks" / "results" / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(BENCH / "results" / name, root / "benchmarks" / "results" / name)
    return root


def shown_commands() -> list[list[str]]:
    found = commands(section("Benchmark results", "testing.md"), program="python")
    assert found, "docs/testing.md's Benchmark results section shows no python command"
    return found


def run_shown(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *argv[1:]], cwd=cwd, capture_output=True, text=True, timeout=60)


def test_committed_table_is_the_regeneration(tmp_path):
    """The page's commands, run as shown in a copy: each exits 0 and leaves RESULTS.md as committed."""
    root = copy_of_benchmarks(tmp_path)
    for argv in shown_commands():
        proc = run_shown(argv, root)
        assert proc.returncode == 0, (argv, proc.stdout, proc.stderr)
    assert (root / "benchmarks" / "RESULTS.md").read_text() == (BENCH / "RESULTS.md").read_text()
    check = [argv for argv in shown_commands() if "--check" in argv]
    assert check and run_shown(check[0], ROOT).returncode == 0  # and on the checkout's own page


def test_a_stale_table_fails_the_check_and_is_rewritten(tmp_path):
    """A changed number in one row: --check exits 1 with one line naming that row; the rewrite
    restores the committed page, the dated notes below the table byte for byte."""
    root = copy_of_benchmarks(tmp_path)
    page = root / "benchmarks" / "RESULTS.md"
    committed = page.read_text()
    row = next(line for line in committed.splitlines() if line.startswith("| **moe30b-ep2**"))
    assert "49,656" in row
    page.write_text(committed.replace(row, row.replace("49,656", "49,657")))
    proc = subprocess.run([sys.executable, "benchmarks/results_table.py", "--check"], cwd=root,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and len(proc.stdout.strip().splitlines()) == 1, proc.stdout
    assert "moe30b-ep2" in proc.stdout and "dense-1b-hf" not in proc.stdout, proc.stdout
    subprocess.run([sys.executable, "benchmarks/results_table.py"], cwd=root, check=True, capture_output=True)
    assert page.read_text() == committed
    notes = committed.split(results_table.END, 1)[1]
    assert notes.lstrip().startswith("## 2026-11-28") and len(notes.splitlines()) > 2000


def write_jsonl(path: Path, lines: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))


def line(label: str, tokens: float, mfu: float = 0.3, pause_ms: float = 1.0, case: str = "c") -> dict:
    return {"case": case, "label": label, "tokens_per_s_per_gpu": tokens, "mfu": mfu,
            "ranks": [{"gc_max_ms": 1.0}, {"gc_max_ms": pause_ms}]}


def workload(**kw) -> Workload:
    reading = Reading(("2026-01-01/tiny.jsonl",), "tokens_per_s_per_gpu")
    ours = Side("ours", "python benchmarks/compare.py --cases c", Reading(reading.files, reading.metric,
                                                                        {"case": "c", "label": "ours"}))
    base = Side("base", "python benchmarks/compare.py --cases c", Reading(reading.files, reading.metric,
                                                                        {"case": "c", "label": "base"}))
    return Workload("tiny", "a tiny case", "GPU", 1, "v", "tokens/s/GPU", ours, base, **kw)


def test_row_by_hand(tmp_path):
    # ours 90, 120, 100 and base 50, 80, 60 (another case's line and a repeat's "#2" label too)
    write_jsonl(tmp_path / "2026-01-01" / "tiny.jsonl",
                [line("ours", 90, mfu=0.2), line("base", 50), line("ours#2", 120, mfu=0.5), line("base#2", 80),
                 line("ours", 100, mfu=0.4), line("base", 60), line("ours", 1e6, case="other")])
    goals = (Goal(1, "≥ 1.8×", "ratio", 1.8), Goal(1, "MFU ≥ 50%", "mfu", 0.5, unit="%"))
    row = results_table.measure(workload(goals=goals), tmp_path)
    # medians: ours 100, base 60; their ratio 100 / 60; our MFU's median 0.4
    assert (row.ours, row.ours_lines, row.baseline, row.baseline_lines) == (100, 3, 60, 3)
    assert row.ratio == pytest.approx(100 / 60) and row.goal_values == pytest.approx((100 / 60, 0.4))
    cells = results_table.cells(row)
    assert cells[3] == "100 tokens/s/GPU (median of 3 runs)" and cells[4] == "base: 60 (median of 3 runs)"
    assert cells[5] == "1.667×"
    # 1.667 / 1.8 = 0.926: 7.4% short; 0.4 / 0.5 = 0.8: 20% short
    assert cells[6] == ("≥ 1.8× (issue 1): **missed** by 7.4%, at 1.667×; "
                        "MFU ≥ 50% (issue 1): **missed** by 20.0%, at 40.0%")

    # interleaved pairs: 90/50 = 1.8, 120/80 = 1.5, 100/60 = 1.667: median 1.667
    paired = results_table.measure(workload(paired=True), tmp_path)
    assert paired.ratio == pytest.approx(100 / 60) and paired.ours == 100
    # the pair (120, 80) loses its baseline run to a 540 ms collection: ratios 1.8, 1.667, median 1.733
    write_jsonl(tmp_path / "2026-01-01" / "tiny.jsonl",
                [line("ours", 90), line("base", 50), line("ours", 120), line("base", 80, pause_ms=540),
                 line("ours", 100), line("base", 60)])
    dropped = results_table.measure(workload(paired=True, drop_paused=True), tmp_path)
    assert dropped.ratio == pytest.approx((1.8 + 100 / 60) / 2)
    assert (dropped.ours, dropped.baseline, dropped.ours_lines) == (95, 55, 2)


def test_a_goal_below_a_bound_and_a_missing_line():
    below = Goal(1, "≤ 1e-3", "d", 1e-3, unit="", higher_is_better=False)
    assert results_table.goal_cell(below, 4e-3) == "≤ 1e-3 (issue 1): **missed** by 4.0× the goal, at 4.00e-3"
    assert results_table.goal_cell(below, 8e-4) == "≤ 1e-3 (issue 1): **met** by 20.0%, at 8.00e-4"
    with pytest.raises(results_table.TableError, match="no line of"):
        results_table.selected(Reading(WORKLOADS[0].ours.reading.files, "x", {"case": "no-such-case"}),
                               results_table.RAW)


SCRIPT = re.compile(r"benchmarks/([\w.-]+\.(?:py|sh))")


def test_every_workload_names_raw_files_and_scripts_that_exist():
    assert len({w.name for w in WORKLOADS}) == len(WORKLOADS)
    for w in WORKLOADS:
        sides = [s for s in (w.ours, w.baseline) if s]
        for side in sides:
            for name in side.reading.files:
                path = BENCH / "results" / name
                assert path.is_file(), (w.name, name)
                for raw in results_table.selected(side.reading, BENCH / "results"):
                    # the lines' own device and torch, where they name them, are the row's
                    assert raw.get("device", w.device) == w.device, (w.name, raw.get("device"))
                    assert "torch" not in raw or f"torch {raw['torch']}" in w.versions, w.name
        assert w.commands, w.name
        for command in w.commands:
            scripts = SCRIPT.findall(command)
            assert scripts and all((BENCH / s).is_file() for s in scripts), (w.name, command)
        if w.runs:  # compare.py runs it: the labels read are the runs' labels, the command is compare.py's
            labels = {r.label for r in w.runs}
            assert {s.reading.where["label"] for s in sides} <= labels, w.name
            assert all(f"--cases {w.name}" in s.command for s in sides), w.name
