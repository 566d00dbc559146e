"""Run under torchrun (2 processes) by test_gpu_families: every family case in <root>/cases.json
in one launch (a launch costs about a minute on the GPU machine): its logits before training and
STEPS training steps on a repeated batch; rank 0 writes <root>/<family>/out.pt.

    torchrun --nproc-per-node 2 tests/gpu_families_script.py gpu bf16-mixed <root>
(`cpu 32-true` runs the same on gloo, to check the harness without a GPU.)"""

import json
import os
import sys
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader

from lightning_mcore import MegatronStrategy, OptimizerSettings, PretrainModule

STEPS = 8


class Record(L.Callback):
    def __init__(self, out: Path, tokens: torch.Tensor):
        self.out, self.tokens, self.losses, self.logits = out, tokens, [], None

    def on_train_start(self, trainer, pl_module):
        self.logits = pl_module.forward_logits(self.tokens).float().cpu()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(trainer.callback_metrics["loss"]))

    def on_train_end(self, trainer, pl_module):
        if trainer.global_rank == 0:
            torch.save({"losses": self.losses, "logits": self.logits}, self.out)


def main(accelerator: str, precision: str, root: Path) -> None:
    for case in json.loads((root / "cases.json").read_text()):
        directory = root / case["family"]
        tokens = torch.load(directory / "tokens.pt")
        rows = [{"tokens": t[:-1], "labels": t[1:], "loss_mask": torch.ones(len(t) - 1),
                 "position_ids": torch.arange(len(t) - 1)} for t in tokens]
        trainer = L.Trainer(
            accelerator=accelerator, devices=2, precision=precision, max_steps=STEPS, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            use_distributed_sampler=False,
            callbacks=[Record(directory / "out.pt", tokens[:2, :-1])],
            strategy=MegatronStrategy(global_batch_size=len(rows), **case["layout"]),
        )
        module = PretrainModule(str(directory / "source"), optim=OptimizerSettings(lr=3e-3))
        # each data-parallel rank its share of the global batch (EP=2 on 2 processes is DP=2)
        dp = 2 // case["layout"].get("tensor_model_parallel_size", 1)
        mine = rows[int(os.environ["RANK"]) % dp::dp]
        trainer.fit(module, DataLoader(mine * STEPS, batch_size=len(mine)))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], Path(sys.argv[3]))
