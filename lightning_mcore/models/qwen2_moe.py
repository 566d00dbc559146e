"""Qwen2-MoE (Qwen2MoeForCausalLM): Qwen2 attention (q/k/v biases, `qkv_bias`); MoE layers
hold a softmax top-k router (top-k probabilities renormalised when norm_topk_prob), routed
experts of moe_intermediate_size, and a shared expert of shared_expert_intermediate_size
whose output is scaled by sigmoid(shared_expert_gate . x) (mcore: SharedExpertMLP with
moe_shared_expert_gate). Layers listed in mlp_only_layers, or off the decoder_sparse_step
rhythm, are dense MLPs of intermediate_size."""

from __future__ import annotations

from lightning_mcore.hf.config import HFCheckpointError
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
        for field in ("num_experts", "shared_expert_intermediate_size"):
            if hf[field] < 1:
                hf.refuse(field, "must be positive: a model without (shared) experts is not "
                                 "supported by this family.")
        return parts.decoder(hf, add_qkv_bias=bool(hf.get("qkv_bias", True))) | parts.moe(
            hf, hf["num_experts"], moe_layer_freq=parts.sparse_layers(hf),
            moe_shared_expert_intermediate_size=hf["shared_expert_intermediate_size"],
            moe_shared_expert_gate=True)

    def hf_config(self, cfg):
        if not cfg.num_moe_experts or not cfg.moe_shared_expert_intermediate_size:
            raise HFCheckpointError(f"{self.model_type} needs num_moe_experts and "
                                    f"moe_shared_expert_intermediate_size.")
        parts.expressible(cfg, self.model_type, moe_shared_expert_gate=True,
                          free=("add_qkv_bias", "num_moe_experts", "moe_layer_freq",
                                "moe_shared_expert_intermediate_size"))
        # qkv_bias=False needs transformers 5 to read it (transformers 4 always adds biases).
        return parts.decoder_hf(cfg) | parts.moe_hf(cfg) | parts.sparse_layers_hf(cfg) | dict(
            num_experts=cfg.num_moe_experts, qkv_bias=cfg.add_qkv_bias,
            shared_expert_intermediate_size=cfg.moe_shared_expert_intermediate_size)

    def weights(self, cfg):
        dense = [] if all(cfg.is_moe_layer(i) for i in range(cfg.num_layers)) else parts.dense_mlp()
        return (parts.ends(cfg.tie_word_embeddings) + parts.attention(qkv_bias=cfg.add_qkv_bias)
                + dense + parts.experts(parts.H + "mlp.experts.{E}.") + parts.shared_expert())


ARCHITECTURE = Qwen2Moe()
