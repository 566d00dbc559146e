"""HFExport: write the model as a Hugging Face directory during and at the end of training."""

from __future__ import annotations

from pathlib import Path
from typing import Literal, Optional

import lightning as L

from lightning_mcore.hf.export_dir import check_targets


class HFExport(L.Callback):
    """Every `every_n_train_steps` optimizer steps and/or at the end of training, write
    `dirpath/step=N` (a complete HF directory, written to a temporary name then renamed).

    `mode`: "full" (the whole model, loadable by transformers), "peft" (a LoRA run's adapter,
    loadable by peft) or "merged" (LoRA merged into the base weights). `lora_experts_layout`
    (PEFT with adapters on MoE experts): "fused" (default) or "per_expert" (vLLM's names).

    A run never replaces an export it finds already there (an earlier run's, say): before the
    first step it checks every `step=N` it will write and refuses, unless `overwrite=True`, and
    even then only earlier lightning-mcore exports are replaced (hf/export_dir.py).
    """

    def __init__(
        self,
        dirpath: str,
        every_n_train_steps: Optional[int] = None,
        at_end: bool = True,
        mode: Literal["full", "peft", "merged"] = "full",
        max_shard_bytes: int = 5 * 2**30,
        overwrite: bool = False,
        lora_experts_layout: Optional[Literal["fused", "per_expert"]] = None,
    ) -> None:
        if every_n_train_steps is not None and every_n_train_steps <= 0:
            raise ValueError(f"every_n_train_steps must be a positive int or None, got {every_n_train_steps}.")
        if mode not in ("full", "peft", "merged"):
            raise ValueError(f"mode must be 'full', 'peft' or 'merged', got {mode!r}.")
        if lora_experts_layout is not None and mode != "peft":
            raise ValueError(f"lora_experts_layout applies to mode='peft' exports, not {mode!r}; leave it unset.")
        self.dirpath, self.every, self.at_end = Path(dirpath), every_n_train_steps, at_end
        self.mode, self.max_shard_bytes, self.overwrite = mode, max_shard_bytes, overwrite
        self.lora_experts_layout = lora_experts_layout
        self.last_export: Optional[Path] = None

    def path(self, step: int) -> Path:
        return self.dirpath / f"step={step}"

    def planned_steps(self, start_step: int, max_steps: int) -> list[int]:
        """The steps whose exports a run from `start_step` to `max_steps` writes (the end is
        unknown without max_steps)."""
        if max_steps is None or max_steps < 0:
            return []
        every = self.every
        steps = set(range((start_step // every + 1) * every, max_steps + 1, every)) if every else set()
        if self.at_end and max_steps > start_step:
            steps.add(max_steps)
        return sorted(steps)

    def check_targets(self, start_step: int, max_steps: int) -> None:
        """ExportTargetError if an export this run will write would replace something it may
        not (collective in a distributed run)."""
        check_targets([self.path(step) for step in self.planned_steps(start_step, max_steps)],
                      self.overwrite)

    def setup(self, trainer, pl_module, stage: str) -> None:
        if self.mode != "full" and getattr(pl_module, "lora", None) is None:
            raise ValueError(f"HFExport(mode={self.mode!r}) needs a module trained with LoRA; use mode='full'.")
        pl_module.check_hf_export(self.mode, self.lora_experts_layout)

    def on_train_start(self, trainer, pl_module) -> None:
        # After a resume has set global_step, before the first step costs anything.
        self.check_targets(trainer.global_step, trainer.max_steps)

    def _export(self, trainer, pl_module) -> None:
        path = self.path(trainer.global_step)
        if path == self.last_export:
            return  # the last step was already exported by the every-N rule
        pl_module.save_hf_checkpoint(path, max_shard_bytes=self.max_shard_bytes, mode=self.mode,
                                     overwrite=self.overwrite, lora_experts_layout=self.lora_experts_layout)
        self.last_export = path

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.every and trainer.global_step % self.every == 0:
            self._export(trainer, pl_module)

    def on_train_end(self, trainer, pl_module) -> None:
        if self.at_end:
            self._export(trainer, pl_module)
