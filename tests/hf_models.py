"""Tiny random Hugging Face models of each supported family, saved with save_pretrained."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers as tf

COMMON = dict(vocab_size=200, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)

FAMILIES = {
    "llama": lambda: (tf.LlamaConfig, tf.LlamaForCausalLM, dict(
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 32})),
    "llama_tied": lambda: (tf.LlamaConfig, tf.LlamaForCausalLM, dict(tie_word_embeddings=True)),
    "qwen2": lambda: (tf.Qwen2Config, tf.Qwen2ForCausalLM, dict()),
    "qwen3": lambda: (tf.Qwen3Config, tf.Qwen3ForCausalLM, dict(head_dim=24)),
    "mistral": lambda: (tf.MistralConfig, tf.MistralForCausalLM, dict(sliding_window=None)),
    "qwen3_moe": lambda: (tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM, dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)),
}


def hf_config_dict(name: str) -> dict:
    """config.json contents of the tiny model of family `name` (no weights)."""
    config_cls, model_cls, extra = FAMILIES[name]()
    return config_cls(**{**COMMON, **extra}, architectures=[model_cls.__name__]).to_dict()


def make_hf_model(name: str, directory: Path, seed: int = 0):
    """Save a tiny random model of family `name` in `directory`; return the transformers model."""
    config_cls, model_cls, extra = FAMILIES[name]()
    torch.manual_seed(seed)
    config = config_cls(**{**COMMON, **extra})
    model = model_cls(config).eval()
    with torch.no_grad():  # random non-trivial norms and biases, so mapping mistakes show
        for n, p in model.named_parameters():
            if p.dim() == 1:
                p.normal_(1.0 if "norm" in n else 0.0, 0.1)
    model.save_pretrained(directory)
    return model


def hf_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=tokens).logits.float()
