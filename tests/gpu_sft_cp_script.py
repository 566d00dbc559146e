"""Run under torchrun (2 GPUs) by test_gpu_layouts.py (packed tests): bf16 with TE, rank 0 writes
each run's per-step records to argv[1]/runs.json.
- packed SFT (test_sft_packing's rows: samples of odd lengths, several per row) for 5 steps at
  CP=1 (data parallel over the 2 GPUs) and at CP=2 (every sequence padded to a multiple of 4 and
  split over the 2 GPUs): (loss, grad norm);
- the same samples one per row through the plain causal path (PretrainModule) at CP=2: the
  packed-equals-unpacked equality, under context parallelism;
- DPO (frozen reference) for 3 steps at CP=1 and CP=2, micro batch 2: its metrics (policy and
  reference log-probs) and grad norm."""

import json
import sys
from pathlib import Path

import lightning as L
from torch.utils.data import DataLoader

from lightning_mcore import MegatronStrategy, OptimizerSettings, PretrainModule
from lightning_mcore.data.packing import build_row, pack
from lightning_mcore.objectives.dpo import METRICS, DPOModule
from lightning_mcore.objectives.sft import SFTModule
from test_dpo import SEQ as DPO_SEQ
from test_dpo import pairs
from test_sft_packing import LENGTHS, SEQ, samples
from toy import tiny_config


class Record(L.Callback):
    def __init__(self, keys) -> None:
        self.keys, self.steps = keys, []

    def on_train_batch_end(self, trainer, pl_module, *args):
        optimizer = pl_module.optimizers(use_pl_optimizer=False)
        metrics = [float(trainer.callback_metrics[f"train/{k}"]) for k in self.keys]
        self.steps.append(metrics + [optimizer.last_grad_norm])


def run(cp: int, rows: list, module, steps: int, mbs: int = 1, keys=("loss",)) -> list:
    record = Record(keys)
    trainer = L.Trainer(
        accelerator="gpu", devices=2, max_steps=steps, precision="bf16-mixed", logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, callbacks=[record],
        strategy=MegatronStrategy(global_batch_size=len(rows), micro_batch_size=mbs, start_method="popen",
                                  context_parallel_size=cp),
    )
    trainer.fit(module, DataLoader(rows, batch_size=len(rows) // (2 // cp)))
    return record.steps if trainer.global_rank == 0 else []


def sft(cp: int) -> list:
    data = samples()
    rows = [build_row([data[i] for i in row], SEQ, pad_id=0) for row in pack(LENGTHS, SEQ)]
    module = SFTModule(tiny_config(seq_length=SEQ, transformer_impl="transformer_engine"),
                       OptimizerSettings(lr=1e-3, clip_grad=1.0))
    return run(cp, rows, module, 5)


def one_sample_per_row(cp: int) -> list:
    rows = [{k: v for k, v in build_row([s], SEQ, pad_id=0).items() if k != "segment_ids"} for s in samples()]
    module = PretrainModule(tiny_config(seq_length=SEQ, transformer_impl="transformer_engine"),
                            OptimizerSettings(lr=1e-3, clip_grad=1.0))
    return run(cp, rows, module, 5)


def dpo(cp: int) -> list:
    rows, _ = pairs(8, 500, seed=1)
    module = DPOModule(tiny_config(seq_length=DPO_SEQ, transformer_impl="transformer_engine"),
                       OptimizerSettings(lr=1e-3, clip_grad=1.0), beta=0.5)
    return run(cp, rows, module, 3, mbs=2, keys=METRICS)


tmp = Path(sys.argv[1])
runs = {"cp1": sft(1), "cp2": sft(2), "single_cp2": one_sample_per_row(2),
        "dpo_cp1": dpo(1), "dpo_cp2": dpo(2), "dpo_metrics": list(METRICS)}
if runs["cp1"]:
    (tmp / "runs.json").write_text(json.dumps(runs))
