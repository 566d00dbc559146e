"""Initial weights that do not depend on the parallel layout.

Each logical (unsharded) tensor is drawn from a generator seeded by its checkpoint key and
layer, then this rank copies out its shard. The same seed therefore gives the same model at
any TP/PP/VPP/EP, which is what makes a TP=2 run comparable to a 1-process run. The keys and
offsets come from mcore's own sharded_state_dict, so the slicing agrees with checkpoints
(including the [gate; up] layout of fused SwiGLU fc1 under TP).
"""

from __future__ import annotations

import math
import zlib

import torch
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

_VOCAB_KEYS = ("embedding.word_embeddings.weight", "output_layer.weight")
_SCALED_SUFFIXES = ("linear_proj.weight", "linear_fc2.weight")
_ZERO_SUFFIXES = (".bias", "softmax_offset")  # 1-D parameters that start at zero


def _sharded_tensors(obj):
    if isinstance(obj, ShardedTensor):
        yield obj
    elif isinstance(obj, ShardedTensorFactory):
        built = obj.build()
        yield from _sharded_tensors(built)
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _sharded_tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _sharded_tensors(v)


@torch.no_grad()
def init_layout_invariant(chunks, cfg, seed: int) -> None:
    """Overwrite every >=2-D weight of `chunks` with its layout-independent value, and zero
    the biases and attention sinks."""
    std = cfg.init_method_std
    for chunk in chunks:
        for sh in _sharded_tensors(chunk.sharded_state_dict()):
            data = sh.data
            if data is None or not data.is_floating_point():
                continue
            if data.dim() == 1 and sh.key.endswith(_ZERO_SUFFIXES):
                data.zero_()  # mcore draws the router's bias and the sinks per rank
                continue
            if data.dim() < 2:
                continue
            pre = sh.prepend_axis_num
            full_shape = list(sh.global_shape[pre:])
            rows = full_shape[0]
            if sh.key in _VOCAB_KEYS:
                rows = min(rows, cfg.vocab_size)  # padded vocab rows stay zero at any TP
            scale = std / math.sqrt(2 * cfg.num_layers) if sh.key.endswith(_SCALED_SUFFIXES) else std
            name = f"{sh.key}@{tuple(sh.global_offset[:pre])}"
            gen = torch.Generator(device=data.device)
            gen.manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
            full = torch.zeros(full_shape, device=data.device, dtype=torch.float32)
            full[:rows].normal_(0.0, scale, generator=gen)
            index = tuple(
                slice(o, o + n) for o, n in zip(sh.global_offset[pre:], data.shape)
            )
            data.copy_(full[index])
