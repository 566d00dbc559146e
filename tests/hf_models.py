"""Tiny random Hugging Face models of each supported family, saved with save_pretrained."""

from __future__ import annotations

import copy
from pathlib import Path

import torch
import transformers as tf

from lightning_mcore.verify import relative_diff  # verify's measure

COMMON = dict(vocab_size=200, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)

FAMILIES = {
    "llama": lambda: (tf.LlamaConfig, tf.LlamaForCausalLM, dict(
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 32})),
    "llama_tied": lambda: (tf.LlamaConfig, tf.LlamaForCausalLM, dict(tie_word_embeddings=True)),
    "qwen2": lambda: (tf.Qwen2Config, tf.Qwen2ForCausalLM, dict()),
    # The README's example of a one-file family (lightning_mcore/models/seed_oss.py).
    "seed_oss": lambda: (tf.SeedOssConfig, tf.SeedOssForCausalLM, dict(
        head_dim=16, attention_dropout=0.0, residual_dropout=0.0)),
    "qwen3": lambda: (tf.Qwen3Config, tf.Qwen3ForCausalLM, dict(head_dim=24)),
    "mistral": lambda: (tf.MistralConfig, tf.MistralForCausalLM, dict(sliding_window=None)),
    "mistral_window": lambda: (tf.MistralConfig, tf.MistralForCausalLM, dict(sliding_window=8)),
    "qwen2_window": lambda: (tf.Qwen2Config, tf.Qwen2ForCausalLM, dict(
        use_sliding_window=True, sliding_window=8, max_window_layers=2)),
    "qwen3_moe_window": lambda: (tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM, dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
        use_sliding_window=True, sliding_window=8)),
    "qwen3_moe": lambda: (tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM, dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)),
    "mixtral": lambda: (tf.MixtralConfig, tf.MixtralForCausalLM, dict(
        num_local_experts=4, num_experts_per_tok=2, sliding_window=None)),
    "mixtral_window": lambda: (tf.MixtralConfig, tf.MixtralForCausalLM, dict(
        num_local_experts=4, num_experts_per_tok=2, sliding_window=8)),
    # Layer 2 dense (mlp_only_layers, intermediate_size); top-k probs not renormalised.
    "qwen2_moe": lambda: (tf.Qwen2MoeConfig, tf.Qwen2MoeForCausalLM, dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, mlp_only_layers=[2], norm_topk_prob=False)),
    # Layers 1 and 3 sparse (decoder_sparse_step), renormalised top-k, no q/k/v biases.
    "qwen2_moe_step": lambda: (tf.Qwen2MoeConfig, tf.Qwen2MoeForCausalLM, dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, decoder_sparse_step=2, norm_topk_prob=True,
        qkv_bias=False)),
    # local and global layers on both PP=2 stages; head_dim and query_pre_attn_scalar differ
    "gemma3": lambda: (tf.Gemma3TextConfig, tf.Gemma3ForCausalLM, dict(
        head_dim=24, query_pre_attn_scalar=32, sliding_window=8,
        layer_types=["sliding_attention", "full_attention", "full_attention", "sliding_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0}})),
    # Gated DeltaNet and gated softmax attention alternating (both kinds on each PP=2 stage),
    # 2 value heads per key head, RoPE on a quarter of each head.
    "qwen3_5": lambda: (tf.Qwen3_5TextConfig, tf.Qwen3_5ForCausalLM, dict(LINEAR_ATTENTION, head_dim=16)),
    "qwen3_5_moe": lambda: (tf.Qwen3_5MoeTextConfig, tf.Qwen3_5MoeForCausalLM, dict(
        **LINEAR_ATTENTION, **QWEN_NEXT_MOE, head_dim=16)),
    # in_proj_qkvz / in_proj_ba per key head; layer 2 dense, top-k not renormalised
    "qwen3_next": lambda: (tf.Qwen3NextConfig, tf.Qwen3NextForCausalLM, dict(
        **LINEAR_ATTENTION, **QWEN_NEXT_MOE, head_dim=16, mlp_only_layers=[2], norm_topk_prob=False)),
    # q/k/v biases, q/k norms, RoPE on half of each head; DeepSeek-V3's router (2 groups of 2
    # experts, one chosen), one dense layer first, a shared expert
    "glm4_moe": lambda: (tf.Glm4MoeConfig, tf.Glm4MoeForCausalLM, dict(
        head_dim=16, attention_bias=True, use_qk_norm=True, n_routed_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1, n_group=2, topk_group=1,
        routed_scaling_factor=2.5, num_nextn_predict_layers=0)),
    # Sinks, q/k/v/o biases, windowed and full layers alternating (both on each PP=2 stage),
    # YaRN with unrounded correction range; router and experts with biases, a swiglu_limit the
    # tiny model's activations cross (so the clamp acts)
    "gpt_oss": lambda: (tf.GptOssConfig, tf.GptOssForCausalLM, dict(
        head_dim=16, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
        sliding_window=8, swiglu_limit=0.2, rope_parameters={
            "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32.0,
            "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64})),
    # q/k norms over all heads together, RoPE on half of each head (rotary_dim), a sigmoid
    # router with its correction bias, no shared expert
    "minimax_m2": lambda: (tf.MiniMaxM2Config, tf.MiniMaxM2ForCausalLM, dict(
        head_dim=16, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
        bos_token_id=1, eos_token_id=2,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})),
    # fused qkv_proj and gate_up_proj, RoPE on three quarters of each head (Phi-4-mini), windows
    "phi3": lambda: (tf.Phi3Config, tf.Phi3ForCausalLM, dict(
        head_dim=16, sliding_window=8, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75})),
    # Multi-latent attention, YaRN, 1 dense layer then MoE with a shared expert; V3: sigmoid
    # router with a (randomised) bias, 2 groups of 2 experts, one group chosen.
    "deepseek_v3": lambda: (tf.DeepseekV3Config, tf.DeepseekV3ForCausalLM, dict(DEEPSEEK, **YARN)),
    "deepseek_v3_noq": lambda: (tf.DeepseekV3Config, tf.DeepseekV3ForCausalLM, dict(
        DEEPSEEK, q_lora_rank=None, rope_interleave=False, rope_parameters=dict(
            YARN["rope_parameters"], mscale=1.0, mscale_all_dim=1.0))),
    "deepseek_v2": lambda: (tf.DeepseekV2Config, tf.DeepseekV2ForCausalLM, dict(
        DEEPSEEK, q_lora_rank=None, n_group=None, topk_group=None, norm_topk_prob=False)),
}
LINEAR_ATTENTION = dict(linear_key_head_dim=8, linear_value_head_dim=12, linear_num_key_heads=2,
                        linear_num_value_heads=4, layer_types=["linear_attention", "full_attention"] * 2)
QWEN_NEXT_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                     shared_expert_intermediate_size=48)
DEEPSEEK = dict(num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=32, qk_nope_head_dim=16,
                qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2,
                n_group=2, topk_group=1, n_shared_experts=1, moe_intermediate_size=32,
                first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
                num_nextn_predict_layers=0, rms_norm_eps=1e-2)  # the q/kv latent norms keep 1e-6
YARN = dict(rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                             "original_max_position_embeddings": 64, "beta_fast": 32,
                             "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.8})


def hf_config_dict(name: str) -> dict:
    """config.json contents of the tiny model of family `name` (no weights)."""
    config_cls, model_cls, extra = FAMILIES[name]()
    return config_cls(**{**COMMON, **extra}, architectures=[model_cls.__name__]).to_dict()


def make_hf_model(name: str, directory: Path, seed: int = 0, **overrides):
    """Save a tiny random model of family `name` (config fields `overrides` changed) in
    `directory`; return the transformers model."""
    config_cls, model_cls, extra = FAMILIES[name]()
    torch.manual_seed(seed)
    config = config_cls(**{**COMMON, **extra, **overrides})
    model = model_cls(config).eval()
    with torch.no_grad():  # random non-trivial norms and biases, so mapping mistakes show
        for n, p in model.named_parameters():
            if p.dim() == 1 or n.endswith("shared_expert_gate.weight"):
                p.normal_(1.0 if "norm" in n else 0.0, 0.1)
        for n, b in model.named_buffers():
            if n.endswith("e_score_correction_bias"):  # DeepSeek-V3's (MiniMax-M2's) routing bias
                b.normal_(0.0, 0.1)
    model.save_pretrained(directory)
    return model


def add_mtp_layer(source: Path) -> tuple[str]:
    """What DeepSeek-V3 and GLM-4.5 publish: one more decoder layer's tensors after the last
    (some of them here, and an MTP projection in bf16 beside the fp32 model, so that a
    conversion would show), announced by num_nextn_predict_layers. transformers ignores them by
    the real models' layer numbers (61; 46, 92): returns what the tiny model's reload reports
    unexpected."""
    import json

    from safetensors.torch import load_file, save_file

    config = json.loads((source / "config.json").read_text())
    last, mtp = config["num_hidden_layers"] - 1, f"model.layers.{config['num_hidden_layers']}."
    weights = load_file(source / "model.safetensors")
    gen = torch.Generator().manual_seed(3)
    for name in [n for n in weights if n.startswith(f"model.layers.{last}.")][:6]:
        weights[name.replace(f"model.layers.{last}.", mtp)] = torch.randn(weights[name].shape, generator=gen)
    weights[mtp + "eh_proj.weight"] = torch.randn(64, 128, generator=gen).to(torch.bfloat16)
    save_file(weights, source / "model.safetensors", metadata={"format": "pt"})
    (source / "config.json").write_text(json.dumps(config | {"num_nextn_predict_layers": 1}))
    return (mtp,)


def hf_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=tokens).logits.float()


def bf16_tolerance(model, tokens: torch.Tensor, floor: float = 0.1) -> float:
    """What a bf16 run may be off from transformers' fp32 logits: verify's bf16 tolerance, or
    1.5x transformers' own model in bf16 where that is further off (Gemma 3's tiny model: 0.096,
    the other families 0.005-0.03)."""
    own = relative_diff(hf_logits(copy.deepcopy(model).to(torch.bfloat16), tokens),
                               hf_logits(model, tokens))
    return max(floor, 1.5 * own)
