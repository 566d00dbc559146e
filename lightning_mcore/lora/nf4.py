"""NF4 (4-bit NormalFloat, QLoRA: Dettmers et al. 2023, bitsandbytes' quant_type="nf4") codes
of a weight [..., out, in]: blocks of 64 consecutive elements along a row (the input dimension),
one absmax scale per block, each element the index of the codebook value nearest to x / absmax.

    codes  [..., out, in / 2]   uint8  two 4-bit indices a byte, the first element in the high
                                       nibble (as bitsandbytes packs them)
    scales [..., out, in / 64]  fp32   absmax(|block|)
    W'     = NF4[index] * absmax

The codebook's 16 values are quantiles of N(0, 1) scaled into [-1, 1] with an exact zero; the
constants are bitsandbytes' (csrc/kernels.cu `nf4_dequantization_lut`, functional.py
`get_4bit_type("nf4")`), written out here. QLoRA's double quantization (the absmax scales
themselves in 8 bits, blocks of 256) is left out: the scales stay fp32 (4 bytes a block, 1/16
of a byte an element more than QLoRA's 8-bit ones).

A block never straddles a row, so it never straddles a tensor-parallel shard when a shard's
input width is a multiple of 64 (lora/adapters.py refuses other widths): the codes are the same
numbers at any layout, and quantizing is deterministic, so a resume quantizes identically.
"""

from __future__ import annotations

import torch

from lightning_mcore.lora.blocks import as_blocks

BLOCK = 64
# bitsandbytes' NF4 codebook (csrc/kernels.cu nf4_dequantization_lut; functional.py get_4bit_type)
CODEBOOK = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
)


def _values(device) -> torch.Tensor:
    return torch.tensor(CODEBOOK, dtype=torch.float32, device=device)


@torch.no_grad()
def quantize_blocks(weight: torch.Tensor, group=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scales) of `weight` [..., out, in], `in` a multiple of 64. `group` is unused: a
    block lies within one shard's row (the same signature as FP8's per-row codec)."""
    w = as_blocks(weight, BLOCK, "NF4")
    absmax = w.abs().amax(dim=-1, keepdim=True)
    scales = torch.where(absmax > 0, absmax, torch.ones_like(absmax))  # an all-zero block: codes of 0.0
    values = _values(weight.device)
    # the nearest codebook value: its index is the number of midpoints below x / absmax (a tie
    # goes to the lower value, as bitsandbytes' `x > midpoint` decision tree sends it)
    index = torch.bucketize(w / scales, (values[1:] + values[:-1]) / 2, out_int32=True).to(torch.uint8)
    return pack(index.reshape(weight.shape)), scales.squeeze(-1)


def pack(index: torch.Tensor) -> torch.Tensor:
    """4-bit indices [..., n] (n even) -> bytes [..., n / 2], element 2k in the high nibble."""
    pairs = index.reshape(*index.shape[:-1], -1, 2)
    return (pairs[..., 0] << 4) | pairs[..., 1]


def unpack(codes: torch.Tensor) -> torch.Tensor:
    """bytes [..., n / 2] -> 4-bit indices [..., n]."""
    return torch.stack((codes >> 4, codes & 0x0F), dim=-1).reshape(*codes.shape[:-1], -1)


def dequantize_blocks(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """NF4[index] * absmax per block, computed in fp32, in `dtype`."""
    values = _values(codes.device)[unpack(codes).int()]
    blocks = values.reshape(*scales.shape, BLOCK) * scales.unsqueeze(-1)
    return blocks.reshape(*codes.shape[:-1], -1).to(dtype)
