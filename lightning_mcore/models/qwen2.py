"""Qwen2 (Qwen2ForCausalLM): a Llama with q/k/v biases (no o_proj bias, no config field)."""

from __future__ import annotations

from lightning_mcore.models.llama import Llama


class Qwen2(Llama):
    hf_class, model_type, config_class = "Qwen2ForCausalLM", "qwen2", "Qwen2Config"
    required = ("intermediate_size", "num_key_value_heads")
    qkv_bias = True

    def gpt_config(self, hf):
        if hf.get("use_sliding_window"):
            hf.refuse("use_sliding_window", "sliding-window attention is not supported.")
        return super().gpt_config(hf)


ARCHITECTURE = Qwen2()
