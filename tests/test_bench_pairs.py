"""benchmarks/pairs.py: the interval RESULTS.md reports for interleaved pairs, against Student's t
computed here from its density, and the split of pairs by collector pauses."""

import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
from pairs import T975, pair_lines, ratio_interval  # noqa: E402


def t_quantile_975(df: int) -> float:
    """The 0.975 quantile of Student's t with `df` degrees of freedom: bisection on the tail
    mass, the density integrated by Simpson's rule (the tail beyond 200 is negligible at 1e-3)."""
    c = math.gamma((df + 1) / 2) / (math.sqrt(df * math.pi) * math.gamma(df / 2))

    def density(x):
        return c * (1 + x * x / df) ** (-(df + 1) / 2)

    def mass(a, b, n=20000):  # Simpson, n even
        h = (b - a) / n
        return h / 3 * sum((1 if i in (0, n) else 4 if i % 2 else 2) * density(a + i * h) for i in range(n + 1))

    lo, hi = 1.0, 15.0
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if 0.5 - mass(0, mid) > 0.025 else (lo, mid)
    return (lo + hi) / 2


def test_t_table_matches_the_density():
    for df in (2, 4, 9, 30):
        assert abs(T975[df - 1] - t_quantile_975(df)) < 2e-3, df


def test_interval_of_log_ratios_by_hand():
    logs = [0.01, -0.01, 0.02, -0.02, 0.0]  # mean 0, sample sd sqrt(0.001 / 4)
    mean, lo, hi = ratio_interval([math.exp(x) for x in logs])
    half = t_quantile_975(4) * math.sqrt(0.001 / 4) / math.sqrt(5)
    assert abs(mean - 1) < 1e-12
    assert abs(lo - math.exp(-half)) < 1e-5 and abs(hi - math.exp(half)) < 1e-5
    assert ratio_interval([1.1]) == (1.1, None, None)


def run(tokens: float, pause_ms: float = 1.0) -> dict:
    return {"tokens_per_s_per_gpu": tokens, "ranks": [{"gc_max_ms": 1.0}, {"gc_max_ms": pause_ms}]}


def test_pairs_with_a_collector_pause_are_reported_apart():
    results = {"raw": run(100), "lightning": run(95),
               "raw#2": run(100, pause_ms=540), "lightning#2": run(120),
               "raw#3": run(100), "lightning#3": run(97)}
    clean, everything = pair_lines("lightning", "raw", results)
    assert "2 pairs without a collector pause" in clean
    assert f"geometric mean {math.sqrt(0.95 * 0.97):.3f}x" in clean
    assert "all 3 pairs" in everything
    assert f"geometric mean {(0.95 * 1.2 * 0.97) ** (1 / 3):.3f}x" in everything
    assert pair_lines("lightning", "raw", {"raw": run(100), "lightning": run(95)}) == []
