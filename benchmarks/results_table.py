"""The table at the top of benchmarks/RESULTS.md, regenerated from the raw files that
benchmarks/workloads.py names: each workload's number, its baseline's, the ratio and how each goal
stands. Only the lines between the two marker comments are written; the dated notes below stay.

    python benchmarks/results_table.py            # rewrite the table in RESULTS.md
    python benchmarks/results_table.py --check    # exit 1 if RESULTS.md's table is not the regeneration

Each number is the median over the lines its Reading selects (runs, or steps of one run); a ratio
is our median over the baseline's, or for interleaved pairs the median of the pairs' ratios.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

from pairs import paused
from workloads import WORKLOADS, Goal, Reading, Workload

HERE = Path(__file__).parent
RESULTS_MD = HERE / "RESULTS.md"
RAW = HERE / "results"
BEGIN, END = "<!-- results-table:begin -->", "<!-- results-table:end -->"
COLUMNS = ("workload", "device", "versions", "ours", "baseline", "ratio", "goal", "date", "command", "raw file")


class TableError(Exception):
    """A workload or RESULTS.md that the table cannot be made from; the message says what to fix."""


def _value(text: str) -> object:
    """A CSV cell as the number it spells, else as text."""
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def raw_lines(path: Path) -> list[dict]:
    """The records of a raw file: JSON lines, or a CSV's rows (Lightning's metrics.csv)."""
    if not path.is_file():
        raise TableError(f"{path} does not exist; fix the file name in benchmarks/workloads.py")
    if path.suffix == ".csv":
        with open(path, newline="") as f:
            return [{k: _value(v) for k, v in row.items()} for row in csv.DictReader(f)]
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _same(have: object, want: object) -> bool:
    """Equal and both bool or both not (False == 0 in Python)."""
    return have == want and isinstance(have, bool) == isinstance(want, bool)


def selected(reading: Reading, raw: Path) -> list[dict]:
    """The lines of `reading`'s files, in file order, whose fields match its `where`."""
    found = []
    for name in reading.files:
        for line in raw_lines(raw / name):
            fields = {**line, "label": str(line.get("label", "")).partition("#")[0]} if "label" in line else line
            if all(any(_same(fields.get(key), w) for w in (want if isinstance(want, tuple) else (want,)))
                   for key, want in reading.where.items()):
                found.append(line)
    if not found:
        raise TableError(f"no line of {', '.join(reading.files)} matches {dict(reading.where)}; "
                         "fix the workload's Reading in benchmarks/workloads.py")
    return found


@dataclass(frozen=True)
class Row:
    """One workload's figures from its raw lines."""

    workload: Workload
    ours: float
    ours_lines: int
    baseline: float | None
    baseline_lines: int
    ratio: float | None
    goal_values: tuple[float, ...]


def measure(workload: Workload, raw: Path = RAW) -> Row:
    """The row's medians, ratio and goal values (see the module's docstring for the statistics)."""
    ours = selected(workload.ours.reading, raw)
    base = selected(workload.baseline.reading, raw) if workload.baseline else []
    metric = workload.ours.reading.metric
    base_metric = workload.baseline.reading.metric if workload.baseline else ""
    if workload.paired:
        if len(ours) != len(base):
            raise TableError(f"{workload.name}: paired, but {len(ours)} lines of ours against {len(base)} "
                             "of the baseline; fix its Readings in benchmarks/workloads.py")
        kept = [(o, b) for o, b in zip(ours, base) if not (workload.drop_paused and (paused(o) or paused(b)))]
        ours, base = [o for o, _ in kept], [b for _, b in kept]
        ratio = statistics.median(o[metric] / b[base_metric] for o, b in kept)
    else:
        if workload.drop_paused:
            ours, base = [o for o in ours if not paused(o)], [b for b in base if not paused(b)]
        ratio = None
    ours_median = statistics.median(line[metric] for line in ours)
    base_median = statistics.median(line[base_metric] for line in base) if base else None
    if ratio is None and base_median is not None:
        ratio = ours_median / base_median
    goal_values = tuple(ratio if g.metric == "ratio" else statistics.median(line[g.metric] for line in ours)
                        for g in workload.goals)
    return Row(workload, ours_median, len(ours), base_median, len(base), ratio, goal_values)


def number(x: float) -> str:
    """59,587; 385; 31.2; 4.00e-3."""
    if abs(x) >= 100:
        return f"{x:,.0f}"
    if abs(x) >= 0.01:
        return f"{x:.3g}"
    mantissa, exponent = f"{x:.2e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def shown(value: float, unit: str) -> str:
    return f"{value:.3f}×" if unit == "x" else f"{100 * value:.1f}%" if unit == "%" else number(value)


def goal_cell(goal: Goal, value: float) -> str:
    """How a goal stands: met or missed, the value, and by how much relative to the goal."""
    met = value >= goal.bound if goal.higher_is_better else value <= goal.bound
    factor = value / goal.bound
    by = f"{factor:.1f}× the goal" if factor >= 2 else f"{100 * abs(factor - 1):.1f}%"
    return f"{goal.text} (issue {goal.issue}): **{'met' if met else 'missed'}** by {by}, at {shown(value, goal.unit)}"


def lines_note(n: int, reading: Reading) -> str:
    each = "step" if "step" in reading.where or reading.files[0].endswith(".csv") else "run"
    return f"{n} {each}" if n == 1 else f"median of {n} {each}s"


def cells(row: Row) -> tuple[str, ...]:
    w = row.workload
    ours = f"{number(row.ours)} {w.unit} ({lines_note(row.ours_lines, w.ours.reading)})"
    base = ratio = "–"
    if w.baseline and row.baseline is not None:
        base = f"{w.baseline.name}: {number(row.baseline)} ({lines_note(row.baseline_lines, w.baseline.reading)})"
        ratio = f"{row.ratio:.3f}×" + ((f" (median of {row.ours_lines} pairs' ratios)" if row.ours_lines > 1 else " (one pair)")
                                        if w.paired else "")
    goals = "; ".join(goal_cell(g, v) for g, v in zip(w.goals, row.goal_values)) or "–"
    files = list(dict.fromkeys([*w.ours.reading.files, *(w.baseline.reading.files if w.baseline else ())]))
    dates = ", ".join(dict.fromkeys(f.split("/")[0] for f in files))
    device = f"{w.gpus}× {w.device.removeprefix('NVIDIA ')}"
    commands = "<br>".join(f"`{c}`" for c in w.commands)
    raw = ", ".join(f"[{Path(f).name}](results/{f})" for f in files)
    return (f"**{w.name}**: {w.what}", device, w.versions, ours, base, ratio, goals, dates, commands, raw)


def table(raw: Path = RAW) -> str:
    """The markdown table, one row a workload, in workloads.py's order."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for workload in WORKLOADS:
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells(measure(workload, raw))) + " |")
    return "\n".join(lines)


def with_table(text: str, new_table: str) -> str:
    """`text` with the lines between the markers replaced by `new_table`."""
    if text.count(BEGIN) != 1 or text.count(END) != 1 or text.index(BEGIN) > text.index(END):
        raise TableError(f"RESULTS.md needs one '{BEGIN}' line and one '{END}' line after it, where the table goes")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{new_table}\n{END}{tail}"


def difference(old: str, new: str) -> str:
    """One line: which rows of the table differ between two versions of RESULTS.md."""
    def rows(text: str) -> list[str]:
        return text.split(BEGIN, 1)[1].split(END, 1)[0].strip("\n").splitlines()

    before, after = rows(old), rows(new)
    names = [row.split("**")[1] if row.count("**") >= 2 else f"line {i + 1}"
             for i, row in enumerate(after if len(after) >= len(before) else before)]
    differing = [names[i] for i in range(max(len(before), len(after)))
                 if i >= len(before) or i >= len(after) or before[i] != after[i]]
    return (f"RESULTS.md's table differs from the raw files ({len(before)} lines against {len(after)} regenerated; "
            f"differing: {', '.join(differing)}); run: python benchmarks/results_table.py")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if RESULTS.md's table is not the regeneration")
    args = parser.parse_args(argv)
    try:
        old = RESULTS_MD.read_text()
        new = with_table(old, table())
    except TableError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.check:
        if new != old:
            print(difference(old, new))
            return 1
        print(f"RESULTS.md's table is the regeneration ({len(WORKLOADS)} workloads)")
        return 0
    RESULTS_MD.write_text(new)
    print(f"wrote the table of {len(WORKLOADS)} workloads into {RESULTS_MD}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
