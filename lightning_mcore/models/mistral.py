"""Mistral (MistralForCausalLM): a Llama with a sliding window when `sliding_window` is set."""

from __future__ import annotations

from lightning_mcore.models import parts
from lightning_mcore.models.llama import Llama


class Mistral(Llama):
    hf_class, model_type, config_class = "MistralForCausalLM", "mistral", "MistralConfig"
    seq_cls_class = "MistralForSequenceClassification"
    required = ("intermediate_size", "num_key_value_heads")  # transformers' default is 8

    def gpt_config(self, hf):
        return super().gpt_config(hf) | dict(sliding_window=hf.get("sliding_window"))

    def hf_config(self, cfg):
        parts.expressible(cfg, self.model_type, free=("sliding_window",))
        return parts.decoder_hf(cfg) | dict(sliding_window=cfg.sliding_window)


ARCHITECTURE = Mistral()
