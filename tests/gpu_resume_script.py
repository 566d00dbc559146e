"""Run under torchrun (2 GPUs) by test_gpu_sft_checkpoint: straight, interrupted and resumed runs
with the distributed optimizer; rank 0 writes the losses under argv[1]."""

import json
import sys
from pathlib import Path

from toy import fit_with_checkpoints, tiny_config

tmp = Path(sys.argv[1])
common = dict(config=tiny_config(vocab_size=512, transformer_impl="transformer_engine"),
              accelerator="gpu", start_method="popen", use_distributed_optimizer=True)
straight = fit_with_checkpoints(tmp, "straight", 2, **common)
first = fit_with_checkpoints(tmp, "first", 2, stop=3, **common)
saved = str(tmp / "first-ckpts" / "epoch=0-step=3.ckpt")
resumed = fit_with_checkpoints(tmp, "resumed", 2, ckpt_path=saved, **common)
if straight:  # rank 0
    (tmp / "losses.json").write_text(json.dumps({"straight": straight, "first": first, "resumed": resumed}))
