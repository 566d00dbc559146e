"""benchmarks/bench_pretrain.py's GPU idle gaps (where a profiled step leaves the GPU waiting),
against a hand computation over kernels that overlap on two streams."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
from bench_pretrain import idle_gaps  # noqa: E402


def test_idle_gaps_merge_overlapping_kernels_and_name_each_gap():
    kernels = [("c", 50, 60), ("a", 0, 10), ("d", 55, 70), ("b", 12, 20), ("e", 70, 71), ("f", 75, 80)]
    # busy: 0-10, 12-20, 50-71 (c, d and e touch or overlap), 75-80 -> 10 + 8 + 21 + 5 = 44 of 80
    gaps = idle_gaps(kernels, top=2)
    assert (gaps["span_us"], gaps["busy_us"], gaps["idle_us"]) == (80, 44, 36)
    assert gaps["largest"] == [{"us": 30, "after": "b", "before": "c"},
                               {"us": 4, "after": "e", "before": "f"}]


def test_no_kernels_no_gaps():
    assert idle_gaps([]) == {"span_us": 0.0, "busy_us": 0.0, "idle_us": 0.0, "largest": []}
