"""The LightningModule base every objective shares: builds the chunks, steps through the strategy.

An objective only says how one microbatch goes through a model chunk and what its loss is
(`forward_step`); the strategy owns parallelism, microbatching and the optimizer.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Optional, Union

import lightning as L
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_mcore import models
from lightning_mcore.generation import batched
from lightning_mcore.generation.forward_logits import forward_logits
from lightning_mcore.hf.export import export_hf
from lightning_mcore.hf.load import load_hf_weights
from lightning_mcore.hf.peft_export import export_peft
from lightning_mcore.lora.adapters import apply_lora, set_merged
from lightning_mcore.lora.checks import expert_backend_for_lora
from lightning_mcore.lora.config import LoRAConfig
from lightning_mcore.lora.quantized_base import CODECS
from lightning_mcore.model.build import build_chunks  # here, not in the ranks: forked ones share it
from lightning_mcore.model.config import GPTConfig
from lightning_mcore.model.init import init_layout_invariant
from lightning_mcore.objectives.console import count_parameters, replacing_defaults
from lightning_mcore.strategy import checkpoint_io
from lightning_mcore.strategy.megatron import MegatronStrategy
from lightning_mcore.strategy.optimizer import OptimizerSettings


class MegatronModule(L.LightningModule):
    """The LightningModule every objective builds on: it builds the mcore GPT model for
    MegatronStrategy, loads its weights, runs each step through the strategy and exports to
    Hugging Face; a subclass gives the loss (forward_step).

    `model` is a GPTConfig (train from scratch), the path of a Hugging Face checkpoint
    directory (its config.json gives the architecture, its safetensors the weights), or a
    checkpoint directory saved by MegatronStrategy (fine-tuning: its weights only, at any
    layout; the optimizer, step count and data position start fresh). `model_overrides`
    changes config fields (e.g. seq_length). `lora` trains low-rank adapters on the frozen
    model; its checkpoints then hold the adapters (and their optimizer state) only."""

    def __init__(
        self,
        model: Union[GPTConfig, str],
        optim: Optional[OptimizerSettings] = None,
        model_overrides: Optional[dict] = None,
        lora: Optional[LoRAConfig] = None,
    ) -> None:
        super().__init__()

        # hf_path: the HF directory behind the model (tokenizer and config travel into exports);
        # init_checkpoint: a MegatronStrategy checkpoint whose weights the model starts from.
        self.hf_path: Optional[str] = None
        self.init_checkpoint: Optional[str] = None
        # tokenizer_path: the data's tokenizer directory, for exports of a model with no HF
        # source (set from the datamodule at setup, kept in checkpoints).
        self.tokenizer_path: Optional[str] = None
        if isinstance(model, (str, os.PathLike)) and checkpoint_io.is_checkpoint(model):
            saved = checkpoint_io.read_saved_model(model)
            if saved.head != self.output_head:
                raise ValueError(f"{model} holds a model with a {saved.head!r} head; {type(self).__name__} "
                                 f"takes one with a {self.output_head!r} head (export it to HF to change heads).")
            self.init_checkpoint, self.hf_path, self.hf_family = str(model), saved.hf_path, saved.hf_family
            self.tokenizer_path = saved.tokenizer_path
            # routers that record and replay, and fp32 logits, are the objective's choice (GRPO's),
            # not the weights'
            self.model_config = dataclasses.replace(saved.config, **{"moe_routing_replay": False,
                                                                     "fp32_logits": False,
                                                                     **(model_overrides or {})})
        elif isinstance(model, (str, os.PathLike)):
            self.hf_path = str(model)
            self.model_config, self.hf_family = models.gpt_config_from_hf(model, **(model_overrides or {}))
        elif isinstance(model, GPTConfig):
            if model_overrides:
                model = dataclasses.replace(model, **model_overrides)
            self.model_config, self.hf_family = model, models.family_of(model)
        else:
            raise TypeError(
                f"model must be a GPTConfig, a Hugging Face checkpoint directory or a "
                f"MegatronStrategy checkpoint directory, got {type(model).__name__}."
            )
        self.optim = optim or OptimizerSettings()
        self.lora = lora  # LoRA adapters on the frozen base (lora/adapters.py), or None
        self.model_config = expert_backend_for_lora(lora, self.model_config)
        self.chunks: Optional[torch.nn.ModuleList] = None

    def _strategy(self):
        strategy = self.trainer.strategy
        if not isinstance(strategy, MegatronStrategy):
            raise TypeError(
                f"{type(self).__name__} runs under lightning_mcore.MegatronStrategy, got "
                f"{type(strategy).__name__}: pass Trainer(strategy=MegatronStrategy(...))."
            )
        return strategy

    def setup(self, stage: str) -> None:
        tokenizer = getattr(getattr(self.trainer.datamodule, "hparams", None), "tokenizer", None)
        if isinstance(tokenizer, (str, os.PathLike)) and os.path.isdir(tokenizer):
            self.tokenizer_path = str(tokenizer)

    def configure_callbacks(self) -> list[L.Callback]:
        """Our progress bar and model summary in place of Lightning's defaults (objectives/
        console.py): a Python run shows steps of max_steps and the whole model, as the CLI."""
        return replacing_defaults(self.trainer.callbacks)

    def configure_model(self) -> None:
        if self.chunks is not None:
            return
        strategy = self._strategy()
        chunks = self._build_chunks(strategy)
        if self.lora is not None:
            errors = apply_lora(chunks, self.lora, strategy.seed)
            if errors:  # a quantized base: how far its dequantized weights are from the loaded ones
                self.base_quantization_error = errors
                rank_zero_info(f"LoRA base in {self.lora.base_precision} "
                               f"({CODECS[self.lora.base_precision].description}); relative error "
                               "against the loaded weights: "
                               + ", ".join(f"{k} {v:.4f}" for k, v in errors.items()) + ".")
            trainable = count_parameters(chunks, trainable_only=True)
            total = count_parameters(chunks)
            rank_zero_info(f"LoRA: {trainable:,} trainable parameters, {total:,} in the model "
                           f"({100 * trainable / total:.3f}%).")
            self.lora_trainable_parameters = trainable
        self.chunks = torch.nn.ModuleList(chunks)

    def _build_chunks(self, strategy, source=None) -> list:
        """This rank's GPTModel chunks on its device: weights read from one of our checkpoints
        or an HF checkpoint (only this rank's slices, any saved layout), or drawn so that they
        do not depend on the parallel layout. `source`: another model built the same way (a
        distillation teacher), anything with model_config, hf_family, hf_path, init_checkpoint."""
        source = self if source is None else source
        cfg = source.model_config
        tp = strategy.parallel.tensor_model_parallel_size
        strategy.refuse_unbuildable(cfg)
        if source.init_checkpoint is not None:
            checkpoint_io.read_common(source.init_checkpoint, cfg, tp)
        tf_config = strategy.transformer_config(cfg)
        with strategy.mcore_context():
            chunks = build_chunks(cfg, tf_config, strategy.uses_te(cfg))
            if source is self:  # a teacher is a plain language model
                self._adapt_chunks(chunks)
            for chunk in chunks:
                chunk.to(strategy.root_device)
            if source.init_checkpoint is not None:
                checkpoint_io.load_model(source.init_checkpoint, chunks)
            elif source.hf_path is None:
                init_layout_invariant(chunks, cfg, strategy.seed)
            else:
                table = self._import_weights() if source is self else models.weights(cfg, source.hf_family)
                load_hf_weights(chunks, source.hf_path, cfg, table, cfg.padded_vocab_size(tp),
                                carried=models.carried(source.hf_family, source.hf_path))
        return chunks

    def save_hf_checkpoint(self, directory, max_shard_bytes: int = 5 * 2**30, mode: str = "full",
                           overwrite: bool = False, lora_experts_layout: Optional[str] = None):
        """Write the model as a Hugging Face directory (collective: call on every rank).

        `mode`: "full" (the model as trained: with LoRA, adapters merged into a copy of the
        weights), "merged" (the same, LoRA only) or "peft" (the LoRA adapter directory).
        `lora_experts_layout` (PEFT with adapters on routed experts): "fused" (default; peft's
        target_parameters on transformers 5's fused experts) or "per_expert" (vLLM's names).
        `directory` must be new or empty; `overwrite` replaces an earlier export (never other
        files: hf/export_dir.py)."""
        layout = self.check_hf_export(mode, lora_experts_layout)
        strategy = self._strategy()
        strategy.refuse_nonfinite_weights(f"the HF export {directory}")
        strategy.sync_weights()
        chunks = list(self.chunks)
        padded = self.model_config.padded_vocab_size(strategy.parallel.tensor_model_parallel_size)
        protected = [self.init_checkpoint]
        if mode == "peft":
            weights, scope = models.peft_weights(self.model_config, self.hf_family)
            return export_peft(chunks, self.model_config, weights, self.lora, directory,
                               base_model=self.hf_path, overwrite=overwrite, protected=protected,
                               tokenizer_dir=self.tokenizer_path,
                               fused_experts=models.peft_experts(self.model_config, self.hf_family),
                               experts=layout, scope=scope)
        set_merged(chunks, True)
        try:
            return export_hf(chunks, self.model_config, self._weights(),
                             models.export_config(self.model_config, self.hf_family, self.hf_path),
                             directory, padded,
                             source_dir=self.hf_path, max_shard_bytes=max_shard_bytes,
                             overwrite=overwrite, tokenizer_dir=self.tokenizer_path,
                             protected=protected, carried=models.carried(self.hf_family, self.hf_path),
                             lora_base_precision=self.lora.base_precision if self.lora else None)
        finally:
            set_merged(chunks, False)

    def check_hf_export(self, mode: str, lora_experts_layout: Optional[str] = None) -> str:
        """Refuse, before training or writing, an export of `mode` this model cannot produce (no
        adapters, an expert layout it cannot hold) or that peft would load wrong; return the
        layout of the expert adapters to write (save_hf_checkpoint's arguments)."""
        if mode not in ("full", "merged", "peft"):
            raise ValueError(f"mode must be 'full', 'merged' or 'peft', got {mode!r}.")
        if mode != "full" and self.lora is None:
            raise ValueError(f"mode={mode!r} needs LoRA adapters on the model; use mode='full'.")
        return models.export_layout(self.model_config, self.hf_family, self.lora, mode, lora_experts_layout)

    def _weights(self):
        return models.weights(self.model_config, self.hf_family)

    def _adapt_chunks(self, chunks: list) -> None:
        """Change the freshly built chunks before weights go in (e.g. a reward model's head)."""

    def _import_weights(self):
        """The weight table an HF checkpoint is read by."""
        return self._weights()

    def configure_optimizers(self):
        return self._strategy().megatron_optimizer(self.optim)

    # A module whose forward_step sends microbatches as packed THD rows sets this.
    packed_sequences: bool = False
    # What the last stage ends in, recorded in checkpoints: "lm" (the output layer), "score".
    output_head: str = "lm"

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

    def forward_logits(self, tokens: torch.Tensor, position_ids: Optional[torch.Tensor] = None):
        """Full-vocabulary logits [batch, seq, vocab] of `tokens`, on every rank (collective)."""
        return forward_logits(self._strategy, self.chunks, tokens, self.model_config, position_ids)

    def generate(self, prompt: list[int], max_new_tokens: int, stop: Optional[list[int]] = None) -> list[int]:
        """Greedy continuation of one prompt (KV cache). Collective: call on every rank; every
        rank returns the same tokens. Stops after any token in `stop` (kept)."""
        return batched.generate(self._strategy, self.chunks, prompt, max_new_tokens, self.model_config, stop)

    def generate_batch(self, prompts: list[list[int]],
                       sampling: batched.SamplingSettings) -> list[list[int]]:
        """Completions (new tokens only) of `prompts`, greedy or sampled (collective)."""
        return batched.generate_batch(self._strategy, self.chunks, prompts, self.model_config, sampling)

    def predict_step(self, batch: dict, batch_idx: int):
        """Full-vocabulary logits [batch, seq, vocab] of batch["tokens"] (on every rank); or, for
        a batch {"prompts": [[ids]], "sampling": SamplingSettings (optional, greedy)}, the completions."""
        if "prompts" in batch:
            sampling = batch.get("sampling") or batched.SamplingSettings(greedy=True)
            return self.generate_batch(batch["prompts"], sampling)
        return self.forward_logits(batch["tokens"], batch.get("position_ids"))

    def validation_step(self, batch: dict, batch_idx: int):
        metrics = self._strategy().forward_backward(batch, self.forward_step, forward_only=True,
                                                    packed=self.packed_sequences)
        self.log_dict({f"val/{k}": v for k, v in metrics.items()}, prog_bar=True, batch_size=1)
        return metrics["loss"]

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        optimizer = self.optimizers(use_pl_optimizer=False)
        logs = {"train/lr": optimizer.lr}
        if optimizer.last_grad_norm is not None:
            logs["train/grad_norm"] = optimizer.last_grad_norm
        if optimizer.on_nonfinite == "skip":
            logs["train/skipped_update"] = float(optimizer.last_update_skipped)
        # CPU tensors: Lightning would copy a float to the GPU, a wait for the update just queued
        self.log_dict({k: torch.tensor(v) for k, v in logs.items()}, batch_size=1)
