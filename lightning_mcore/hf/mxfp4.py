"""MXFP4 weights as published (config.json quantization_config.quant_method "mxfp4"): each
tensor X is stored as X_blocks [..., out, G, 16] (uint8, two 4-bit E2M1 values per byte, low
nibble first) and X_scales [..., out, G] (uint8 E8M0 exponents, bias 127), one scale per block
of 32 values along the input dimension. Dequantized as transformers does
(integrations/mxfp4.py), into [..., in, out]: every value is a 4-bit value times a power of two,
exact in bfloat16 and float32 (the decoding is lora/mxfp4.py's, the codec LoRA holds a base in).
We train and export the dequantized weights (bf16), not MXFP4; LoRA with base_precision "mxfp4"
holds the frozen ones as MXFP4 again, with the same values.
"""

from __future__ import annotations

from typing import Optional

import torch

from lightning_mcore.hf.checkpoint import CheckpointError
from lightning_mcore.lora.mxfp4 import dequantize_blocks

BLOCKS, SCALES = "_blocks", "_scales"


def dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """blocks [..., out, G, B] and scales [..., out, G] -> float32 [..., in = G * 2B, out]."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.shape[:-1] != scales.shape:
        raise CheckpointError(f"MXFP4 blocks {list(blocks.shape)} ({blocks.dtype}) and scales "
                              f"{list(scales.shape)} ({scales.dtype}) do not match: expected uint8 "
                              f"[..., out, G, B] and [..., out, G].")
    return dequantize_blocks(blocks.flatten(-2), scales, torch.float32).transpose(-1, -2)


class MXFP4Reader:
    """A checkpoint reader (hf/checkpoint.py's interface) that shows each X_blocks/X_scales
    pair as the dequantized X, in `dtype` (the checkpoint's other weights' safetensors dtype)."""

    def __init__(self, reader, dtype: str) -> None:
        self.reader, self.dtype_name = reader, dtype
        self.quantized = {n[: -len(BLOCKS)] for n in reader.files
                          if n.endswith(BLOCKS) and n[: -len(BLOCKS)] + SCALES in reader.files}
        files = {n: p for n, p in reader.files.items()
                 if not (n.endswith((BLOCKS, SCALES)) and n[: -len(BLOCKS)] in self.quantized)}
        self.files = files | {n: reader.files[n + BLOCKS] for n in self.quantized}

    def shape(self, name: str) -> tuple:
        if name not in self.quantized:
            return self.reader.shape(name)
        *lead, out, groups, block = self.reader.shape(name + BLOCKS)
        return (*lead, groups * block * 2, out)

    def dtype(self, name: str) -> str:
        return self.dtype_name if name in self.quantized else self.reader.dtype(name)

    def get(self, name: str, dim: int = 0, start: Optional[int] = None,
            stop: Optional[int] = None) -> torch.Tensor:
        if name not in self.quantized:
            return self.reader.get(name, dim, start, stop)
        return _rows(dequantize(self.reader.get(name + BLOCKS), self.reader.get(name + SCALES)), dim, start, stop)

    def get_expert(self, name: str, expert: int, dim: int = 0, start: Optional[int] = None,
                   stop: Optional[int] = None) -> torch.Tensor:
        if name not in self.quantized:
            return self.reader.get_expert(name, expert, dim, start, stop)
        blocks = self.reader.get_expert(name + BLOCKS, expert)
        return _rows(dequantize(blocks, self.reader.get_expert(name + SCALES, expert)), dim, start, stop)


def _rows(t: torch.Tensor, dim: int, start: Optional[int], stop: Optional[int]) -> torch.Tensor:
    return t if start is None and stop is None else t.narrow(dim, start or 0, (stop or t.shape[dim]) - (start or 0))


ONLY_MXFP4 = "only mxfp4 checkpoints are read (dequantized); convert this one to bf16 first."


def other_quantization(config: dict) -> bool:
    """Whether config.json announces a quantization other than MXFP4 (its weights would load as
    their raw codes): refused by the config translation (models/__init__.py) and the loader."""
    quant = config.get("quantization_config") or {}
    return bool(quant) and quant.get("quant_method") != "mxfp4"


def quantized_view(reader, config: dict, dtype: Optional[str]):
    """`reader` as the model's weights read: MXFP4 tensors dequantized; a checkpoint in another
    quantization is refused."""
    if other_quantization(config):
        raise CheckpointError(f"config.json quantization_config.quant_method="
                              f"{config['quantization_config'].get('quant_method')!r}: {ONLY_MXFP4}")
    if not config.get("quantization_config"):
        return reader
    return MXFP4Reader(reader, dtype or "BF16")
