"""RoPE frequency scaling computed exactly as Hugging Face does, then set on mcore's embedding.

mcore's GPTModel only takes a llama3 scaling factor with fixed low/high frequency factors and
original context; checkpoints carry all four numbers, so we compute inv_freq ourselves.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def rope_inv_freq(head_dim: int, base: float, rope_scaling: Optional[dict]) -> torch.Tensor:
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = (rope_scaling or {}).get("rope_type", (rope_scaling or {}).get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / rope_scaling["factor"]
    if kind == "llama3":
        factor = rope_scaling["factor"]
        low, high = rope_scaling["low_freq_factor"], rope_scaling["high_freq_factor"]
        old_len = rope_scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(
        f"rope_scaling type {kind!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}."
    )


def apply_rope_scaling(model, cfg) -> None:
    """Overwrite the chunk's rotary inv_freq when the config asks for scaling."""
    if not cfg.rope_scaling or getattr(model, "rotary_pos_emb", None) is None:
        return
    emb = model.rotary_pos_emb
    inv = rope_inv_freq(cfg.head_dim, cfg.rotary_base, cfg.rope_scaling)
    emb.inv_freq = inv.to(device=emb.inv_freq.device, dtype=emb.inv_freq.dtype)
