"""Qwen3-VL (Qwen3VLForConditionalGeneration): a Qwen3 decoder with interleaved multimodal RoPE
behind a ViT whose inner layers also feed the first decoder layers (deepstack). Checkpoints keep
transformers 5's layout: `model.language_model.*`, `model.visual.*`, `lm_head.weight`."""

from __future__ import annotations

from lightning_mcore.models.qwen3 import ARCHITECTURE as QWEN3
from lightning_mcore.models.vision_language import VisionLanguage


class Qwen3_VL(VisionLanguage):
    hf_class, model_type, config_class = "Qwen3VLForConditionalGeneration", "qwen3_vl", "Qwen3VLConfig"
    required = ("intermediate_size", "num_key_value_heads", "head_dim")
    scratch_order = 90
    text_family = QWEN3
    vision_class, vision_config_class = "Qwen3VLVisionModel", "Qwen3VLVisionConfig"
    text_prefix, vision_prefix = "model.language_model.", "model.visual."
    mrope_interleaved = True


ARCHITECTURE = Qwen3_VL()
