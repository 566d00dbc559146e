"""Llama (LlamaForCausalLM): GQA, RoPE (plain, linear or llama3 scaling), RMSNorm, SwiGLU, no
biases. The base the other dense families vary."""

from __future__ import annotations

from lightning_mcore.models import parts
from lightning_mcore.models.architecture import Architecture


class Llama(Architecture):
    hf_class, model_type, config_class = "LlamaForCausalLM", "llama", "LlamaConfig"
    seq_cls_class = "LlamaForSequenceClassification"
    required = ("intermediate_size",)
    scratch_order = 0
    qkv_bias = False  # q/k/v projection biases, without a config field (Qwen2)
    qk_norm = False  # per-head RMSNorm of q and k (Qwen3)

    def gpt_config(self, hf):
        return parts.decoder(hf, add_qkv_bias=self.qkv_bias, qk_layernorm=self.qk_norm)

    def hf_config(self, cfg):
        parts.expressible(cfg, self.model_type, add_qkv_bias=self.qkv_bias,
                          qk_layernorm=self.qk_norm)
        return parts.decoder_hf(cfg)

    def weights(self, cfg):
        return (parts.ends(cfg.tie_word_embeddings) + parts.attention(self.qkv_bias, self.qk_norm)
                + parts.dense_mlp())


ARCHITECTURE = Llama()
