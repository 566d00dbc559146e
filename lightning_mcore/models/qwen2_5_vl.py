"""Qwen2.5-VL (Qwen2_5_VLForConditionalGeneration): a Qwen2 decoder with sectioned multimodal
RoPE behind a windowed-attention ViT + patch merger. Checkpoints keep the hub layout:
`model.layers.*` (decoder), `visual.*` (encoder), `lm_head.weight`."""

from __future__ import annotations

from lightning_mcore.models.qwen2 import ARCHITECTURE as QWEN2
from lightning_mcore.models.vision_language import VisionLanguage


class Qwen2_5_VL(VisionLanguage):
    hf_class, model_type, config_class = ("Qwen2_5_VLForConditionalGeneration", "qwen2_5_vl",
                                          "Qwen2_5_VLConfig")
    required = ("intermediate_size", "num_key_value_heads")
    scratch_order = 90
    text_family = QWEN2
    vision_class, vision_config_class = "Qwen2_5_VisionTransformerPretrainedModel", "Qwen2_5_VLVisionConfig"
    text_prefix, vision_prefix = "model.", "visual."


ARCHITECTURE = Qwen2_5_VL()
