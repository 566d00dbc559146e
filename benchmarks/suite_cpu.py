"""A pytest plugin that records each test's CPU seconds (the pytest process and every child it
waited for: forked ranks, commands and their ranks) as JSON lines, for finding where the suite's
time goes on the CPU-bound 2-core CI machine.

    PYTHONPATH=benchmarks SUITE_CPU_OUT=cpu.jsonl python -m pytest -q -n 2 -p suite_cpu tests
    python benchmarks/suite_cpu.py cpu.jsonl [other.jsonl]   # per file, and the change between two
"""

from __future__ import annotations

import collections
import json
import os
import resource
import sys
import time

import pytest


def _cpu() -> tuple[float, float]:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    own, children, start = *_cpu(), time.time()
    yield
    own_after, children_after = _cpu()
    with open(os.environ.get("SUITE_CPU_OUT", "suite_cpu.jsonl"), "a") as out:
        out.write(json.dumps({"id": item.nodeid, "self": own_after - own, "children": children_after - children,
                              "wall": time.time() - start}) + "\n")


def per_file(path: str) -> collections.Counter:
    seconds = collections.Counter()
    for line in open(path):
        row = json.loads(line)
        seconds[row["id"].split("::")[0]] += row["self"] + row["children"]
    return seconds


if __name__ == "__main__":
    runs = [per_file(p) for p in sys.argv[1:]]
    print("file | " + " | ".join(sys.argv[1:]) + (" | change" if len(runs) == 2 else ""))
    for name, _ in runs[0].most_common():
        cells = [f"{r[name]:.1f}" for r in runs]
        change = [f"{runs[1][name] - runs[0][name]:+.1f}"] if len(runs) == 2 else []
        print(f"{name} | " + " | ".join(cells + change))
    print("total | " + " | ".join(f"{sum(r.values()):.1f}" for r in runs))
