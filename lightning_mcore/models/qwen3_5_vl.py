"""Qwen3.5 with its vision tower (Qwen3_5ForConditionalGeneration, model_type qwen3_5; the
published checkpoints): the hybrid decoder of models/qwen3_5.py with interleaved multimodal RoPE on their partial
rotary dims, behind a ViT and merger (no deepstack). Checkpoints keep transformers 5's layout:
`model.language_model.*`, `model.visual.*`, `lm_head.weight`, and the published MTP layer
`mtp.*`, carried to exports unchanged."""

from __future__ import annotations

from lightning_mcore.models.qwen3_5 import ARCHITECTURE as QWEN3_5
from lightning_mcore.models.vision_language import VisionLanguage


class Qwen3_5_VL(VisionLanguage):
    hf_class, model_type, config_class = "Qwen3_5ForConditionalGeneration", "qwen3_5", "Qwen3_5Config"
    required = ("intermediate_size", "num_key_value_heads", "head_dim")
    scratch_order = 90
    text_family = QWEN3_5
    vision_class, vision_config_class = "Qwen3_5VisionModel", "Qwen3_5VisionConfig"
    text_prefix, vision_prefix = "model.language_model.", "model.visual."
    mrope_interleaved = True

    def carried(self, hf):  # `hf`: the text config (models.carried)
        return self.text_family.carried(hf)


ARCHITECTURE = Qwen3_5_VL()
