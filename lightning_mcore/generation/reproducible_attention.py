"""Decode steps that are bitwise reproducible under Trainer(deterministic=True).

Transformer Engine's fused (cuDNN) attention is not bitwise reproducible for a decode step, one
query over more than 128 cached keys: two identical teacher-forced decoding passes over the same
weights first differed at 129 keys, in a layer's core attention, and nowhere before (H100 and
H200, TE 2.20.2, megatron-core 0.19.2; benchmarks/RESULTS.md, issue 21). Prefill and training
(many queries) were reproducible. TE's unfused attention (batched matmuls and a softmax) is, and
costs little for one query, so deterministic runs decode with it.

TE picks its backend from environment variables (fused and flash off leaves the unfused one) read when it selects one, and selects again only
when its shapes change or when asked (the flag TE's own tests set): both are set for the step and
restored after, so training and prefill keep the fused kernels.
"""

from __future__ import annotations

import contextlib
import os

import torch

SELECT = ("NVTE_FUSED_ATTN", "NVTE_FLASH_ATTN")  # both off: TE runs its unfused attention


def _backend_cache():
    """TE's record of its last backend choice (None without TE)."""
    try:  # optional dependency (transformer_engine)
        from transformer_engine.pytorch.attention.dot_product_attention import dot_product_attention
    except ImportError:
        return None
    return getattr(dot_product_attention, "_attention_backends", None)


def wanted(device: torch.device) -> bool:
    """Deterministic algorithms requested (Trainer(deterministic=True)) on a GPU."""
    return device.type == "cuda" and torch.are_deterministic_algorithms_enabled()


@contextlib.contextmanager
def unfused_attention(enabled: bool = True):
    """TE's unfused attention for the calls inside (nothing changes when not `enabled` or
    without TE)."""
    cache = _backend_cache() if enabled else None
    if cache is None:
        yield
        return
    saved = {name: os.environ.get(name) for name in SELECT}
    os.environ.update({name: "0" for name in SELECT})
    cache["backend_selection_requires_update"] = True
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        cache["backend_selection_requires_update"] = True
