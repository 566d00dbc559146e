"""Multimodal RoPE (GPTConfig.mrope) computed as transformers' Qwen-VL models compute it.

Each token carries three positions (t, h, w). Frequency i of the head_dim/2 turns by one of
them: the first section[0] by t, the next section[1] by h, the rest by w (the sections must
sum to head_dim/2); or, interleaved (Qwen3-VL), by h at 1, 4, 7, ... below 3*section[1], by w
at 2, 5, 8, ... below 3*section[2], by t everywhere else. As transformers' Qwen3-VL rotary
does, the interleaved layout reads only section[1] and section[2], whatever the sum:

    sectioned   [t t t t | h h h h h h | w w w w w w]        section = [4, 6, 6]
    interleaved [t h w t h w t h w t h w ...  t t t t]

mcore's GPTModel with position_embedding_type "mrope" hands its rotary module the [3, b, s]
position ids; this module returns one frequency per token, [s, b, 1, head_dim], which mcore's
RoPE applies to each token (and under packed THD rows per token too: mcore maps a freqs tensor
as long as the row one to one). Its own MultimodalRotaryEmbedding has no interleaved layout and
allocates on CUDA, so the chunk gets this one.
"""

from __future__ import annotations

import torch

from lightning_mcore.model.config import MRoPEConfig
from lightning_mcore.model.rope import rope_inv_freq


class MultimodalRoPE(torch.nn.Module):
    def __init__(self, inv_freq: torch.Tensor, mrope: MRoPEConfig) -> None:
        super().__init__()
        if not mrope.interleaved and sum(mrope.section) != inv_freq.numel():
            raise ValueError(f"mrope section {mrope.section} must sum to head_dim/2 = {inv_freq.numel()}.")
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.section, self.interleaved = list(mrope.section), mrope.interleaved

    def forward(self, position_ids: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        """[3, b, s] positions -> [s, b, 1, head_dim] rotary angles (mcore's layout)."""
        if position_ids.dim() != 3 or position_ids.shape[0] != 3:
            raise ValueError(f"multimodal RoPE takes [3, batch, seq] position ids, got {tuple(position_ids.shape)}.")
        freqs = position_ids.to(self.inv_freq.device)[..., None].float() * self.inv_freq.float()
        angles = self._combine(freqs)  # [b, s, head_dim / 2]
        return torch.cat((angles, angles), dim=-1).transpose(0, 1)[:, :, None, :].contiguous()

    def _combine(self, freqs: torch.Tensor) -> torch.Tensor:
        """[3, b, s, d/2] per-axis angles -> [b, s, d/2], each frequency from its axis."""
        if not self.interleaved:
            parts = freqs.split(self.section, dim=-1)
            return torch.cat([part[i % 3] for i, part in enumerate(parts)], dim=-1)
        out = freqs[0].clone()
        for axis in (1, 2):
            stop = 3 * self.section[axis]
            out[..., axis:stop:3] = freqs[axis, ..., axis:stop:3]
        return out


def use_mrope(model, cfg) -> None:
    """Switch a freshly built GPTModel chunk to multimodal RoPE (`cfg.mrope`)."""
    if cfg.rope_scaling:
        raise ValueError("multimodal RoPE with rope_scaling is not supported.")
    device = model.rotary_pos_emb.inv_freq.device
    inv = rope_inv_freq(int(cfg.head_dim * cfg.rotary_percent), cfg.rotary_base, None).to(device)
    model.rotary_pos_emb = MultimodalRoPE(inv, cfg.mrope)
    model.position_embedding_type = "mrope"
    model.mrope_section = list(cfg.mrope.section)
