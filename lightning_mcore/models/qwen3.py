"""Qwen3 (Qwen3ForCausalLM): a Llama with per-head q/k RMSNorm and an explicit head_dim."""

from __future__ import annotations

from lightning_mcore.models.qwen2 import Qwen2


class Qwen3(Qwen2):
    hf_class, model_type, config_class = "Qwen3ForCausalLM", "qwen3", "Qwen3Config"
    seq_cls_class = "Qwen3ForSequenceClassification"
    required = ("intermediate_size", "num_key_value_heads", "head_dim")
    qkv_bias, qk_norm = False, True


ARCHITECTURE = Qwen3()
