"""Mixtral (MixtralForCausalLM): a Mistral whose every MLP is a mixture of experts, each as
wide as intermediate_size, picked by a softmax top-k router and weighted by the renormalised
top-k probabilities; no shared expert. On disk (transformers 4 and 5 alike) the experts are
block_sparse_moe.experts.{E}.w1 (gate), w3 (up), w2 (down) and the router block_sparse_moe.gate."""

from __future__ import annotations

from lightning_mcore.hf.config import HFCheckpointError
from lightning_mcore.hf.mappings import FusedExperts
from lightning_mcore.models import parts
from lightning_mcore.models.architecture import Architecture


class Mixtral(Architecture):
    hf_class, model_type, config_class = "MixtralForCausalLM", "mixtral", "MixtralConfig"
    seq_cls_class = "MixtralForSequenceClassification"
    # transformers' defaults (8 kv heads, 8 experts, 14336) are Mixtral-8x7B's, not ours.
    required = ("intermediate_size", "num_key_value_heads", "num_local_experts",
                "num_experts_per_tok")
    # transformers 5 renames block_sparse_moe to mlp on load and fuses the experts:
    # MixtralExperts.gate_up_proj [E, 2f, h] = [w1; w3], down_proj [E, h, f] = w2.
    peft_experts = FusedExperts("model.layers.{L}.mlp.experts",
                                (("gate_up_proj", ("w1", "w3")), ("down_proj", ("w2",))),
                                per_expert="model.layers.{L}.block_sparse_moe.experts")

    def gpt_config(self, hf):
        if hf.get("router_jitter_noise", 0.0):
            hf.refuse("router_jitter_noise", "jitter on the MoE input is not supported; set it to 0.")
        return parts.decoder(hf, sliding_window=hf.get("sliding_window")) | parts.moe(
            hf, hf["num_local_experts"], ffn="intermediate_size", moe_router_pre_softmax=False)

    def hf_config(self, cfg):
        if not cfg.num_moe_experts:
            raise HFCheckpointError(f"{self.model_type} needs num_moe_experts.")
        if (cfg.moe_ffn_hidden_size or cfg.ffn_hidden_size) != cfg.ffn_hidden_size:
            raise HFCheckpointError(f"{self.model_type} experts are intermediate_size wide: needs "
                                    f"moe_ffn_hidden_size == ffn_hidden_size.")
        if cfg.moe_router_pre_softmax:
            raise HFCheckpointError(f"{self.model_type} renormalises the top-k probabilities: needs "
                                    f"moe_router_pre_softmax=False.")
        parts.expressible(cfg, self.model_type, free=("num_moe_experts", "sliding_window"))
        return parts.decoder_hf(cfg) | dict(
            num_local_experts=cfg.num_moe_experts, num_experts_per_tok=cfg.moe_router_topk,
            sliding_window=cfg.sliding_window)

    def weights(self, cfg):
        moe = parts.H + "block_sparse_moe."
        return (parts.ends(cfg.tie_word_embeddings) + parts.attention()
                + parts.experts(moe + "experts.{E}.", ("w1", "w3", "w2"), router=moe + "gate.weight"))


ARCHITECTURE = Mixtral()
