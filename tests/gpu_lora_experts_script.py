"""Run under torchrun (2 processes) by test_gpu_lora_experts: for each case in <root>/cases.json,
LoRA (all-linear, experts included) trains 3 SGD steps at EP=2 from <root>/source with the case's
model overrides (TE's, torch's or no grouped experts); rank 0 writes <root>/<case>/logits.pt, the PEFT
export to <root>/<case>/peft and facts.json.

    torchrun --nproc-per-node 2 tests/gpu_lora_experts_script.py gpu bf16-mixed <root>
(`cpu 32-true` runs the same on gloo, to check the harness without a GPU.)"""

import json
import os
import sys
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader

from lightning_mcore import MegatronStrategy, OptimizerSettings, PretrainModule
from lightning_mcore.lora.config import LoRAConfig

STEPS = 3


class Export(L.Callback):
    def __init__(self, out: Path, tokens: torch.Tensor):
        self.out, self.tokens = out, tokens

    def on_train_end(self, trainer, pl_module):
        logits = pl_module.forward_logits(self.tokens).float().cpu()
        pl_module.save_hf_checkpoint(self.out / "peft", mode="peft")
        if trainer.global_rank == 0:
            torch.save(logits, self.out / "logits.pt")
            (self.out / "facts.json").write_text(json.dumps(
                {"trainable": pl_module.lora_trainable_parameters,
                 "grouped": pl_module.model_config.moe_grouped_gemm,
                 "experts": sorted({type(m).__name__ for m in pl_module.modules() if m.__class__.__name__.endswith("MLP")
                                    and hasattr(m, "num_local_experts")})}))


def main(accelerator: str, precision: str, root: Path) -> None:
    tokens = torch.load(root / "tokens.pt")
    rows = [{"tokens": t[:-1], "labels": t[1:], "loss_mask": torch.ones(len(t) - 1),
             "position_ids": torch.arange(len(t) - 1)} for t in tokens]
    for case in json.loads((root / "cases.json").read_text()):
        out = root / case["name"]
        trainer = L.Trainer(
            accelerator=accelerator, devices=2, precision=precision, max_steps=STEPS, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            use_distributed_sampler=False, callbacks=[Export(out, tokens[:2, :-1])],
            strategy=MegatronStrategy(global_batch_size=len(rows), expert_model_parallel_size=2),
        )
        module = PretrainModule(
            str(root / "source"), OptimizerSettings(lr=0.5, optimizer="sgd", weight_decay=0.0, warmup_steps=0),
            model_overrides=case["overrides"], lora=LoRAConfig(target_modules="all-linear", rank=8, alpha=16.0))
        # each data-parallel rank its half of the global batch (EP=2 on 2 processes is DP=2)
        mine = rows[int(os.environ["RANK"])::2]
        trainer.fit(module, DataLoader(mine * STEPS, batch_size=len(mine)))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], Path(sys.argv[3]))
