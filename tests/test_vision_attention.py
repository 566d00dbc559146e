"""model/vision_attention.py: our vision encoders attend each block's windows (or images) in one packed
call, and give transformers' own encoder's output bit for bit (on CPU the packed call attends the
segments one by one, as transformers does; test_gpu_vision_attention.py checks the flash kernel)."""

import copy
from unittest import mock

import pytest
import torch

from vlm_models import make_vlm
from lightning_mcore.model import vision_attention
from lightning_mcore.model.vision_attention import NAME, packed_attention, use_packed_attention
from lightning_mcore.models import gpt_config_from_hf, vision_encoder

# images of different sizes: windows cut at the edges come out shorter than the rest
GRIDS = [(1, 12, 8), (1, 6, 10), (2, 4, 4)]


def _inputs(encoder, seed=0):
    c = encoder.config
    grid = torch.tensor(GRIDS)
    patches = int(grid.prod(-1).sum())
    dim = c.in_channels * c.temporal_patch_size * c.patch_size ** 2
    return torch.randn(patches, dim, generator=torch.Generator().manual_seed(seed)), grid


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_packed_encoder_equals_transformers_encoder(family, tmp_path):
    hf = make_vlm(family, tmp_path)
    theirs = hf.model.visual
    assert theirs.config._attn_implementation in ("sdpa", "eager")  # transformers' per-window path
    ours = use_packed_attention(copy.deepcopy(theirs))
    pixels, grid = _inputs(theirs)
    calls = []
    real = vision_attention._by_segment

    def counted(q, k, v, cu_q, *rest):
        calls.append(len(cu_q) - 1)
        return real(q, k, v, cu_q, *rest)

    with torch.no_grad():
        want = theirs(pixels, grid_thw=grid)
        with mock.patch.object(vision_attention, "_by_segment", counted):
            got = ours(pixels, grid_thw=grid)
    for name in ("last_hidden_state", "pooler_output"):
        if getattr(want, name, None) is not None:
            assert torch.equal(getattr(got, name), getattr(want, name)), name
    depth = theirs.config.depth
    assert len(calls) == depth  # one call a block, whatever the windows
    segments = int(torch.tensor(GRIDS)[:, 0].sum())  # transformers' attention segments of full blocks: frames
    assert max(calls) > segments if family == "qwen2_5_vl" else set(calls) == {segments}


def test_our_families_build_their_encoders_packed(tmp_path):
    make_vlm("qwen2_5_vl", tmp_path)
    encoder = vision_encoder(*gpt_config_from_hf(tmp_path))
    assert encoder.config._attn_implementation == NAME
    assert all(m.config._attn_implementation == NAME for m in encoder.modules() if hasattr(m, "config"))


def test_packed_attention_refuses_what_it_does_not_serve():
    q = torch.randn(1, 2, 5, 8)
    with pytest.raises(ValueError, match="cu_seq_lens_q"):
        packed_attention(torch.nn.Module(), q, q, q, attention_mask=None)
    with pytest.raises(ValueError, match="cu_seq_lens_q"):
        packed_attention(torch.nn.Module(), q, q, q, attention_mask=torch.ones(1, 1, 5, 5, dtype=torch.bool),
                         cu_seq_lens_q=torch.tensor([0, 5]))


def test_flash_kernel_is_called_with_torchs_layout():
    """Where the kernel runs (CUDA, half precision), it gets [tokens, heads, dim] and int32 boundaries,
    and its output comes back as transformers' [1, tokens, heads, dim]: checked on CPU with a stand-in
    kernel that attends segment by segment."""
    q, k, v = (torch.randn(1, 3, 10, 8, generator=torch.Generator().manual_seed(i)) for i in range(3))
    cu = torch.tensor([0, 4, 10], dtype=torch.int64)
    seen = {}

    def kernel(q_, k_, v_, cu_q, cu_k, max_q, max_k, **kw):
        seen.update(shape=q_.shape, dtype=cu_q.dtype, max=(max_q, max_k), **kw)
        return vision_attention._by_segment(q_, k_, v_, cu_q, cu_k, 0.0, kw.get("scale"), False)

    with mock.patch.object(vision_attention, "varlen_attn", kernel), \
            mock.patch.object(vision_attention, "_runs_flash", lambda *a: True):
        got, _ = packed_attention(torch.nn.Module(), q, k, v, cu_seq_lens_q=cu, max_length_q=6, scaling=0.3)
    assert seen["shape"] == (10, 3, 8) and seen["dtype"] == torch.int32 and seen["max"] == (6, 6)
    with mock.patch.object(vision_attention, "varlen_attn", kernel), \
            mock.patch.object(vision_attention, "_runs_flash", lambda *a: True):
        again, _ = packed_attention(torch.nn.Module(), q, k, v, cu_seq_lens_q=cu, scaling=0.3)
    assert seen["max"] == (6, 6) and torch.equal(again, got)  # the longest segment, when not given
    want = torch.cat([torch.nn.functional.scaled_dot_product_attention(
        q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], scale=0.3) for a, b in ((0, 4), (4, 10))], dim=2)
    torch.testing.assert_close(got, want.transpose(1, 2), rtol=0, atol=1e-6)
    assert ("scale" in seen) == vision_attention._TAKES_SCALE


def test_flash_kernel_serves_only_half_precision_gpu_calls():
    q = torch.randn(5, 2, 8, dtype=torch.bfloat16)
    cuda = mock.patch.object(torch.Tensor, "is_cuda", new_callable=mock.PropertyMock, return_value=True)
    with cuda, mock.patch.object(vision_attention, "varlen_attn", object()):
        assert vision_attention._runs_flash(q, 0.0, 8 ** -0.5)
        assert not vision_attention._runs_flash(q.float(), 0.0, 8 ** -0.5)  # fp32
        assert not vision_attention._runs_flash(q, 0.1, 8 ** -0.5)  # dropout
        assert vision_attention._runs_flash(q.requires_grad_(), 0.0, 8 ** -0.5)  # a trained encoder too
    assert not vision_attention._runs_flash(q.detach(), 0.0, 8 ** -0.5)  # CPU

