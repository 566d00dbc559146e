"""RoPE with its own base on windowed layers (Gemma 3: local layers 10k, global layers 1M;
`GPTConfig.local_rotary_base`).

mcore computes one rotary embedding per forward in GPTModel and hands the same tensor to every
layer. Here the chunk's rotary module returns both, stacked [2, s, 1, 1, d] (global, local):
still one tensor, so activation recompute and the pipeline schedules carry it as before, and
each layer's attention takes its own half. Both halves come from mcore's RotaryEmbedding, so
packed sequences (positions per sequence) and context-parallel slicing work as for one.
"""

from __future__ import annotations

import copy

import torch
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.transformer.attention import SelfAttention

from lightning_mcore.model.rope import rope_inv_freq


class GlobalLocalRotaryEmbedding(torch.nn.Module):
    def __init__(self, global_rope: RotaryEmbedding, local_rope: RotaryEmbedding) -> None:
        super().__init__()
        self.global_rope, self.local_rope = global_rope, local_rope

    def get_rotary_seq_len(self, *args, **kwargs) -> int:
        return self.global_rope.get_rotary_seq_len(*args, **kwargs)

    def forward(self, *args, **kwargs) -> torch.Tensor:
        return torch.stack((self.global_rope(*args, **kwargs), self.local_rope(*args, **kwargs)))


class LayerRoPESelfAttention(SelfAttention):
    """Self-attention on the global or the local half of the stacked rotary embedding."""

    def __init__(self, *args, local_rope: bool = False, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.rope_half = int(local_rope)

    def forward(self, *args, rotary_pos_emb=None, **kwargs):
        if rotary_pos_emb is not None:
            rotary_pos_emb = rotary_pos_emb[self.rope_half]
        return super().forward(*args, rotary_pos_emb=rotary_pos_emb, **kwargs)


def with_layer_rope(spec, local: bool):
    """A copy of a layer spec whose attention takes the local (or the global) RoPE."""
    spec = copy.deepcopy(spec)
    attention = spec.submodules.self_attention
    if attention.module is not SelfAttention:
        raise ValueError(f"a local RoPE base needs mcore's SelfAttention, not {attention.module.__name__}.")
    attention.module = LayerRoPESelfAttention
    attention.params = {**attention.params, "local_rope": local}
    return spec


def add_local_rope(model, cfg) -> None:
    """Give a chunk's rotary module a twin at `cfg.local_rotary_base` (plain RoPE)."""
    rope = model.rotary_pos_emb
    local = RotaryEmbedding(
        kv_channels=cfg.head_dim, rotary_percent=1.0, rotary_interleaved=rope.rotary_interleaved,
        rotary_base=int(cfg.local_rotary_base), use_cpu_initialization=True, cp_group=rope.cp_group,
    )
    inv_freq = rope_inv_freq(cfg.head_dim, cfg.local_rotary_base, None)
    local.inv_freq = inv_freq.to(device=rope.inv_freq.device, dtype=rope.inv_freq.dtype)
    model.rotary_pos_emb = GlobalLocalRotaryEmbedding(rope, local)
