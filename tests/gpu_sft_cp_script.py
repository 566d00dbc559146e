"""Run under torchrun (2 GPUs) by test_gpu_layouts.py (packed SFT test): packed SFT (test_sft_packing's rows: samples of
odd lengths, several per row) for 5 steps at CP=1 (data parallel over the 2 GPUs) and at CP=2
(every sequence padded to a multiple of 4 and split over the 2 GPUs), same global batch, bf16 with
TE; rank 0 writes each run's per-step (loss, grad norm) to argv[1]/runs.json."""

import json
import sys
from pathlib import Path

import lightning as L
from torch.utils.data import DataLoader

from lightning_mcore import MegatronStrategy, OptimizerSettings
from lightning_mcore.data.packing import build_row, pack
from lightning_mcore.objectives.sft import SFTModule
from test_sft_packing import LENGTHS, SEQ, samples
from toy import tiny_config


class LossAndGradNorm(L.Callback):
    def __init__(self) -> None:
        self.steps = []

    def on_train_batch_end(self, trainer, pl_module, *args):
        optimizer = pl_module.optimizers(use_pl_optimizer=False)
        self.steps.append([float(trainer.callback_metrics["train/loss"]), optimizer.last_grad_norm])


def run(cp: int) -> list:
    data = samples()
    rows = [build_row([data[i] for i in row], SEQ, pad_id=0) for row in pack(LENGTHS, SEQ)]
    record = LossAndGradNorm()
    trainer = L.Trainer(
        accelerator="gpu", devices=2, max_steps=5, precision="bf16-mixed", logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, callbacks=[record],
        strategy=MegatronStrategy(global_batch_size=len(rows), micro_batch_size=1, start_method="popen",
                                  context_parallel_size=cp),
    )
    module = SFTModule(tiny_config(seq_length=SEQ, transformer_impl="transformer_engine"),
                       OptimizerSettings(lr=1e-3, clip_grad=1.0))
    trainer.fit(module, DataLoader(rows, batch_size=len(rows) // (2 // cp)))
    return record.steps if trainer.global_rank == 0 else []


tmp = Path(sys.argv[1])
runs = {"cp1": run(1), "cp2": run(2)}
if runs["cp1"]:
    (tmp / "runs.json").write_text(json.dumps(runs))
