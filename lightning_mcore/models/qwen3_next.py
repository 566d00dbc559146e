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
        return parts.gated_shared_expert(hf, moe_layer_freq=parts.sparse_layers(hf))

    def hf_config(self, cfg):
        moe = parts.gated_shared_expert_hf(cfg, self.model_type)
        return self.hybrid_hf(cfg, free=self.moe_fields) | moe | parts.sparse_layers_hf(cfg)

    def mlp(self, cfg):
        dense = [] if all(cfg.is_moe_layer(i) for i in range(cfg.num_layers)) else parts.dense_mlp()
        return dense + super().mlp(cfg)


ARCHITECTURE = Qwen3Next()
