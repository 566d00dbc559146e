"""Qwen3-MoE (Qwen3MoeForCausalLM): Qwen3 attention, a softmax top-k router on every layer
(renormalised when norm_topk_prob), no shared expert; with use_sliding_window, every layer
windowed."""

from __future__ import annotations

from lightning_mcore.hf.mappings import FusedExperts
from lightning_mcore.models import parts
from lightning_mcore.models.qwen3 import Qwen3


class Qwen3Moe(Qwen3):
    hf_class, model_type, config_class = "Qwen3MoeForCausalLM", "qwen3_moe", "Qwen3MoeConfig"
    seq_cls_class = "Qwen3MoeForSequenceClassification"
    required = ("intermediate_size", "num_key_value_heads", "num_experts_per_tok",
                "moe_intermediate_size")
    # transformers 5: Qwen3MoeExperts.gate_up_proj [E, 2f, h], down_proj [E, h, f]
    peft_experts = FusedExperts("model.layers.{L}.mlp.experts",
                                (("gate_up_proj", ("gate_proj", "up_proj")), ("down_proj", ("down_proj",))))

    def gpt_config(self, hf):
        if hf.get("decoder_sparse_step", 1) != 1:
            hf.refuse("decoder_sparse_step", "mixed dense/MoE layer stacks are not supported.")
        if hf.get("mlp_only_layers"):
            hf.refuse("mlp_only_layers", "mixed dense/MoE layer stacks are not supported.")
        return super().gpt_config(hf) | parts.moe(hf, parts.num_experts(hf))

    def window(self, hf):  # transformers 5 windows every layer (max_window_layers unused)
        return dict(sliding_window=hf["sliding_window"]) if hf.get("use_sliding_window") else {}

    def hf_config(self, cfg):
        if not cfg.num_moe_experts:
            raise parts.HFCheckpointError(f"{self.model_type} needs num_moe_experts.")
        parts.expressible(cfg, self.model_type, free=("num_moe_experts", "sliding_window"),
                          qk_layernorm=True)
        window = cfg.sliding_window
        return parts.decoder_hf(cfg) | parts.moe_hf(cfg) | dict(
            use_sliding_window=window is not None, sliding_window=window,
            num_experts=cfg.num_moe_experts, decoder_sparse_step=1, mlp_only_layers=[])

    def weights(self, cfg):
        return (parts.ends(cfg.tie_word_embeddings) + parts.attention(qk_norm=True)
                + parts.experts(parts.H + "mlp.experts.{E}."))


ARCHITECTURE = Qwen3Moe()
