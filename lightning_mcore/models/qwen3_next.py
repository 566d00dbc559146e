"""Qwen3-Next (Qwen3NextForCausalLM): Qwen3.5-MoE's hybrid stack (models/qwen3_5_moe.py) with
the linear-attention projections fused per key head (in_proj_qkvz = [q k v z] and in_proj_ba
= [b a] for each key head, reordered on load and export), top-k renormalisation only with
norm_topk_prob, and dense MLPs of intermediate_size on the layers mlp_only_layers names or
off the decoder_sparse_step rhythm (Qwen2-MoE's rule)."""

from __future__ import annotations

from lightning_mcore.models import parts
from lightning_mcore.models.qwen3_5_moe import Qwen3_5Moe


class Qwen3Next(Qwen3_5Moe):
    hf_class, model_type, config_class = "Qwen3NextForCausalLM", "qwen3_next", "Qwen3NextConfig"
    required = Qwen3_5Moe.required + ("intermediate_size",)
    grouped_in_proj = True
    moe_fields = Qwen3_5Moe.moe_fields + ("moe_layer_freq", "moe_router_pre_softmax")

    def experts(self, hf) -> dict:
        return parts.moe(hf, hf["num_experts"], moe_layer_freq=parts.sparse_layers(hf),
                         moe_shared_expert_intermediate_size=hf["shared_expert_intermediate_size"],
                         moe_shared_expert_gate=True)

    def hf_config(self, cfg):
        kwargs = self.hybrid_hf(cfg, free=self.moe_fields)
        if not cfg.num_moe_experts or not cfg.moe_shared_expert_intermediate_size or not cfg.moe_shared_expert_gate:
            raise parts.HFCheckpointError(f"{self.model_type} needs num_moe_experts and a gated shared expert.")
        return kwargs | parts.moe_hf(cfg) | parts.sparse_layers_hf(cfg) | dict(
            num_experts=cfg.num_moe_experts,
            shared_expert_intermediate_size=cfg.moe_shared_expert_intermediate_size)

    def mlp(self, cfg):
        dense = [] if all(cfg.is_moe_layer(i) for i in range(cfg.num_layers)) else parts.dense_mlp()
        return dense + super().mlp(cfg)


ARCHITECTURE = Qwen3Next()
