"""Core attention on torch `scaled_dot_product_attention` for mcore's local layer spec.

mcore's own local DotProductAttention materialises the [b, heads, s, s] score matrix (it ran
out of memory at 1.2B / seq 4096 on an 80 GB H100); SDPA picks flash / memory-efficient
kernels on GPU and a fused path on CPU. Same constructor and forward as DotProductAttention,
so it drops into `submodules.core_attention`.

Sliding windows follow mcore's config (`window_size`=(left, 0), `window_attn_skip_freq`) as
its own attention and TE's do: a windowed layer's query q sees keys q - left <= k <= q, within
its own sequence when sequences are packed.

Attention sinks (mcore's softmax_type="learnable"): each head has a learnable logit that joins
the softmax's denominator only. SDPA computes it with one more key per query group whose
value is zero and whose score is the head's sink (an additive mask column): its weight
exp(sink) / (exp(sink) + sum exp(s)) adds nothing to the output.
"""

from __future__ import annotations

import contextlib
import math
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.utils import (
    is_layer_window_attention,
    make_sharded_tensors_for_checkpoint,
)

from lightning_mcore.sequence.packing import block_causal_mask, causal_mask


class SDPAttention(MegatronModule):
    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection=None,
        **_unused,
    ):
        super().__init__(config=config)
        if config.context_parallel_size > 1:
            raise ValueError(
                "context parallelism needs Transformer Engine attention "
                "(transformer_impl='transformer_engine' on GPU)."
            )
        self.attn_mask_type = attn_mask_type
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        self.softmax_scale = softmax_scale or 1.0 / math.sqrt(config.kv_channels)
        # HF's window W (keys q - W < k <= q) of this layer, or None: attends to all earlier keys.
        self.window = None
        if is_layer_window_attention(config.window_size, config.window_attn_skip_freq, layer_number):
            left, right = config.window_size
            if right != 0:
                raise ValueError(f"window_size={config.window_size}: SDPAttention is causal, "
                                 f"so it takes windows (left, 0) only.")
            self.window = None if left < 0 else left + 1
        self.softmax_offset = None
        if config.softmax_type == "learnable":  # this rank's heads' sinks (zero: layout-invariant)
            self.tp_group = (pg_collection.tp if pg_collection is not None
                             else parallel_state.get_tensor_model_parallel_group())
            heads = config.num_attention_heads // self.tp_group.size()
            self.softmax_offset = torch.nn.Parameter(torch.zeros(
                heads, dtype=config.params_dtype,
                device="cpu" if config.use_cpu_initialization else torch.cuda.current_device()))
            set_tensor_model_parallel_attributes(self.softmax_offset, True, 0, 1)
        elif config.softmax_type != "vanilla":
            raise ValueError(f"softmax_type={config.softmax_type!r} is not supported by SDPAttention.")

    def forward(
        self,
        query: torch.Tensor,  # [sq, b, heads, d]
        key: torch.Tensor,  # [sk, b, groups, d]
        value: torch.Tensor,
        attention_mask: Optional[torch.Tensor],  # mcore convention: True = masked out
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[torch.Tensor] = None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        if attention_bias is not None:
            raise NotImplementedError("SDPAttention takes no attention_bias; use the Transformer Engine spec.")
        mask = None if attention_mask is None else ~attention_mask
        if packed_seq_params is not None:
            # THD: [t, heads, d] holding several sequences; attend within each, causally (and
            # within the window on a windowed layer), through a [t, t] mask. On CUDA, a row of
            # one sequence is plain causal attention (SDPA's flash kernel, no mask), and a mask
            # needs the memory-efficient kernel, which takes no grouped keys: with them SDPA
            # falls back to its math kernel, whose [heads, t, t] scores kept for backward took
            # a Llama-3-8B LoRA step from 35 to 114 GiB (RESULTS.md session 27).
            query, key, value = (x.unsqueeze(1) for x in (query, key, value))
            plain = self.window is None and self.softmax_offset is None
            one_sequence = query.is_cuda and plain and packed_seq_params.cu_seqlens_q.numel() == 2
            mask = None if one_sequence else block_causal_mask(packed_seq_params.cu_seqlens_q, self.window)
        sq, b = query.shape[:2]
        sk = key.shape[0]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, n, s, d]
        mask_type = attn_mask_type or self.attn_mask_type
        if packed_seq_params is None and self.window is not None and sk > self.window:
            # Keys further back than the window exist: causal alone would let queries see them.
            window = causal_mask(sq, sk, self.window, query.device)
            mask = window if mask is None else mask & window
        if self.softmax_offset is not None:
            if mask is None:
                mask = (causal_mask(sq, sk, None, query.device) if mask_type == AttnMaskType.causal
                        else torch.ones(sq, sk, dtype=torch.bool, device=query.device))
            k, v, mask = _with_sink(k, v, mask, self.softmax_offset, q.dtype)
        is_causal = mask is None and (mask_type == AttnMaskType.causal or packed_seq_params is not None)
        if q.is_cuda and mask is not None and k.size(1) != q.size(1):  # the memory-efficient kernel
            k, v = (t.repeat_interleave(q.size(1) // t.size(1), dim=1) for t in (k, v))
        dropout = self.dropout_p if self.training else 0.0
        rng = (
            tensor_parallel.get_cuda_rng_tracker().fork()
            if dropout and not self.config.sequence_parallel
            else contextlib.nullcontext()
        )
        with rng:
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=is_causal,
                scale=self.softmax_scale, enable_gqa=k.size(1) != q.size(1),
            )
        out = out.permute(2, 0, 1, 3).reshape(sq, b, -1)
        return out.squeeze(1) if packed_seq_params is not None else out

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        """The sinks split over tensor-parallel ranks by head, as mcore's attention saves them."""
        if self.softmax_offset is None:
            return {}
        return make_sharded_tensors_for_checkpoint(
            self.state_dict(prefix="", keep_vars=True), prefix, {"softmax_offset": 0},
            sharded_offsets, tp_group=self.tp_group, dp_cp_group=(metadata or {}).get("dp_cp_group"))


def _with_sink(k, v, mask, sinks, dtype):
    """k, v [b, groups, sk, d] with a zero key and value appended, and the boolean `mask`
    ([sq, sk] or [b, 1, sq, sk]; True: attend) as an additive [b, heads, sq, sk + 1] mask
    whose extra column is each head's sink."""
    b, groups, _, d = k.shape
    zero = k.new_zeros(b, groups, 1, d)
    k, v = torch.cat([k, zero], dim=2), torch.cat([v, zero], dim=2)
    while mask.dim() < 4:
        mask = mask.unsqueeze(0)
    heads = sinks.shape[0]
    bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, float("-inf"))
    bias = bias.expand(mask.shape[0], heads, *mask.shape[2:])
    sink = sinks.to(dtype).view(1, heads, 1, 1).expand(*bias.shape[:-1], 1)
    return k, v, torch.cat([bias, sink], dim=-1)
