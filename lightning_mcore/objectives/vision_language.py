"""Supervised fine-tuning of a vision-language model (Qwen2.5-VL, Qwen3-VL): SFT's assistant-only
loss over packed rows, with images through the vision encoder on the first pipeline stage
(model/vision.py). Batches come from VisionLanguageDataModule (data/multimodal.py).

`freeze` keeps parts bitwise unchanged as users of these models know them: the vision encoder
(`vit`), its merger into the decoder's width (`aligner`), the decoder (`llm`), any mix but all
three (nothing would train).

`lora` adapts the decoder's linears as for a text model and keeps every base weight frozen, the
vision encoder and merger included: a LoRA checkpoint and a PEFT adapter hold the adapters only,
so a vision encoder trained beside them would be lost. `freeze` chooses what full fine-tuning
trains and is refused with `lora` (leave it unset).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Optional, Union

from lightning_mcore import models
from lightning_mcore.generation.batched import SamplingSettings
from lightning_mcore.lora.config import LoRAConfig
from lightning_mcore.model import vision
from lightning_mcore.model.config import GPTConfig
from lightning_mcore.objectives.loss import masked_token_loss
from lightning_mcore.objectives.sft import SFTModule
from lightning_mcore.objectives.vision_generation import generate_vision_language
from lightning_mcore.strategy.optimizer import OptimizerSettings


@dataclass
class Freezing:
    """Which parts of a vision-language model full fine-tuning keeps bitwise unchanged
    (VisionLanguageSFTModule's `freeze`); not all three, or nothing would train."""

    vit: bool = False  # the vision encoder's patch embedding and blocks
    aligner: bool = False  # the merger(s) from vision features to decoder inputs
    llm: bool = False  # the decoder: embeddings, layers, final norm, output layer


class VisionLanguageSFTModule(SFTModule):
    """Supervised fine-tuning of a vision-language model (Qwen2.5-VL, Qwen3-VL) on image and
    chat data (VisionLanguageDataModule); `freeze` (Freezing) keeps chosen parts unchanged."""

    # the images of a row are not split over context-parallel ranks
    packed_context_parallel = False

    def __init__(self, model: Union[GPTConfig, str], optim: Optional[OptimizerSettings] = None,
                 model_overrides: Optional[dict] = None, lora: Optional[LoRAConfig] = None,
                 freeze: Optional[Freezing] = None) -> None:
        super().__init__(model, optim, model_overrides, lora)
        cfg = self.model_config
        if cfg.vision is None:
            raise ValueError(f"{model}: VisionLanguageSFTModule takes a vision-language model "
                             f"(e.g. Qwen2.5-VL, Qwen3-VL); this one has no vision encoder.")
        if cfg.vision.deepstack_layers and cfg.recompute_granularity == "full":
            raise ValueError(
                "model_overrides.recompute_granularity='full' is not supported with a deepstack "
                "vision encoder (its features enter the first decoder layers, which a full "
                "recompute would run without them); use 'selective' or None.")
        if lora is not None and freeze is not None:
            raise ValueError(
                f"freeze={freeze} with lora: LoRA adapts the decoder's linears and keeps every base "
                f"weight frozen, the vision encoder and merger included (its checkpoints and PEFT "
                f"adapters hold the adapters only); leave freeze unset, or train without lora.")
        self.freeze = freeze or Freezing()
        if self.freeze.vit and self.freeze.aligner and self.freeze.llm:
            raise ValueError(
                "freeze=Freezing(vit=True, aligner=True, llm=True) leaves nothing to train; "
                "unfreeze a part, or use lora to train adapters on the decoder.")

    def _adapt_chunks(self, chunks: list) -> None:
        models.attach_vision_encoders(chunks, self.model_config, self.hf_family)

    def configure_model(self) -> None:
        if self.chunks is not None:
            return
        super().configure_model()
        f = self.freeze
        vision.freeze_parts(self.chunks, vit=f.vit, aligner=f.aligner, llm=f.llm)

    def forward_step(self, batch: dict, chunk):
        token_losses = vision.forward_vision_language(chunk, batch, self.model_config.vision.image_token_id)
        return token_losses, partial(masked_token_loss, loss_mask=batch["loss_mask"])

    def predict_step(self, batch: dict, batch_idx: int):
        """Full-vocabulary logits [rows, seq, vocab] of a vision-language batch (every rank); or,
        for {"prompts": [processor outputs], "sampling": SamplingSettings (optional, greedy)},
        the completions."""
        if "prompts" in batch:
            sampling = batch.get("sampling") or SamplingSettings(greedy=True)
            return self.generate_batch(batch["prompts"], sampling)
        return vision.forward_logits(self._strategy(), self.chunks, batch, self.model_config)

    def generate(self, prompt: dict, max_new_tokens: int, stop: Optional[list[int]] = None) -> list[int]:
        """Greedy continuation of one prompt with its images (`input_ids`, `pixel_values`,
        `image_grid_thw`: the processor's output for one sample). Collective."""
        sampling = SamplingSettings(max_new_tokens=max_new_tokens, greedy=True, stop=list(stop or []))
        return self.generate_batch([prompt], sampling)[0]

    def generate_batch(self, prompts: list[dict], sampling: SamplingSettings) -> list[list[int]]:
        """Completions (new tokens only) of prompts with images, greedy or sampled (collective;
        objectives/vision_generation.py: through the KV cache, images encoded once)."""
        return generate_vision_language(self._strategy(), self.chunks, self.model_config, prompts, sampling)
