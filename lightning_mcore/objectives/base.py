"""The LightningModule base every objective shares: builds the chunks, steps through the strategy.

An objective only says how one microbatch goes through a model chunk and what its loss is
(`forward_step`); the strategy owns parallelism, microbatching and the optimizer.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Optional, Union

import lightning as L
import torch

from lightning_mcore.model.config import GPTConfig
from lightning_mcore.strategy.optimizer import OptimizerSettings


class MegatronModule(L.LightningModule):
    """`model` is a GPTConfig (train from scratch) or the path of a Hugging Face checkpoint
    directory (its config.json gives the architecture, its safetensors the weights);
    `model_overrides` changes config fields of a checkpoint (e.g. seq_length)."""

    def __init__(
        self,
        model: Union[GPTConfig, str],
        optim: Optional[OptimizerSettings] = None,
        model_overrides: Optional[dict] = None,
    ) -> None:
        super().__init__()
        if isinstance(model, (str, os.PathLike)):
            from lightning_mcore.hf.config import gpt_config_from_hf

            self.hf_path: Optional[str] = str(model)
            self.model_config, self.hf_family = gpt_config_from_hf(model, **(model_overrides or {}))
        elif isinstance(model, GPTConfig):
            from lightning_mcore.hf.mappings import family_of

            if model_overrides:
                model = dataclasses.replace(model, **model_overrides)
            self.hf_path, self.model_config, self.hf_family = None, model, family_of(model)
        else:
            raise TypeError(
                f"model must be a GPTConfig or a Hugging Face checkpoint directory, got "
                f"{type(model).__name__}."
            )
        self.optim = optim or OptimizerSettings()
        self.chunks: Optional[torch.nn.ModuleList] = None
        self._step_started: Optional[float] = None

    def _strategy(self):
        from lightning_mcore.strategy.megatron import MegatronStrategy

        strategy = self.trainer.strategy
        if not isinstance(strategy, MegatronStrategy):
            raise TypeError(
                f"{type(self).__name__} runs under lightning_mcore.MegatronStrategy, got "
                f"{type(strategy).__name__}: pass Trainer(strategy=MegatronStrategy(...))."
            )
        return strategy

    def configure_model(self) -> None:
        if self.chunks is None:
            chunks = self._strategy().build_gpt(self.model_config, self.hf_path, self.hf_family)
            self.chunks = torch.nn.ModuleList(chunks)

    def save_hf_checkpoint(self, directory, max_shard_bytes: int = 5 * 2**30):
        """Write the model as a Hugging Face directory (collective: call on every rank)."""
        from lightning_mcore.hf.export import export_hf

        strategy = self._strategy()
        padded = self.model_config.padded_vocab_size(strategy.parallel.tensor_model_parallel_size)
        return export_hf(list(self.chunks), self.model_config, self.hf_family, directory, padded,
                         source_dir=self.hf_path, max_shard_bytes=max_shard_bytes)

    def configure_optimizers(self):
        return self._strategy().megatron_optimizer(self.optim)

    def forward_step(self, batch: dict, chunk: torch.nn.Module):
        """(output, loss_fn) for one microbatch through one chunk, as mcore's schedule expects."""
        raise NotImplementedError

    # ------------------------------------------------------------------ steps
    def training_step(self, batch: dict, batch_idx: int):
        metrics = self._strategy().forward_backward(batch, self.forward_step)
        self.log_dict(
            {f"train/{k}": v for k, v in metrics.items()}, prog_bar=False, batch_size=1
        )
        self.log("loss", metrics["loss"], prog_bar=True, logger=False, batch_size=1)
        return metrics["loss"]

    def predict_step(self, batch: dict, batch_idx: int):
        """Full-vocabulary logits [batch, seq, vocab] of batch["tokens"] (on every rank)."""
        return self._strategy().forward_logits(batch["tokens"], batch.get("position_ids"))

    def validation_step(self, batch: dict, batch_idx: int):
        metrics = self._strategy().forward_backward(batch, self.forward_step, forward_only=True)
        self.log_dict({f"val/{k}": v for k, v in metrics.items()}, prog_bar=True, batch_size=1)
        return metrics["loss"]

    def on_train_batch_start(self, batch, batch_idx) -> None:
        self._step_started = time.perf_counter()

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        strategy = self._strategy()
        optimizer = self.optimizers(use_pl_optimizer=False)
        seconds = time.perf_counter() - self._step_started
        tokens = strategy.batch.global_batch_size * next(iter(batch.values())).shape[1]
        logs = {"train/lr": optimizer.lr, "train/tokens_per_sec": tokens / seconds}
        if optimizer.last_grad_norm is not None:
            logs["train/grad_norm"] = optimizer.last_grad_norm
        self.log_dict(logs, batch_size=1)
