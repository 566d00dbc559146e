"""DeepSeek-V3 (DeepseekV3ForCausalLM; also Moonlight, Kimi-K2 and other checkpoints of this
class): DeepSeek-V2's multi-latent attention, dense-then-MoE layers and shared experts, with a
sigmoid router: experts are chosen by score + e_score_correction_bias (the aux-loss-free
balancing bias, mcore's router.expert_bias, which mcore keeps updating while training), first
among the top `topk_group` of `n_group` expert groups, then weighted by their plain sigmoid
scores renormalised (norm_topk_prob) times routed_scaling_factor. `rope_interleave=False`
checkpoints have their RoPE rows reordered on load and export."""

from __future__ import annotations

from lightning_mcore.hf.config import HFCheckpointError
from lightning_mcore.hf.mappings import Entry
from lightning_mcore.hf.transforms import Replicated
from lightning_mcore.models import parts
from lightning_mcore.models.deepseek_v2 import DeepseekV2


class DeepseekV3(DeepseekV2):
    hf_class, model_type, config_class = "DeepseekV3ForCausalLM", "deepseek_v3", "DeepseekV3Config"
    scoring, topk_method = "sigmoid", "noaux_tc"

    def attention(self, hf):
        fields = super().attention(hf)
        fields["mla"].rope_interleave = bool(hf.get("rope_interleave", True))
        return fields

    def router(self, hf):
        self.router_kind(hf)
        topk, experts = hf["num_experts_per_tok"], hf["n_routed_experts"]
        if topk > 1 and not hf.get("norm_topk_prob", False):
            hf.refuse("norm_topk_prob", "mcore renormalises the top-k sigmoid scores.")
        if topk == 1 and hf.get("norm_topk_prob", False):
            hf.refuse("norm_topk_prob", "mcore does not renormalise a single expert's score.")
        groups, chosen = hf.get("n_group", 1), hf.get("topk_group", 1)
        if experts % groups:
            hf.refuse("n_group", f"{experts} experts do not split into {groups} groups.")
        if chosen < groups and topk // chosen != 2:
            # transformers ranks groups by their top-2 scores, mcore by the top topk/topk_group
            hf.refuse("topk_group", f"group-limited routing needs num_experts_per_tok / "
                                    f"topk_group = 2 (got {topk} / {chosen}).")
        limited = chosen < groups
        return dict(
            moe_router_score_function="sigmoid",
            moe_router_enable_expert_bias=True,
            moe_router_num_groups=groups if limited else None,
            moe_router_group_topk=chosen if limited else None,
            moe_router_topk_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
        )

    def hf_config(self, cfg):
        self.expressible(cfg, free=("moe_router_num_groups", "moe_router_group_topk"),
                         moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True)
        return self.config_hf(cfg) | self.router_hf(cfg) | dict(
            rope_interleave=cfg.mla.rope_interleave, num_nextn_predict_layers=0)

    def router_hf(self, cfg):
        """transformers config kwargs of the sigmoid router with expert groups."""
        if cfg.moe_router_group_topk and cfg.moe_router_topk // cfg.moe_router_group_topk != 2:
            raise HFCheckpointError(f"{self.model_type} ranks expert groups by their top-2 "
                                    f"scores: needs moe_router_topk / moe_router_group_topk = 2.")
        limited = bool(cfg.moe_router_group_topk)
        return dict(n_group=cfg.moe_router_num_groups if limited else 1,
                    topk_group=cfg.moe_router_group_topk if limited else 1, norm_topk_prob=True)

    def router_weights(self, cfg):
        # HF keeps the bias in float32 whatever the model's dtype; so does mcore.
        return [Entry(parts.M + "mlp.router.expert_bias", (parts.H + "mlp.gate.e_score_correction_bias",),
                      Replicated(), (("E",),), dtype="F32")]


ARCHITECTURE = DeepseekV3()
