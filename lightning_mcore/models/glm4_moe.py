"""GLM-4.5 / 4.6 / 4.5-Air (Glm4MoeForCausalLM): GQA attention with q/k/v biases (no o_proj
bias) when attention_bias, optional per-head q/k RMSNorms (use_qk_norm), RoPE on the first
partial_rotary_factor of each head; the first `first_k_dense_replace` layers dense, the others
DeepSeek-V3's mixture of experts (models/deepseek_v3.py: sigmoid router with the
e_score_correction_bias, group-limited top-k, routed_scaling_factor, always-on shared experts).
The published multi-token-prediction layers (model.layers.<num_hidden_layers + i>.*,
num_nextn_predict_layers of them) are carried through to exports untouched (not trained)."""

from __future__ import annotations

from lightning_mcore.hf.config import HFCheckpointError
from lightning_mcore.models import parts
from lightning_mcore.models.deepseek_v3 import DeepseekV3


class Glm4Moe(DeepseekV3):
    hf_class, model_type, config_class = "Glm4MoeForCausalLM", "glm4_moe", "Glm4MoeConfig"
    required = ("intermediate_size", "moe_intermediate_size", "n_routed_experts",
                "num_experts_per_tok", "num_key_value_heads", "head_dim")

    def attention(self, hf):
        return parts.decoder(hf, rope_types=("default",), partial_rotary=True,
                             add_qkv_bias=bool(hf.get("attention_bias")),
                             qk_layernorm=bool(hf.get("use_qk_norm")))

    def hf_config(self, cfg):
        if cfg.mla is not None or not cfg.num_moe_experts:
            raise HFCheckpointError(f"{self.model_type} needs GQA attention (no GPTConfig.mla) "
                                    f"and num_moe_experts.")
        self.expressible_moe(cfg)
        parts.expressible(
            cfg, self.model_type, rope_types=("default",), moe_router_score_function="sigmoid",
            moe_router_enable_expert_bias=True,
            free=("add_qkv_bias", "qk_layernorm", "rotary_percent", "num_moe_experts", "moe_layer_freq",
                  "moe_shared_expert_intermediate_size", "moe_router_topk_scaling_factor",
                  "moe_router_num_groups", "moe_router_group_topk"))
        return parts.decoder_hf(cfg, partial_rotary=True) | self.experts_hf(cfg) | self.router_hf(cfg) | dict(
            attention_bias=cfg.add_qkv_bias, use_qk_norm=cfg.qk_layernorm, num_nextn_predict_layers=0)

    def weights(self, cfg):
        return (parts.ends(cfg.tie_word_embeddings) + parts.attention(cfg.add_qkv_bias, cfg.qk_layernorm)
                + self.mlp_weights(cfg))


ARCHITECTURE = Glm4Moe()
