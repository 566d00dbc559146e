"""DeepSeek-V2 / V2-Lite (DeepseekV2ForCausalLM): multi-latent attention (queries through a
low-rank latent when q_lora_rank is set, keys/values always; a RoPE part per head besides the
latent one, on interleaved pairs; YaRN scaling), the first `first_k_dense_replace` layers dense,
the others mixture of experts with always-on shared experts (n_shared_experts x
moe_intermediate_size, no gate) and a softmax router: "greedy" top-k of the full softmax, not
renormalised, times routed_scaling_factor. Published multi-token-prediction layers are
carried to exports untouched (not trained).

The MLA weight table (one tensor-parallel layout for the local and TE specs, model/mla.py):
    q_a_proj, kv_a_proj_with_mqa  -> linear_q_down_proj, linear_kv_down_proj   Split(0)
    q_b_proj / q_proj, kv_b_proj  -> linear_q_up_proj / linear_q_proj, linear_kv_up_proj  Split(0)
    q_a_layernorm, kv_a_layernorm -> q_layernorm, kv_layernorm   Replicated; eps 1e-6 whatever
                                     rms_norm_eps (TE: fused into the up projections if equal)
    o_proj                        -> linear_proj   Split(1)
"""

from __future__ import annotations

from lightning_mcore.hf.config import HFCheckpointError
from lightning_mcore.hf.mappings import Entry, FusedExperts
from lightning_mcore.hf.transforms import RopeRows, Split, Transform
from lightning_mcore.model.config import GPTConfig, MLAConfig
from lightning_mcore.model.mla import MLA_ROPE_TYPES, mla_config_kwargs
from lightning_mcore.models import parts
from lightning_mcore.models.architecture import Architecture, HFConfig

A, HA = parts.M + "self_attention.", parts.H + "self_attn."
MLA_FIELDS = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
LATENT_NORM_EPS = 1e-6  # transformers' q_a_layernorm / kv_a_layernorm, whatever rms_norm_eps


class DeepseekV2(Architecture):
    hf_class, model_type, config_class = "DeepseekV2ForCausalLM", "deepseek_v2", "DeepseekV2Config"
    required = ("intermediate_size", "moe_intermediate_size", "n_routed_experts",
                "num_experts_per_tok") + MLA_FIELDS
    scratch_order = 60
    peft_misreads_mlp = True
    # transformers 5: DeepseekV2Experts / DeepseekV3Experts.gate_up_proj [E, 2f, h], down_proj
    # [E, h, f]. Usable only when every MLP is routed (peft_misreads_mlp: no dense layers and
    # no shared experts), see models.refuse_peft_export.
    peft_experts = FusedExperts("model.layers.{L}.mlp.experts",
                                (("gate_up_proj", ("gate_proj", "up_proj")), ("down_proj", ("down_proj",))))
    # The router as the original model code names it; transformers computes only these.
    scoring, topk_method = "softmax", "greedy"

    # ------------------------------------------------------------ config.json -> GPTConfig
    def gpt_config(self, hf):
        return self.attention(hf) | self.layers(hf) | self.router(hf)

    def attention(self, hf: HFConfig) -> dict:
        heads = hf["num_attention_heads"]
        if "q_lora_rank" not in hf.data:
            hf.refuse("q_lora_rank", "not in config.json; set it to the query latent rank, or to "
                                     "null when queries are projected from the hidden state.")
        parts.refuse_unless(hf, "num_key_value_heads", (heads, None),
                            "multi-latent attention has one key/value head per query head.")
        mla = MLAConfig(kv_lora_rank=hf["kv_lora_rank"], qk_head_dim=hf["qk_nope_head_dim"],
                        qk_pos_emb_head_dim=hf["qk_rope_head_dim"], v_head_dim=hf["v_head_dim"],
                        q_lora_rank=hf.get("q_lora_rank"), latent_norm_epsilon=LATENT_NORM_EPS)
        fields = parts.decoder(hf, rope_types=MLA_ROPE_TYPES, mla=mla, num_query_groups=heads,
                               kv_channels=mla.qk_head_dim + mla.qk_pos_emb_head_dim)
        try:  # what model/mla.py cannot compute exactly as transformers does
            mla_config_kwargs(GPTConfig(**fields))
        except ValueError as e:
            hf.refuse("rope_parameters" if "rope_parameters" in hf else "rope_scaling", str(e))
        return fields

    def carried(self, hf: HFConfig) -> tuple[str, ...]:
        """The published multi-token-prediction layers, num_nextn_predict_layers of them after
        the last decoder layer (model.layers.<num_hidden_layers + i>.*): not trained here;
        kept for the export, as transformers ignores them."""
        layers = hf["num_hidden_layers"]
        return tuple(f"model.layers.{layers + i}." for i in range(hf.get("num_nextn_predict_layers", 0)))

    def layers(self, hf: HFConfig) -> dict:
        """Dense MLPs on the first first_k_dense_replace layers, experts (and shared ones) after."""
        parts.refuse_unless(hf, "moe_layer_freq", (1, None),
                            "transformers puts experts on every layer after the dense ones.")
        dense = hf.get("first_k_dense_replace", 0)
        shared = hf.get("n_shared_experts", 0) * hf["moe_intermediate_size"]
        return dict(
            num_moe_experts=hf["n_routed_experts"],
            moe_router_topk=hf["num_experts_per_tok"],
            moe_ffn_hidden_size=hf["moe_intermediate_size"],
            moe_shared_expert_intermediate_size=shared or None,
            moe_layer_freq=[int(i >= dense) for i in range(hf["num_hidden_layers"])],
            moe_router_dtype="fp32",  # transformers' V2 and V3 gates compute in float32
        )

    def router(self, hf: HFConfig) -> dict:
        self.router_kind(hf)
        return dict(
            moe_router_score_function="softmax",
            moe_router_pre_softmax=True,  # top-k of the full softmax, not renormalised
            moe_router_topk_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
        )

    def router_kind(self, hf: HFConfig) -> None:
        """The original model code's names for the routing; transformers computes only ours."""
        parts.refuse_unless(hf, "scoring_func", (self.scoring, None),
                            f"this architecture routes with {self.scoring} scores.")
        parts.refuse_unless(hf, "topk_method", (self.topk_method, None),
                            f"only {self.topk_method!r} expert selection is supported.")

    # ------------------------------------------------------------ GPTConfig -> config.json
    def hf_config(self, cfg):
        self.expressible(cfg, moe_router_score_function="softmax")
        if not cfg.moe_router_pre_softmax or not cfg.mla.rope_interleave:
            raise HFCheckpointError(f"{self.model_type} needs GPTConfig.moe_router_pre_softmax=True "
                                    f"and interleaved RoPE rows (mla.rope_interleave=True).")
        return self.config_hf(cfg) | dict(topk_method="greedy")

    def expressible(self, cfg: GPTConfig, free: tuple[str, ...] = (), **fixed) -> None:
        if cfg.mla is None or not cfg.num_moe_experts:
            raise HFCheckpointError(f"{self.model_type} needs GPTConfig.mla and num_moe_experts.")
        self.expressible_moe(cfg)
        free += ("mla", "num_moe_experts", "moe_layer_freq", "moe_shared_expert_intermediate_size",
                 "moe_router_topk_scaling_factor")
        parts.expressible(cfg, self.model_type, free=free, rope_types=MLA_ROPE_TYPES, **fixed)
        if cfg.num_query_groups not in (None, cfg.num_attention_heads):
            raise HFCheckpointError(f"{self.model_type}: multi-latent attention has no query groups.")
        if (cfg.mla.latent_norm_epsilon or cfg.norm_epsilon) != LATENT_NORM_EPS:
            raise HFCheckpointError(f"{self.model_type} normalises the q/kv latents with eps "
                                    f"{LATENT_NORM_EPS}: needs mla.latent_norm_epsilon={LATENT_NORM_EPS}.")

    def expressible_moe(self, cfg: GPTConfig) -> None:
        """Refuse an MLP stack transformers' DeepSeek layout cannot hold (experts_hf's fields)."""
        flags = [cfg.is_moe_layer(i) for i in range(cfg.num_layers)]
        if sorted(flags) != flags:
            raise HFCheckpointError(f"{self.model_type} has its dense layers first, then MoE "
                                    f"layers; moe_layer_freq={cfg.moe_layer_freq!r}.")
        shared = cfg.moe_shared_expert_intermediate_size or 0
        if shared % (cfg.moe_ffn_hidden_size or cfg.ffn_hidden_size):
            raise HFCheckpointError(f"{self.model_type}: the shared experts' size must be a "
                                    f"multiple of moe_ffn_hidden_size.")

    def config_hf(self, cfg: GPTConfig) -> dict:
        """transformers config kwargs both DeepSeek versions share."""
        m = cfg.mla
        out = parts.decoder_hf(cfg) | dict(
            num_key_value_heads=cfg.num_attention_heads,
            q_lora_rank=m.q_lora_rank, kv_lora_rank=m.kv_lora_rank, qk_nope_head_dim=m.qk_head_dim,
            qk_rope_head_dim=m.qk_pos_emb_head_dim, v_head_dim=m.v_head_dim,
        ) | self.experts_hf(cfg)
        del out["head_dim"]  # transformers derives it (the RoPE dim)
        return out

    def experts_hf(self, cfg: GPTConfig) -> dict:
        """transformers config kwargs of the dense-then-MoE stack with shared experts."""
        expert_ffn = cfg.moe_ffn_hidden_size or cfg.ffn_hidden_size
        return dict(
            n_routed_experts=cfg.num_moe_experts, num_experts_per_tok=cfg.moe_router_topk,
            moe_intermediate_size=expert_ffn,
            n_shared_experts=(cfg.moe_shared_expert_intermediate_size or 0) // expert_ffn,
            first_k_dense_replace=sum(not cfg.is_moe_layer(i) for i in range(cfg.num_layers)),
            routed_scaling_factor=cfg.moe_router_topk_scaling_factor or 1.0,
        )

    # ------------------------------------------------------------ weight table
    def weights(self, cfg):
        return (parts.ends(cfg.tie_word_embeddings)
                + [parts.norm("input_layernorm.weight", "input_layernorm.weight"),
                   parts.norm("pre_mlp_layernorm.weight", "post_attention_layernorm.weight")]
                + self.latent_attention(cfg) + self.mlp_weights(cfg))

    def mlp_weights(self, cfg: GPTConfig) -> list[Entry]:
        """Dense MLPs, routed experts with their router, shared experts."""
        moe, table = [cfg.is_moe_layer(i) for i in range(cfg.num_layers)], []
        if not all(moe):
            table += parts.dense_mlp()
        if any(moe):
            table += parts.experts(parts.H + "mlp.experts.{E}.") + self.router_weights(cfg)
            if cfg.moe_shared_expert_intermediate_size:
                table += parts.gated_mlp(parts.M + "mlp.shared_experts.",
                                         parts.H + "mlp.shared_experts.", size="sf")
        return table

    def router_weights(self, cfg: GPTConfig) -> list[Entry]:
        return []  # beyond the router's weight (parts.experts)

    def rope_rows(self, cfg: GPTConfig, block: int) -> Transform:
        """Rows of a projection that ends each `block` in a RoPE part, in the checkpoint's order."""
        m = cfg.mla
        return Split(0) if m.rope_interleave else RopeRows(block, m.qk_pos_emb_head_dim)

    def latent_attention(self, cfg: GPTConfig) -> list[Entry]:
        m = cfg.mla
        q_head, kv_rows = m.qk_head_dim + m.qk_pos_emb_head_dim, m.kv_lora_rank + m.qk_pos_emb_head_dim
        out = [
            Entry(A + "linear_kv_down_proj.weight", (HA + "kv_a_proj_with_mqa.weight",),
                  self.rope_rows(cfg, kv_rows), (("kva", "h"),)),
            parts.norm("self_attention.kv_layernorm.weight", "self_attn.kv_a_layernorm.weight", "kvl"),
            Entry(A + "linear_kv_up_proj.weight", (HA + "kv_b_proj.weight",), Split(0),
                  (("kvb", "kvl"),)),
            Entry(A + "linear_proj.weight", (HA + "o_proj.weight",), Split(1), (("h", "o"),)),
        ]
        if m.q_lora_rank is None:
            return out + [Entry(A + "linear_q_proj.weight", (HA + "q_proj.weight",),
                                self.rope_rows(cfg, q_head), (("qh", "h"),))]
        return out + [
            Entry(A + "linear_q_down_proj.weight", (HA + "q_a_proj.weight",), Split(0), (("ql", "h"),)),
            parts.norm("self_attention.q_layernorm.weight", "self_attn.q_a_layernorm.weight", "ql"),
            Entry(A + "linear_q_up_proj.weight", (HA + "q_b_proj.weight",), self.rope_rows(cfg, q_head),
                  (("qh", "ql"),)),
        ]


ARCHITECTURE = DeepseekV2()
