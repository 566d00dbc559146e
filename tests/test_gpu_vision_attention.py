"""model/vision_attention.py's flash path on a GPU: torch's variable-length kernel against the segments
attended one by one in fp32, and a Qwen2.5-VL encoder (windows and full blocks) packed against
transformers' own per-window SDPA in bf16; skipped without CUDA."""

import copy

import pytest
import torch

from test_vision_attention import _inputs
from vlm_models import make_vlm
from lightning_mcore.model import vision_attention
from lightning_mcore.model.vision_attention import packed_attention, use_packed_attention

pytestmark = [pytest.mark.gpu]


def merged(out) -> torch.Tensor:
    """The merger's output (transformers 5.17 returns it as such, later ones as pooler_output)."""
    return getattr(out, "pooler_output", out).float()


def test_kernel_against_segments_in_fp32():
    assert vision_attention.varlen_attn is not None, "torch without torch.nn.attention.varlen"
    g = torch.Generator("cuda").manual_seed(0)
    q, k, v = (torch.randn(1, 16, 1000, 80, device="cuda", generator=g).bfloat16() for _ in range(3))
    cu = torch.tensor([0, 64, 96, 112, 176, 600, 1000], device="cuda")
    got, _ = packed_attention(torch.nn.Module(), q, k, v, cu_seq_lens_q=cu, max_length_q=424, scaling=80 ** -0.5)
    want = vision_attention._by_segment(*(t[0].transpose(0, 1).float() for t in (q, k, v)), cu, cu, 0.0,
                                        80 ** -0.5, False)
    assert vision_attention._runs_flash(q, 0.0, 80 ** -0.5)
    torch.testing.assert_close(got[0].float(), want, rtol=0, atol=2e-2)


def test_encoder_against_transformers_in_bf16(tmp_path):
    theirs = make_vlm("qwen2_5_vl", tmp_path).model.visual.cuda().bfloat16()
    ours = use_packed_attention(copy.deepcopy(theirs))
    pixels, grid = _inputs(theirs)
    with torch.no_grad():
        want, got = (merged(m(pixels.cuda().bfloat16(), grid_thw=grid.cuda())) for m in (theirs, ours))
    torch.testing.assert_close(got, want, rtol=2 ** -6, atol=2 ** -6 * float(want.abs().max()))


def test_kernel_backward_against_segments_in_fp32():
    """The kernel's gradients: what lets a trained encoder take the flash path (_runs_flash)."""
    g = torch.Generator("cuda").manual_seed(1)
    q, k, v = (torch.randn(600, 16, 80, device="cuda", generator=g).bfloat16().requires_grad_() for _ in range(3))
    cu = torch.tensor([0, 64, 96, 400, 600], device="cuda", dtype=torch.int32)
    out = vision_attention.varlen_attn(q, k, v, cu, cu, 304, 304)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    ref = [t.detach().float().requires_grad_() for t in (q, k, v)]
    want_out = vision_attention._by_segment(*ref, cu, cu, 0.0, None, False)
    want = torch.autograd.grad(want_out, ref, grad.float())
    for a, b in zip(got, want):
        torch.testing.assert_close(a.float(), b, rtol=0, atol=3e-2 * float(b.abs().max()))
