"""RoPE frequency scaling computed exactly as Hugging Face does, then set on mcore's embedding.

mcore's GPTModel only takes a llama3 scaling factor with fixed low/high frequency factors and
original context; checkpoints carry all four numbers, so we compute inv_freq ourselves.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
# YaRN on grouped-query attention (multi-latent attention's is model/mla.py's): the families
# whose parity tests cover it take it (models/<family>.py passes these kinds).
YARN_ROPE_TYPES = SUPPORTED_ROPE_TYPES + ("yarn",)


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
    if kind == "yarn":
        return _yarn_inv_freq(head_dim, base, rope_scaling)
    raise ValueError(
        f"rope_scaling type {kind!r} is not supported; supported: {', '.join(YARN_ROPE_TYPES)}."
    )


def _yarn_inv_freq(dim: int, base: float, rope: dict) -> torch.Tensor:
    """transformers' YaRN: interpolated (inv_freq / factor) below the correction range,
    extrapolated (unchanged) above it, a linear ramp between; the range ends rounded outward
    unless truncate is False."""
    factor, old_len = rope["factor"], rope["original_max_position_embeddings"]
    fast, slow = rope.get("beta_fast") or 32, rope.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(fast), correction_dim(slow)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    return 1.0 / (factor * pos_freqs) * (1 - extrapolation) + 1.0 / pos_freqs * extrapolation


def yarn_attention_factor(rope_scaling: Optional[dict]) -> float:
    """The factor transformers' YaRN multiplies cos/sin by (1 for other RoPE types)."""
    rope = rope_scaling or {}
    if rope.get("rope_type", rope.get("type")) != "yarn":
        return 1.0
    if rope.get("attention_factor") is not None:
        return float(rope["attention_factor"])

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    factor, m, all_dim = rope["factor"], rope.get("mscale"), rope.get("mscale_all_dim")
    return float(mscale(factor, m) / mscale(factor, all_dim)) if m and all_dim else mscale(factor)


def apply_rope_scaling(model, cfg) -> None:
    """Overwrite the chunk's rotary inv_freq when the config asks for scaling."""
    if not cfg.rope_scaling or cfg.mla is not None or getattr(model, "rotary_pos_emb", None) is None:
        return
    emb = model.rotary_pos_emb
    inv = rope_inv_freq(cfg.head_dim, cfg.rotary_base, cfg.rope_scaling)
    emb.inv_freq = inv.to(device=emb.inv_freq.device, dtype=emb.inv_freq.dtype)
