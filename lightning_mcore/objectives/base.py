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
    """`model` is a GPTConfig (train from scratch), the path of a Hugging Face checkpoint
    directory (its config.json gives the architecture, its safetensors the weights), or a
    checkpoint directory saved by MegatronStrategy (fine-tuning: its weights only, at any
    layout; the optimizer, step count and data position start fresh). `model_overrides`
    changes config fields (e.g. seq_length)."""

    def __init__(
        self,
        model: Union[GPTConfig, str],
        optim: Optional[OptimizerSettings] = None,
        model_overrides: Optional[dict] = None,
    ) -> None:
        super().__init__()
        from lightning_mcore.strategy import checkpoint_io

        # hf_path: the HF directory behind the model (tokenizer and config travel into exports);
        # init_checkpoint: a MegatronStrategy checkpoint whose weights the model starts from.
        self.hf_path: Optional[str] = None
        self.init_checkpoint: Optional[str] = None
        if isinstance(model, (str, os.PathLike)) and checkpoint_io.is_checkpoint(model):
            saved = checkpoint_io.read_saved_model(model)
            self.init_checkpoint, self.hf_path, self.hf_family = str(model), saved.hf_path, saved.hf_family
            self.model_config = dataclasses.replace(saved.config, **(model_overrides or {}))
        elif isinstance(model, (str, os.PathLike)):
            from lightning_mcore.hf.config import gpt_config_from_hf

            self.hf_path = str(model)
            self.model_config, self.hf_family = gpt_config_from_hf(model, **(model_overrides or {}))
        elif isinstance(model, GPTConfig):
            from lightning_mcore.hf.mappings import family_of

            if model_overrides:
                model = dataclasses.replace(model, **model_overrides)
            self.model_config, self.hf_family = model, family_of(model)
        else:
            raise TypeError(
                f"model must be a GPTConfig, a Hugging Face checkpoint directory or a "
                f"MegatronStrategy checkpoint directory, got {type(model).__name__}."
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
            strategy = self._strategy()
            if self.init_checkpoint is not None:
                chunks = strategy.build_gpt(self.model_config, checkpoint=self.init_checkpoint)
            else:
                chunks = strategy.build_gpt(self.model_config, self.hf_path, self.hf_family)
            self.chunks = torch.nn.ModuleList(chunks)

    def save_hf_checkpoint(self, directory, max_shard_bytes: int = 5 * 2**30, mode: str = "full"):
        """Write the model as a Hugging Face directory (collective: call on every rank)."""
        from lightning_mcore.hf.export import export_hf

        if mode != "full":
            raise ValueError(f"mode={mode!r} needs LoRA adapters on the model; use mode='full'.")
        strategy = self._strategy()
        padded = self.model_config.padded_vocab_size(strategy.parallel.tensor_model_parallel_size)
        return export_hf(list(self.chunks), self.model_config, self.hf_family, directory, padded,
                         source_dir=self.hf_path, max_shard_bytes=max_shard_bytes)

    def configure_optimizers(self):
        return self._strategy().megatron_optimizer(self.optim)

    # A module whose forward_step sends microbatches as packed THD rows sets this.
    packed_sequences: bool = False

    def forward_step(self, batch: dict, chunk: torch.nn.Module):
        """(output, loss_fn) for one microbatch through one chunk, as mcore's schedule expects."""
        raise NotImplementedError

    # ------------------------------------------------------------------ steps
    def training_step(self, batch: dict, batch_idx: int):
        metrics = self._strategy().forward_backward(batch, self.forward_step,
                                                    packed=self.packed_sequences)
        self.log_dict(
            {f"train/{k}": v for k, v in metrics.items()}, prog_bar=False, batch_size=1
        )
        self.log("loss", metrics["loss"], prog_bar=True, logger=False, batch_size=1)
        return metrics["loss"]

    @torch.no_grad()
    def generate(self, prompt: list[int], max_new_tokens: int, stop: Optional[list[int]] = None) -> list[int]:
        """Greedy continuation of one prompt, without a KV cache (each token re-runs the
        whole sequence): for checks and demos, not serving. Collective: call on every rank;
        every rank returns the same tokens. Stops after any token in `stop`."""
        tokens = list(prompt)
        for _ in range(max_new_tokens):
            logits = self._strategy().forward_logits(torch.tensor([tokens]))
            tokens.append(int(logits[0, -1, : self.model_config.vocab_size].argmax()))
            if stop and tokens[-1] in stop:
                break
        return tokens[len(prompt):]

    def predict_step(self, batch: dict, batch_idx: int):
        """Full-vocabulary logits [batch, seq, vocab] of batch["tokens"] (on every rank)."""
        return self._strategy().forward_logits(batch["tokens"], batch.get("position_ids"))

    def validation_step(self, batch: dict, batch_idx: int):
        metrics = self._strategy().forward_backward(batch, self.forward_step, forward_only=True,
                                                    packed=self.packed_sequences)
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
