"""Model FLOPs per trained token, from the model config (the numerator of MFU).

Megatron-LM's convention (`num_floating_point_operations`): every matmul counts 2 FLOPs per
multiply-add; backward costs twice the forward; attention scores are counted over the full
s x s matrix (not halved for the causal mask); recomputation is not counted (that would be
hardware FLOPs). A MoE layer counts the router, the top-k routed experts and the shared expert
(and its gate), i.e. the parameters a token actually passes through; the dense layers of a
mixed stack count their own MLP.
"""

from __future__ import annotations

from lightning_mcore.model.config import GPTConfig


def forward_flops_per_token(cfg: GPTConfig, seq_length: int) -> float:
    h = cfg.hidden_size
    q = cfg.num_attention_heads * cfg.head_dim
    kv = (cfg.num_query_groups or cfg.num_attention_heads) * cfg.head_dim
    attention = h * (q + 2 * kv) + q * h + 2 * seq_length * q  # qkv (GQA), proj, QK^T and AV
    if cfg.mla is not None:
        attention = _latent_attention(cfg, seq_length)
    dense = 3 * h * cfg.ffn_hidden_size  # SwiGLU: gate, up, down
    moe = 0
    if cfg.num_moe_experts:
        expert = 3 * h * (cfg.moe_ffn_hidden_size or cfg.ffn_hidden_size)
        shared = 3 * h * (cfg.moe_shared_expert_intermediate_size or 0)
        gate = h if cfg.moe_shared_expert_gate else 0  # the shared expert's sigmoid gate
        moe = h * cfg.num_moe_experts + cfg.moe_router_topk * expert + shared + gate
    mlp = sum(moe if cfg.is_moe_layer(i) else dense for i in range(cfg.num_layers))
    return 2.0 * (cfg.num_layers * attention + mlp + h * cfg.vocab_size)  # + LM head


def _latent_attention(cfg: GPTConfig, seq_length: int) -> float:
    """Multi-latent attention: down and up projections, output, QK^T (q/k heads of nope + rope
    dims) and AV (v heads)."""
    m, h, n = cfg.mla, cfg.hidden_size, cfg.num_attention_heads
    q = n * (m.qk_head_dim + m.qk_pos_emb_head_dim)
    queries = h * q if m.q_lora_rank is None else m.q_lora_rank * (h + q)
    keys_values = (h * (m.kv_lora_rank + m.qk_pos_emb_head_dim)
                   + m.kv_lora_rank * n * (m.qk_head_dim + m.v_head_dim))
    return queries + keys_values + n * m.v_head_dim * (h + seq_length) + seq_length * q


def training_flops_per_token(cfg: GPTConfig, seq_length: int, frozen_base: bool = False) -> float:
    """3 x forward. With a frozen base (LoRA) no weight gradients are computed: 2 x forward
    (the adapters' own FLOPs are negligible at small rank)."""
    return (2.0 if frozen_base else 3.0) * forward_flops_per_token(cfg, seq_length)
