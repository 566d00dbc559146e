"""Qwen2 (Qwen2ForCausalLM): a Llama with q/k/v biases (no o_proj bias, no config field), and
a sliding window only with `use_sliding_window`, on the layers `layer_types` names (else on
those from `max_window_layers` on), as transformers 5 reads it."""

from __future__ import annotations

from lightning_mcore.models import parts
from lightning_mcore.models.llama import Llama


class Qwen2(Llama):
    hf_class, model_type, config_class = "Qwen2ForCausalLM", "qwen2", "Qwen2Config"
    seq_cls_class = "Qwen2ForSequenceClassification"
    required = ("intermediate_size", "num_key_value_heads")
    qkv_bias = True

    def gpt_config(self, hf):
        return super().gpt_config(hf) | self.window(hf)

    def window(self, hf) -> dict:
        """GPTConfig window fields (none without use_sliding_window: transformers drops it)."""
        if not hf.get("use_sliding_window"):
            return {}
        return parts.sliding_window(hf, lambda layer: layer >= hf["max_window_layers"])

    def hf_config(self, cfg):
        parts.expressible(cfg, self.model_type, free=("sliding_window", "layer_types"),
                          add_qkv_bias=self.qkv_bias, qk_layernorm=self.qk_norm)
        return parts.decoder_hf(cfg) | parts.sliding_window_hf(cfg)


ARCHITECTURE = Qwen2()
