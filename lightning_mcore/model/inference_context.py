"""The one module that touches Megatron-Core's inference internals (the seam our KV cache, decode
CUDA graphs and linear-attention state stand on; tests/test_inference_context.py holds it to that).

What we take from mcore: `StaticInferenceContext`, which GPTModel.forward reads as
`inference_context` (each attention layer appends its keys/values to
`key_value_memory_dict[layer_number]` at `sequence_len_offset` and attends over the cache, in
prefill or decode mode), and the process-wide `InferenceMode` flag that switches mcore's layers to
their inference paths (only the last position reaches the output layer).

Migration path: mcore marks the static engine deprecated (an open PR removes it) and its dynamic
engine's paged KV cache needs flash-attn >= 2.7.3, which our GPU images lack. When the static
context goes, only this file changes: `new_context` builds the dynamic context (or a context class
of our own with the same four fields: `key_value_memory_dict`, `sequence_len_offset`, the
prefill/decode switch, `max_batch_size`) and `inference_mode` follows mcore's new flag; the callers
(generation/kv_cache.py, generation/decode_graphs.py, model/gated_delta_net.py) only use the functions below.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.inference.contexts import StaticInferenceContext
from megatron.core.inference.utils import InferenceMode


def new_context(rows: int, max_length: int) -> Any:
    """An empty context for `rows` sequences of up to `max_length` positions; the caller puts
    each layer's buffers in with `keep_buffers`."""
    return StaticInferenceContext(rows, max_length)


def keep_buffers(context, layer_number: int, buffers: tuple[torch.Tensor, ...]) -> None:
    """A layer's cache: (keys, values) [max_length, rows, groups, dim] for attention (mcore's
    layout), or a linear-attention layer's own state."""
    context.key_value_memory_dict[layer_number] = buffers


def buffers(context, layer_number: int) -> tuple[torch.Tensor, ...]:
    return context.key_value_memory_dict[layer_number]


def go_to(context, position: int) -> None:
    """Next call writes at `position`: a prefill from 0 (a kept context starts anew), a decode
    step of one new column after it."""
    context.sequence_len_offset = position
    if position:
        context.enable_decode_mode()
    else:
        context.enable_prefill_mode()


def position(context) -> int:
    """Where the next call writes (0: a prefill starts from nothing)."""
    return int(context.sequence_len_offset)


def inference_mode():
    """mcore reads a process-wide flag, not the context, to run its inference paths."""
    return InferenceMode.active()


def is_active() -> bool:
    """Whether mcore's layers run their inference paths now (inside `inference_mode()`)."""
    return InferenceMode.is_active()
