"""Qwen3.5-MoE with its vision tower (Qwen3_5MoeForConditionalGeneration, model_type
qwen3_5_moe; the published checkpoints): Qwen3.5's vision-language layout (models/qwen3_5_vl.py)
around the MoE hybrid decoder of models/qwen3_5_moe.py."""

from __future__ import annotations

from lightning_mcore.models.qwen3_5_moe import ARCHITECTURE as QWEN3_5_MOE
from lightning_mcore.models.qwen3_5_vl import Qwen3_5_VL


class Qwen3_5_MoE_VL(Qwen3_5_VL):
    hf_class, model_type, config_class = ("Qwen3_5MoeForConditionalGeneration", "qwen3_5_moe",
                                          "Qwen3_5MoeConfig")
    text_family = QWEN3_5_MOE
    vision_class, vision_config_class = "Qwen3_5MoeVisionModel", "Qwen3_5MoeVisionConfig"
    peft_misreads_mlp = QWEN3_5_MOE.peft_misreads_mlp


ARCHITECTURE = Qwen3_5_MoE_VL()
