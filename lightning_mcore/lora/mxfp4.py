"""MXFP4 (OCP Microscaling, FP4 E2M1 elements) codes of a weight [..., out, in]: blocks of 32
consecutive elements along a row (the input dimension) share one power-of-two scale, each
element one of the 16 E2M1 values (0, ±0.5, ±1, ±1.5, ±2, ±3, ±4, ±6).

    codes  [..., out, in / 2]   uint8  two E2M1 codes a byte, the first element in the LOW nibble
                                       (as GPT-OSS's checkpoints store *_blocks: hf/mxfp4.py)
    scales [..., out, in / 32]  uint8  E8M0: the block's exponent e plus 127
    W'     = E2M1[code] * 2^e

The exponent is the smallest that holds the block's largest magnitude: e = ceil(log2(amax / 6)),
so no element saturates (the OCP rule floor(log2 amax) - 2 clips elements between 6 and 8 times
2^e to 6); each element rounds to the nearest E2M1 value, a tie to the even code. A weight that
already is MXFP4 (GPT-OSS's experts, which load dequantized, exactly) comes back with the same
values: its block holds q_i 2^e with E2M1 q_i, and the exponent chosen here is e - k with
2^k max|q_i| in [4, 6], where every 2^k q_i is again an E2M1 value (tests/test_lora_mxfp4_base.py).

A block lies within a row, so a tensor-parallel shard whose input width is a multiple of 32
holds whole blocks (lora/checks.py refuses other widths): the codes are the same at any layout.
"""

from __future__ import annotations

import torch

from lightning_mcore.lora.blocks import as_blocks

BLOCK = 32
# the 16 E2M1 values by code: the sign bit, then 2 exponent bits and 1 mantissa bit
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
MAX = 6.0  # the largest E2M1 magnitude
# the E2M1 magnitudes (codes 0-7) and the midpoints between neighbours
MAGNITUDES = FP4_VALUES[:8]
MIDPOINTS = tuple((a + b) / 2 for a, b in zip(MAGNITUDES, MAGNITUDES[1:]))
# 2^e for the exponents an E8M0 scale holds (-127 .. 127), exact in fp32 (2^-127 is subnormal): a
# table lookup, not pow/ldexp, whose device kernels need not be exact
POW2 = tuple(2.0 ** e for e in range(-127, 128))


def pow2(e: torch.Tensor) -> torch.Tensor:
    """2^e, fp32, for integer exponents e in [-127, 127]."""
    return torch.tensor(POW2, dtype=torch.float32, device=e.device)[(e + 127).long()]


@torch.no_grad()
def quantize_blocks(weight: torch.Tensor, group=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scales) of `weight` [..., out, in], `in` a multiple of 32. `group` is unused: a
    block lies within one shard's row (the same signature as FP8's per-row codec)."""
    w = as_blocks(weight, BLOCK, "MXFP4")
    amax = w.abs().amax(dim=-1, keepdim=True)
    mantissa, exponent = torch.frexp(amax / MAX)  # amax / 6 = m 2^x, m in [0.5, 1)
    e = torch.where(mantissa == 0.5, exponent - 1, exponent)  # ceil(log2(amax / 6))
    e = torch.where(amax > 0, e, torch.full_like(e, -127)).clamp(-127, 127)
    scaled = (w * pow2(-e)).abs().clamp(max=MAX)  # exact: a power of two
    mids = torch.tensor(MIDPOINTS, device=w.device)
    index = torch.bucketize(scaled, mids)  # a midpoint itself goes to the lower code
    tie = (index < len(MIDPOINTS)) & (index % 2 == 1)
    tie &= scaled == mids[index.clamp(max=len(MIDPOINTS) - 1)]
    index = index + tie.long()  # ties to the even code
    codes = (index + 8 * ((w < 0) & (index > 0)).long()).to(torch.uint8)  # the sign bit; zero stays +0
    return pack(codes.reshape(weight.shape)), (e + 127).to(torch.uint8).squeeze(-1)


def pack(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes [..., n] (n even) -> bytes [..., n / 2], element 2k in the low nibble."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """bytes [..., n / 2] -> 4-bit codes [..., n]."""
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).reshape(*packed.shape[:-1], -1)


def dequantize_blocks(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """E2M1[code] * 2^(scale - 127) per block, exact in fp32, in `dtype`."""
    values = torch.tensor(FP4_VALUES, dtype=torch.float32, device=codes.device)[unpack(codes).long()]
    blocks = values.reshape(*scales.shape, BLOCK) * pow2(scales.to(torch.int32) - 127).unsqueeze(-1)
    return blocks.reshape(*codes.shape[:-1], -1).to(dtype)
