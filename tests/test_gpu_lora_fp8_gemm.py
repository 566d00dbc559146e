"""lora/fp8_gemm.py's kernels on a GPU (FP8 tensor cores: torch._scaled_mm, torch._scaled_grouped_mm)
against the hand computation in fp64 from the codes they were given (test_lora_fp8_gemm.py's
reference), row counts that are not multiples of 16 and an expert without tokens included; and the
compiled input cast against the hand rounding; skipped without CUDA."""

import pytest
import torch

from lightning_mcore.lora.fp8_gemm import quantize_input, scaled_grouped_mm, scaled_mm
from lightning_mcore.lora.quantized_base import quantize_rows
from test_lora_fp8_gemm import rounded_rows

pytestmark = [pytest.mark.gpu]


def _inputs(rows: int, seed: int):
    x = torch.randn(rows, 2048, device="cuda", dtype=torch.bfloat16, generator=torch.Generator("cuda").manual_seed(seed))
    xq, sx = quantize_input(x)
    return x, xq, sx


def _bf16_close(got, want):
    # the kernels accumulate in fp32 and write bf16: within bf16's rounding of the largest output
    torch.testing.assert_close(got.double(), want, rtol=2.0 ** -7, atol=2.0 ** -7 * float(want.abs().max()))


def test_input_codes_are_the_hand_rounding():
    x, xq, sx = _inputs(300, 0)
    want = rounded_rows(x)
    got = xq.double() * sx.double()
    # the compiled cast divides as the GPU's fp32 division does: a quotient at a rounding boundary
    # may round to the neighbouring code (H200: 6 of 230,400), never further
    differ = got != want
    assert int(differ.sum()) <= x.numel() // 10_000, int(differ.sum())
    assert bool(((got - want).abs() <= 2.0 ** -3 * want.abs())[differ].all())


def test_scaled_mm_is_the_input_codes_times_the_weight_codes():
    _, xq, sx = _inputs(300, 1)
    w = torch.randn(768, 2048, device="cuda", dtype=torch.bfloat16, generator=torch.Generator("cuda").manual_seed(2))
    codes, scales = quantize_rows(w * 0.02)
    want = (xq.double() * sx.double()) @ (codes.double() * scales.double().unsqueeze(-1)).t()
    _bf16_close(scaled_mm(xq, sx, codes, scales, torch.bfloat16), want)


def test_scaled_grouped_mm_is_each_experts_rows_times_its_codes():
    counts = [37, 0, 301, 5, 170, 1, 64, 22]
    _, xq, sx = _inputs(sum(counts), 3)
    w = torch.randn(len(counts), 1536, 2048, device="cuda", dtype=torch.bfloat16,
                    generator=torch.Generator("cuda").manual_seed(4))
    codes, scales = quantize_rows(w * 0.02)
    offsets = torch.tensor(counts, device="cuda").cumsum(0).to(torch.int32)
    got = scaled_grouped_mm(xq, sx, codes, scales, offsets, torch.bfloat16)
    rows = torch.arange(sum(counts)).split(counts)
    x = xq.double() * sx.double()
    want = torch.cat([x[r] @ (codes[e].double() * scales[e].double().unsqueeze(-1)).t() for e, r in enumerate(rows)])
    _bf16_close(got, want)
