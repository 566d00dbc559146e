"""MiniMax-M2 (MiniMaxM2ForCausalLM): GQA whose q and k norms span each token's whole projection
(all heads together; model/norm.py ProjectionRMSNorm), RoPE on part of each head (the released
configs say rotary_dim, transformers 5 partial_rotary_factor), and on every layer experts
chosen by sigmoid score + e_score_correction_bias and weighted by their sigmoid scores
renormalised; no shared expert. On disk the MoE keeps Mixtral's names
(block_sparse_moe.gate, .experts.{E}.w1/w3/w2, .e_score_correction_bias)."""

from __future__ import annotations

from lightning_mcore.hf.config import HFCheckpointError
from lightning_mcore.hf.mappings import Entry
from lightning_mcore.hf.transforms import Replicated
from lightning_mcore.models import parts
from lightning_mcore.models.architecture import Architecture, HFConfig
from lightning_mcore.models.mixtral import ARCHITECTURE as MIXTRAL

M, H = parts.M, parts.H
MOE = H + "block_sparse_moe."


class MiniMaxM2(Architecture):
    hf_class, model_type, config_class = "MiniMaxM2ForCausalLM", "minimax_m2", "MiniMaxM2Config"
    required = ("intermediate_size", "num_key_value_heads", "head_dim", "num_local_experts",
                "num_experts_per_tok")
    peft_experts = MIXTRAL.peft_experts  # transformers 5 converts its experts as Mixtral's

    def gpt_config(self, hf):
        if hf.get("router_jitter_noise", 0.0):
            hf.refuse("router_jitter_noise", "jitter on the MoE input is not supported; set it to 0.")
        for field, allowed in (("qk_norm_type", ("per_layer", None)), ("scoring_func", ("sigmoid", None)),
                               ("use_routing_bias", (True, None)), ("shared_intermediate_size", (0, None))):
            parts.refuse_unless(hf, field, allowed, f"only {allowed[0]!r} is supported.")
        if hf.get("rotary_dim") is not None and "partial_rotary_factor" not in (hf.get("rope_parameters") or {}):
            hf = HFConfig(hf.data | {"partial_rotary_factor": hf["rotary_dim"] / hf["head_dim"]}, hf.source)
        return parts.decoder(hf, partial_rotary=True, qk_layernorm=True, qk_norm_across_heads=True) | parts.moe(
            hf, hf["num_local_experts"], ffn="intermediate_size", moe_router_pre_softmax=False,
            moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
            moe_router_topk_scaling_factor=1.0, moe_router_dtype="fp32")

    def hf_config(self, cfg):
        if not cfg.num_moe_experts or cfg.moe_layer_freq != 1 or cfg.moe_router_topk < 2:
            raise HFCheckpointError(f"{self.model_type} needs num_moe_experts on every layer and a top-k of "
                                    f"2 or more (its router renormalises the chosen scores).")
        parts.expressible(cfg, self.model_type, free=("num_moe_experts", "rotary_percent"),
                          qk_layernorm=True, qk_norm_across_heads=True, moe_router_score_function="sigmoid",
                          moe_router_enable_expert_bias=True, moe_router_topk_scaling_factor=1.0)
        return parts.decoder_hf(cfg, partial_rotary=True) | dict(
            intermediate_size=cfg.moe_ffn_hidden_size or cfg.ffn_hidden_size,
            num_local_experts=cfg.num_moe_experts, num_experts_per_tok=cfg.moe_router_topk)

    def weights(self, cfg):
        attention = [e for e in parts.attention() if "layernorm" not in e.mcore or "input" in e.mcore
                     or "pre_mlp" in e.mcore]
        return (parts.ends(cfg.tie_word_embeddings) + attention + [
            Entry(M + "self_attention.q_layernorm.weight", (H + "self_attn.q_norm.weight",), Replicated(), (("q",),)),
            Entry(M + "self_attention.k_layernorm.weight", (H + "self_attn.k_norm.weight",), Replicated(), (("kv",),)),
            Entry(M + "mlp.router.expert_bias", (MOE + "e_score_correction_bias",), Replicated(), (("E",),),
                  dtype="F32"),
        ] + parts.experts(MOE + "experts.{E}.", ("w1", "w3", "w2"), router=MOE + "gate.weight"))


ARCHITECTURE = MiniMaxM2()
