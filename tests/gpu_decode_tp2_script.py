"""Run under torchrun (2 GPUs) by test_generation's TP=2 decode-graph test: greedy, sampled and
stopped generation at TP=2 (TE, fp32) with decode steps from CUDA graphs; each rank writes what it
got to argv[2]/tp2.rank<r>.json (test_generation.Generate), then two rows whose graphs may hold
almost no memory to argv[2]/budget.rank<r>.json. argv[1]: the HF checkpoint, made by the
test, so that both ranks read the same weights. A rank stuck in a collective prints every thread's
stack after 240 s (the test's subprocess timeout is longer), so a hang says where it stopped."""

import faulthandler
import json
import sys
from pathlib import Path

import lightning as L
from test_generation import NEW, PROMPTS, Generate
from torch.utils.data import DataLoader

from lightning_mcore import MegatronStrategy, PretrainModule
from lightning_mcore.generation import decode_graphs
from lightning_mcore.generation.batched import SamplingSettings


class BudgetedGenerate(L.Callback):
    """Two rows (a new DecodeGraphs) with graph_memory_fraction so small that the first capture
    spends it: that position replays its graph, the later ones decode eagerly, on both ranks."""

    def __init__(self, out) -> None:
        self.out = out

    def on_predict_end(self, trainer, pl_module):
        sampling = SamplingSettings(max_new_tokens=NEW, greedy=True, graph_memory_fraction=1e-6)
        got = {"greedy": pl_module.generate_batch(PROMPTS[:2], sampling)}
        kept = decode_graphs._KEPT.get(pl_module.chunks[0])
        got["graphs"] = len(kept.graphs) if kept is not None and kept.rows == 2 else -1
        (self.out / f"budget.rank{trainer.global_rank}.json").write_text(json.dumps(got))


faulthandler.dump_traceback_later(240, exit=True)
source, out = sys.argv[1], Path(sys.argv[2])
trainer = L.Trainer(accelerator="gpu", devices=2, logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
                    callbacks=[Generate(out / "tp2.json"), BudgetedGenerate(out)],
                    strategy=MegatronStrategy(global_batch_size=2, tensor_model_parallel_size=2))
prompts = {"prompts": PROMPTS, "sampling": SamplingSettings(max_new_tokens=NEW, greedy=True)}
trainer.predict(PretrainModule(source), DataLoader([prompts], batch_size=None))
