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
        parts.expressible(
            cfg, self.model_type, rope_types=("default",), moe_router_score_function="sigmoid",
            moe_router_enable_expert_bias=True,
            free=("add_qkv_bias", "qk_layernorm", "rotary_percent", "num_moe_experts", "moe_layer_freq",
                  "moe_shared_expert_intermediate_size", "moe_router_topk_scaling_factor",
                  "moe_router_num_groups", "moe_router_group_topk"))
        if cfg.moe_router_group_topk and cfg.moe_router_topk // cfg.moe_router_group_topk != 2:
            raise HFCheckpointError(f"{self.model_type} ranks expert groups by their top-2 "
                                    f"scores: needs moe_router_topk / moe_router_group_topk = 2.")
        flags = [cfg.is_moe_layer(i) for i in range(cfg.num_layers)]
        expert_ffn = cfg.moe_ffn_hidden_size or cfg.ffn_hidden_size
        shared = cfg.moe_shared_expert_intermediate_size or 0
        if sorted(flags) != flags or shared % expert_ffn:
            raise HFCheckpointError(f"{self.model_type} has its dense layers first, then MoE layers, "
                                    f"and shared experts of a multiple of moe_ffn_hidden_size.")
        limited = bool(cfg.moe_router_group_topk)
        kwargs = parts.decoder_hf(cfg)
        kwargs.pop("rope_scaling")
        return kwargs | dict(
            rope_parameters={"rope_type": "default", "rope_theta": kwargs.pop("rope_theta"),
                             "partial_rotary_factor": cfg.rotary_percent},
            attention_bias=cfg.add_qkv_bias, use_qk_norm=cfg.qk_layernorm,
            n_routed_experts=cfg.num_moe_experts, num_experts_per_tok=cfg.moe_router_topk,
            moe_intermediate_size=expert_ffn, n_shared_experts=shared // expert_ffn,
            first_k_dense_replace=flags.count(False),
            routed_scaling_factor=cfg.moe_router_topk_scaling_factor or 1.0,
            n_group=cfg.moe_router_num_groups if limited else 1,
            topk_group=cfg.moe_router_group_topk if limited else 1,
            norm_topk_prob=True, num_nextn_predict_layers=0)

    def weights(self, cfg):
        moe = [cfg.is_moe_layer(i) for i in range(cfg.num_layers)]
        table = parts.ends(cfg.tie_word_embeddings) + parts.attention(cfg.add_qkv_bias, cfg.qk_layernorm)
        if not all(moe):
            table += parts.dense_mlp()
        table += parts.experts(parts.H + "mlp.experts.{E}.") + self.router_weights(cfg)
        if cfg.moe_shared_expert_intermediate_size:
            table += parts.gated_mlp(parts.M + "mlp.shared_experts.", parts.H + "mlp.shared_experts.", size="sf")
        return table


ARCHITECTURE = Glm4Moe()
