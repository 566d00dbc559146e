"""Qwen2-MoE (Qwen2MoeForCausalLM): Qwen2 attention (q/k/v biases, `qkv_bias`); MoE layers
hold a softmax top-k router (top-k probabilities renormalised when norm_topk_prob), routed
experts of moe_intermediate_size, and a shared expert of shared_expert_intermediate_size
whose output is scaled by sigmoid(shared_expert_gate . x) (mcore: SharedExpertMLP with
moe_shared_expert_gate). Layers listed in mlp_only_layers, or off the decoder_sparse_step
rhythm, are dense MLPs of intermediate_size."""

from __future__ import annotations

from lightning_mcore.hf.mappings import FusedExperts
from lightning_mcore.models import parts
from lightning_mcore.models.architecture import Architecture


class Qwen2Moe(Architecture):
    hf_class, model_type, config_class = "Qwen2MoeForCausalLM", "qwen2_moe", "Qwen2MoeConfig"
    seq_cls_class = "Qwen2MoeForSequenceClassification"
    required = ("intermediate_size", "num_key_value_heads", "num_experts", "num_experts_per_tok",
                "moe_intermediate_size", "shared_expert_intermediate_size")
    # transformers 5: Qwen2MoeExperts.gate_up_proj [E, 2f, h], down_proj [E, h, f]. peft
    # converts no targets of this model type, so the shared expert's and dense layers'
    # gate/up/down_proj adapters load as the plain linears they are.
    peft_experts = FusedExperts("model.layers.{L}.mlp.experts",
                                (("gate_up_proj", ("gate_proj", "up_proj")), ("down_proj", ("down_proj",))))

    def gpt_config(self, hf):
        if hf.get("use_sliding_window"):
            hf.refuse("use_sliding_window", "sliding-window attention is not supported.")
        return parts.decoder(hf, add_qkv_bias=bool(hf.get("qkv_bias", True))) | parts.gated_shared_expert(
            hf, moe_layer_freq=parts.sparse_layers(hf))

    def hf_config(self, cfg):
        moe = parts.gated_shared_expert_hf(cfg, self.model_type)
        parts.expressible(cfg, self.model_type, moe_shared_expert_gate=True,
                          free=("add_qkv_bias", "num_moe_experts", "moe_layer_freq",
                                "moe_shared_expert_intermediate_size"))
        # qkv_bias=False needs transformers 5 to read it (transformers 4 always adds biases).
        return parts.decoder_hf(cfg) | moe | parts.sparse_layers_hf(cfg) | dict(qkv_bias=cfg.add_qkv_bias)

    def weights(self, cfg):
        dense = [] if all(cfg.is_moe_layer(i) for i in range(cfg.num_layers)) else parts.dense_mlp()
        return (parts.ends(cfg.tie_word_embeddings) + parts.attention(qkv_bias=cfg.add_qkv_bias)
                + dense + parts.experts(parts.H + "mlp.experts.{E}.") + parts.shared_expert())


ARCHITECTURE = Qwen2Moe()
