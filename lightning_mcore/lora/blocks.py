"""A weight [..., out, in] as blocks of `block` consecutive inputs of a row: what NF4 and MXFP4
(lora/nf4.py, lora/mxfp4.py) each give one scale."""

from __future__ import annotations

import torch


def as_blocks(weight: torch.Tensor, block: int, codec: str) -> torch.Tensor:
    """fp32 [..., out, in / block, block] of `weight`; its input width must be whole blocks."""
    *lead, inp = weight.shape
    if inp % block:
        raise ValueError(f"{codec} blocks of {block} need an input width that is a multiple of {block}, "
                         f"got {inp}")
    return weight.detach().float().reshape(*lead, inp // block, block)
