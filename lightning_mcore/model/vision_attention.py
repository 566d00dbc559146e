"""Packed attention for transformers' vision encoders: one variable-length flash kernel over every
window and image of a batch instead of one SDPA call per window.

transformers' Qwen-VL encoders attend within windows (Qwen2.5-VL: 16 windows of a 392x392 image in
28 of its 32 blocks) or within images. Unless the attention implementation's name says "flash",
they split q, k and v at the windows' boundaries and call the attention once per window: 452 calls
a forward for one such image, ~60 µs of host time each, which left the GPU idle half of a
Qwen2.5-VL LoRA step (benchmarks/RESULTS.md, session 30). Under a name with "flash" they pass the
boundaries (`cu_seq_lens_q`) to one call instead, the path flash-attn users get; `packed_attention`
serves that call with torch's own variable-length flash kernel (torch.nn.attention.varlen), so
nothing outside torch is needed.

Where that kernel cannot run (CPU, fp32, dropout, a torch without it), the windows are attended one by
one with SDPA, as transformers does itself: the same values either way. A trained encoder takes the
kernel too: its bf16 gradients match the segments' computed in fp32 on an H200
(tests/test_gpu_vision_attention.py; benchmarks/RESULTS.md, session 31).
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

NAME = "lightning_mcore_flash_varlen"  # "flash" in the name: transformers passes the boundaries

try:
    from torch.nn.attention.varlen import varlen_attn
except ImportError:  # torch < 2.10
    varlen_attn = None
_TAKES_SCALE = varlen_attn is not None and "scale" in inspect.signature(varlen_attn).parameters


def packed_attention(module, query, key, value, attention_mask=None, dropout: float = 0.0, scaling=None,
                     cu_seq_lens_q=None, cu_seq_lens_k=None, max_length_q=None, max_length_k=None,
                     is_causal=False, **kwargs):
    """transformers' attention-interface call on one packed sequence: q, k, v [1, heads, tokens,
    dim], segments ending at `cu_seq_lens_q`; returns ([1, tokens, heads, dim], None)."""
    if cu_seq_lens_q is None or attention_mask is not None or query.shape[0] != 1:
        raise ValueError(f"{NAME} serves transformers' vision encoders' packed calls (cu_seq_lens_q, no mask, "
                         f"one sequence); this module ({type(module).__name__}) called it otherwise")
    cu_k = cu_seq_lens_q if cu_seq_lens_k is None else cu_seq_lens_k
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [tokens, heads, dim]
    if not is_causal and _runs_flash(q, dropout, scaling):  # the encoders' calls are not causal
        extra = {"scale": scaling} if _TAKES_SCALE and scaling is not None else {}
        max_q = _longest(cu_seq_lens_q) if max_length_q is None else int(max_length_q)
        max_k = _longest(cu_k) if max_length_k is None else int(max_length_k)
        out = varlen_attn(q.contiguous(), k.contiguous(), v.contiguous(), cu_seq_lens_q.int(), cu_k.int(),
                          max_q, max_k, **extra)
    else:
        out = _by_segment(q, k, v, cu_seq_lens_q, cu_k, dropout, scaling, is_causal)
    return out.unsqueeze(0), None


def _longest(cu: torch.Tensor) -> int:
    return int((cu[1:] - cu[:-1]).max())


def _runs_flash(q: torch.Tensor, dropout: float, scaling) -> bool:
    """Whether the flash kernel serves this call: half precision on a GPU, no dropout, a scale it takes."""
    default_scale = scaling is None or abs(scaling - q.shape[-1] ** -0.5) < 1e-12
    return (varlen_attn is not None and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)
            and dropout == 0.0 and (_TAKES_SCALE or default_scale))


def _by_segment(q, k, v, cu_q, cu_k, dropout, scaling, is_causal) -> torch.Tensor:
    """Each segment on its own, as transformers' non-flash path attends them."""
    bounds_q, bounds_k = cu_q.tolist(), cu_k.tolist()
    outs = []
    for (a, b), (c, d) in zip(zip(bounds_q, bounds_q[1:]), zip(bounds_k, bounds_k[1:])):
        seg = [t.transpose(0, 1).unsqueeze(0) for t in (q[a:b], k[c:d], v[c:d])]  # [1, heads, n, dim]
        outs.append(F.scaled_dot_product_attention(*seg, dropout_p=dropout, scale=scaling,
                                                   is_causal=bool(is_causal))[0].transpose(0, 1))
    return torch.cat(outs)


def use_packed_attention(encoder: torch.nn.Module) -> torch.nn.Module:
    """Make a transformers vision encoder attend through `packed_attention`. The name is set on its
    config as is: transformers' checks of a name with "flash" would look for flash-attn or a hub
    kernel, neither of which this function needs."""
    AttentionInterface.register(NAME, packed_attention)
    encoder.config._attn_implementation = NAME
    return encoder
