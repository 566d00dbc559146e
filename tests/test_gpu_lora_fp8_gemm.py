"""lora/fp8_gemm.py's kernels on a GPU (FP8 tensor cores: torch._scaled_mm, torch._scaled_grouped_mm)
against the hand computation in fp64 (test_lora_fp8_gemm.py's reference): row counts that are not
multiples of 16 and an expert without tokens included; skipped without CUDA."""

import pytest
import torch

from lightning_mcore.lora.fp8_gemm import quantize_input, scaled_grouped_mm, scaled_mm
from lightning_mcore.lora.quantized_base import quantize_rows
from test_lora_fp8_gemm import rounded_rows

pytestmark = [pytest.mark.gpu]


def _bf16_close(got, want):
    # the kernels accumulate in fp32 and write bf16: within bf16's rounding of the largest output
    torch.testing.assert_close(got.double(), want, rtol=2.0 ** -7, atol=2.0 ** -7 * float(want.abs().max()))


def test_scaled_mm_is_the_rounded_input_times_the_codes():
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(300, 2048, device="cuda", dtype=torch.bfloat16, generator=gen)
    w = torch.randn(768, 2048, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
    codes, scales = quantize_rows(w)
    xq, sx = quantize_input(x)
    want = rounded_rows(x.float()) @ (codes.double() * scales.double().unsqueeze(-1)).t()
    _bf16_close(scaled_mm(xq, sx, codes, scales, torch.bfloat16), want)


def test_scaled_grouped_mm_is_each_experts_rows_times_its_codes():
    gen = torch.Generator(device="cuda").manual_seed(1)
    counts = [37, 0, 301, 5, 170, 1, 64, 22]
    x = torch.randn(sum(counts), 2048, device="cuda", dtype=torch.bfloat16, generator=gen)
    w = torch.randn(len(counts), 1536, 2048, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
    codes, scales = quantize_rows(w)
    offsets = torch.tensor(counts, device="cuda").cumsum(0).to(torch.int32)
    xq, sx = quantize_input(x)
    got = scaled_grouped_mm(xq, sx, codes, scales, offsets, torch.bfloat16)
    rows = torch.arange(sum(counts)).split(counts)
    want = torch.cat([rounded_rows(x[r].float()) @ (codes[e].double() * scales[e].double().unsqueeze(-1)).t()
                      for e, r in enumerate(rows)])
    _bf16_close(got, want)
