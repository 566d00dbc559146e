"""Run under torchrun (2 GPUs) by test_gpu_layouts: the same 4 steps at CP=2 and at DP=2 (same
global batch), bf16 with TE; rank 0 writes both loss curves to argv[1]/losses.json. The same 8
rows every step, so that the loss falls (fresh random rows would stay at ln(vocab))."""

import json
import sys
from pathlib import Path

from toy import TokenRows, fit, tiny_config

tmp = Path(sys.argv[1])
common = dict(config=tiny_config(seq_length=256, transformer_impl="transformer_engine"), steps=4,
              accelerator="gpu", precision="bf16-mixed", start_method="popen", devices=2, gbs=8, mbs=2,
              dataset=TokenRows(n=8, seq=256, vocab=500))
dp2 = fit(tmp, name="dp2", **common)
cp2 = fit(tmp, name="cp2", context_parallel_size=2, **common)
if dp2:
    (tmp / "losses.json").write_text(json.dumps({"dp2": dp2, "cp2": cp2}))
