"""Interleaved pairs of runs (compare.py --repeat N): the geometric mean of the per-pair ratios
and its 95% interval, Student's t over the log ratios, as RESULTS.md reports them. Pairs in
which either run lost a garbage-collector pause in its timed steps are listed apart, since a
0.5 s pause in 10 steps says more about the collector than about either loop."""

from __future__ import annotations

import math

# two-sided 95% quantiles of Student's t, degrees of freedom 1..30 (beyond: the df 30 value,
# slightly wide)
T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
        2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
        2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)

PAUSE_MS = 100.0  # a collection this long inside the timed steps marks its pair


def ratio_interval(ratios: list[float]) -> tuple[float, float | None, float | None]:
    """(geometric mean, low, high) of `ratios`; no interval for fewer than 2."""
    logs = [math.log(r) for r in ratios]
    n = len(logs)
    mean = sum(logs) / n
    if n < 2:
        return math.exp(mean), None, None
    sd = math.sqrt(sum((x - mean) ** 2 for x in logs) / (n - 1))
    half = T975[min(n - 1, len(T975)) - 1] * sd / math.sqrt(n)
    return math.exp(mean), math.exp(mean - half), math.exp(mean + half)


def paused(result: dict) -> bool:
    """Whether any rank of a bench_pretrain result had a collection of PAUSE_MS or more in its
    timed steps."""
    return any(rank.get("gc_max_ms", 0) >= PAUSE_MS for rank in result.get("ranks", []))


def pair_lines(a: str, b: str, results: dict) -> list[str]:
    """The summary of label `a` against label `b` over the repeats `a#k` / `b#k` in `results`
    (label -> bench_pretrain result)."""
    clean, with_pause = [], []
    for key, r in results.items():
        label, _, k = key.partition("#")
        other = results.get(f"{b}#{k}" if k else b)
        if label != a or other is None:
            continue
        ratio = r["tokens_per_s_per_gpu"] / other["tokens_per_s_per_gpu"]
        (with_pause if paused(r) or paused(other) else clean).append(ratio)
    lines = []
    everything = clean + with_pause
    for what, ratios in ((f"{len(clean)} pairs without a collector pause", clean),
                         (f"all {len(everything)} pairs", everything if with_pause else [])):
        if len(ratios) >= 2:
            mean, lo, hi = ratio_interval(ratios)
            lines.append(f"  {a} / {b}, {what}: geometric mean {mean:.3f}x, 95% interval {lo:.3f}-{hi:.3f}")
    return lines
