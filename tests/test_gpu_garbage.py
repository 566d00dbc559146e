"""On GPU the strategy freezes the garbage collector's objects after a fit's first step and
unfreezes them at its end (strategy/garbage.py; tests/test_garbage.py has the CPU side and the
release rule). Skipped without CUDA."""

import gc
import json

import pytest
from test_garbage import FreezeCounts
from toy import fit, tiny_config

pytestmark = [pytest.mark.gpu]


def test_gpu_fit_freezes_after_its_first_step_and_releases(tmp_path):
    out = tmp_path / "counts.json"
    losses = fit(tmp_path, steps=3, config=tiny_config(transformer_impl="transformer_engine"),
                 callbacks=[FreezeCounts(out)], accelerator="gpu", precision="bf16-mixed", start_method="popen")
    counts = json.loads(out.read_text())
    assert len(losses) == 3
    assert min(counts[1:]) > 10_000 and counts[1] > counts[0], counts  # a library may have frozen a few
    assert gc.get_freeze_count() == 0  # released when the fit ended
