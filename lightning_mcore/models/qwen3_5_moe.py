"""Qwen3.5-MoE, text only (Qwen3_5MoeForCausalLM, model_type qwen3_5_moe_text): Qwen3.5's
hybrid attention stack (models/qwen3_5.py) with a mixture of experts on every layer: a softmax
top-k router whose chosen probabilities are always renormalised, routed experts of
moe_intermediate_size, and a shared expert of shared_expert_intermediate_size scaled by
sigmoid(shared_expert_gate . x)."""

from __future__ import annotations

from lightning_mcore.hf.config import HFCheckpointError
from lightning_mcore.hf.mappings import FusedExperts
from lightning_mcore.models import parts
from lightning_mcore.models.architecture import HFConfig
from lightning_mcore.models.qwen3_5 import Qwen3_5


class Qwen3_5Moe(Qwen3_5):
    hf_class, model_type, config_class = "Qwen3_5MoeForCausalLM", "qwen3_5_moe_text", "Qwen3_5MoeTextConfig"
    required = ("num_key_value_heads", "head_dim", "linear_num_key_heads", "linear_num_value_heads",
                "linear_key_head_dim", "linear_value_head_dim", "num_experts", "num_experts_per_tok",
                "moe_intermediate_size", "shared_expert_intermediate_size")
    # transformers 5: gate_up_proj [E, 2f, h], down_proj [E, h, f]. peft takes the
    # gate/up/down_proj targets for these fused experts (seen on Qwen3-Next: gate_up_proj's rank
    # doubled, the shared expert's adapters dropped): MLP adapters export merged only.
    peft_misreads_mlp = True
    peft_experts = FusedExperts("model.layers.{L}.mlp.experts",
                                (("gate_up_proj", ("gate_proj", "up_proj")), ("down_proj", ("down_proj",))))

    def gpt_config(self, hf):
        # No dense layers: intermediate_size (absent from this config) is the experts' width.
        dense = HFConfig(hf.data | {"intermediate_size": hf.get("intermediate_size", hf["moe_intermediate_size"])},
                         hf.source)
        return super().gpt_config(dense) | self.experts(hf)

    def experts(self, hf) -> dict:
        return parts.gated_shared_expert(hf, moe_router_pre_softmax=False)  # always renormalised

    moe_fields = ("num_moe_experts", "moe_shared_expert_intermediate_size", "moe_shared_expert_gate")

    def hf_config(self, cfg):
        moe = parts.gated_shared_expert_hf(cfg, self.model_type)
        if cfg.moe_router_pre_softmax or any(not cfg.is_moe_layer(i) for i in range(cfg.num_layers)):
            raise HFCheckpointError(f"{self.model_type} renormalises the top-k probabilities and has "
                                    f"experts on every layer: needs moe_router_pre_softmax=False, "
                                    f"moe_layer_freq=1.")
        moe.pop("norm_topk_prob")
        # intermediate_size (unused: no dense layer) is kept, so that it reads back the same
        return self.hybrid_hf(cfg, free=self.moe_fields) | moe

    def mlp(self, cfg):
        return parts.experts(parts.H + "mlp.experts.{E}.") + parts.shared_expert()


ARCHITECTURE = Qwen3_5Moe()
