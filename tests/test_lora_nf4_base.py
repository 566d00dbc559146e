"""LoRA over a 4-bit NF4 frozen base (LoRAConfig.base_precision="nf4", lora/nf4.py).

The reference is bitsandbytes' published algorithm, computed by hand here: the codebook rebuilt
from its definition (create_normal_map: normal quantiles, offset 0.9677083, scaled into [-1, 1]),
each block of 64 inputs scaled by its absmax, every element the nearest codebook value:
  - the codec's dequantized values are those; two codes a byte, the first in the high nibble;
  - a model's logits and adapter gradients equal a bf16 model's whose base is that (dense layers
    and torch's grouped experts), and autograd saves no base weight (test_lora_fp8_base's check);
  - on a tiny Qwen2-MoE whose shards hold whole blocks, 3 SGD steps at TP=1, TP=2 and EP=2
    (torch's grouped experts) equal the reference run on the hand-dequantized HF checkpoint; the
    reported error is the hand one, larger than FP8's on the same weights and within NF4's
    bound; peft and the merged export reproduce the logits and say "nf4";
  - a TP=2 run resumed at TP=1 continues it; a shard width that splits a block is refused.
"""

import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hf_models import make_hf_model
from lightning_mcore.lora import nf4
from lightning_mcore.lora.adapters import apply_lora
from lightning_mcore.lora.config import LoRAConfig, LoRAError
from readme import section
from test_lora_experts_resume import adapters as saved_adapters
from test_lora_experts_resume import run as run_with_checkpoints
from test_lora_fp8_base import (ADAPTED, EXPERTS, _chunk, by_hand, computes_with_the_codes_and_saves_no_weight,
                                docs_config_trains_and_exports_merged, dequantized_copy,
                                equals_dequantized_reference_across_layouts, kind_of)
from toy import tiny_config

NF4 = LoRAConfig(target_modules="all-linear", rank=8, alpha=16.0, base_precision="nf4")
# every TP=2 / expert-TP=2 shard's input width a multiple of 64: q = 4 heads x 32, FFNs 128
WHOLE_BLOCKS = dict(hidden_size=128, intermediate_size=128, moe_intermediate_size=128,
                    shared_expert_intermediate_size=128)


def codebook() -> torch.Tensor:
    """bitsandbytes' create_normal_map(offset=0.9677083, use_extra_value=True), its 16 values:
    8 positive and 7 negative normal quantiles and 0, divided by the largest."""
    offset = 0.9677083
    positive = torch.special.ndtri(torch.linspace(offset, 0.5, 9)[:-1].double())
    negative = -torch.special.ndtri(torch.linspace(offset, 0.5, 8)[:-1].double())
    values = torch.cat([positive, negative, torch.zeros(1, dtype=torch.float64)]).float().sort().values
    return values / values.max()


def nf4_by_hand(w: torch.Tensor) -> torch.Tensor:
    """W' per block of 64 along the last dimension: the codebook value nearest x / absmax, times absmax."""
    blocks = w.float().reshape(*w.shape[:-1], -1, 64)
    absmax = blocks.abs().amax(dim=-1, keepdim=True)
    code = codebook()
    nearest = (blocks / absmax).unsqueeze(-1).sub(code).abs().argmin(dim=-1)
    return (code[nearest] * absmax).reshape(w.shape)


# ---------------------------------------------------------------- the codec
def test_codec_is_bitsandbytes_nf4_by_hand():
    torch.testing.assert_close(torch.tensor(nf4.CODEBOOK), codebook(), rtol=0, atol=0)
    w = torch.randn(6, 256, generator=torch.Generator().manual_seed(0)) * 0.02
    w[1, 64:128] *= 50  # blocks of very different scales in one row: each has its own
    w[2, :64] = -w[2, :64].abs()  # a block whose absmax is a negative element (code -1.0)
    codes, scales = nf4.quantize_blocks(w)
    assert codes.dtype == torch.uint8 and codes.shape == (6, 128) and scales.shape == (6, 4)
    torch.testing.assert_close(scales, w.abs().reshape(6, 4, 64).amax(-1), rtol=0, atol=0)
    torch.testing.assert_close(nf4.dequantize_blocks(codes, scales, torch.float32), nf4_by_hand(w), rtol=0, atol=0)
    assert nf4.dequantize_blocks(codes, scales, torch.float32)[2, :64].min() == -scales[2, 0]
    # an all-zero block dequantizes to zeros (bitsandbytes would divide by its zero absmax)
    zero = torch.zeros(1, 64)
    assert torch.equal(nf4.dequantize_blocks(*nf4.quantize_blocks(zero), torch.float32), zero)
    # packing: two indices a byte, the first element in the high nibble (bitsandbytes' order)
    index = torch.randint(0, 16, (3, 8), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    assert torch.equal(nf4.pack(index), index[:, 0::2] * 16 + index[:, 1::2])
    assert torch.equal(nf4.unpack(nf4.pack(index)), index)


def test_a_weight_that_splits_a_block_is_refused_where_quantized():
    from lightning_mcore.export_checkpoint import single_process_megatron

    with single_process_megatron():
        chunk = _chunk(tiny_config(num_layers=1, ffn_hidden_size=96), torch.float32)
        with pytest.raises(LoRAError, match=r"nf4.*decoder\.layers\.0\.mlp\.linear_fc2\.weight holds 96 inputs"):
            apply_lora([chunk], NF4, seed=0)


@pytest.mark.parametrize("experts", [{}, EXPERTS], ids=["dense", "torch_experts"])
def test_nf4_base_computes_with_the_codes_and_saves_no_weight(experts):
    computes_with_the_codes_and_saves_no_weight(experts, "nf4", nf4_by_hand)


# ---------------------------------------------------------------- across layouts
def largest_half_gap() -> float:
    """The most an element can move when rounded to the nearest code, as a fraction of its
    block's absmax: half the widest gap between neighbouring codes (0.7230 .. 1.0)."""
    code = codebook()
    return float((code[1:] - code[:-1]).max()) / 2


def block_bounds(source: Path) -> dict:
    """Per kind of adapted weight, h * sqrt(sum over blocks of 64 absmax^2 / sum W^2), h the
    largest half gap: the relative error NF4 cannot exceed on these weights."""
    sums: dict = {}
    for name, w in load_file(source / "model.safetensors").items():
        if name.rsplit(".", 2)[-2] in ADAPTED and name.endswith(".weight"):
            peaks = w.float().reshape(*w.shape[:-1], -1, 64).abs().amax(-1)
            s = sums.setdefault(kind_of(name), [0.0, 0.0])
            s[0], s[1] = s[0] + 64 * float(peaks.square().sum()), s[1] + float(w.float().square().sum())
    return {k: largest_half_gap() * math.sqrt(peak / norm) for k, (peak, norm) in sums.items()}


@pytest.mark.distributed
def test_nf4_base_equals_dequantized_reference_across_layouts(tmp_path):
    # (not PP=2: a stage holds whole layers, quantized as at PP=1; FP8's test runs it)
    hand_errors, relative = equals_dequantized_reference_across_layouts(tmp_path, NF4, nf4_by_hand, pp2=False,
                                                                       **WHOLE_BLOCKS)
    # the error: larger than FP8's (a scale per row, 3 mantissa bits) on the same weights, and
    # bounded: an element moves by at most half the widest code gap times its block's absmax
    source = tmp_path / "source"
    fp8_errors, bound = dequantized_copy(source, tmp_path / "fp8", by_hand), block_bounds(source)
    for kind, error in hand_errors.items():
        assert fp8_errors[kind] < error < bound[kind], (kind, fp8_errors[kind], error, bound[kind])
    print(f"NF4 base: weights' relative error {hand_errors} (fp8: {fp8_errors}, bound: {bound}); "
          f"the base logits' {relative:.4f}")
    # as for FP8, two quantized linears in series per residual branch, the branches' roundings
    # independent: twice the weights' largest error bounds the logits (measured: 0.171)
    assert 0 < relative < 2 * max(hand_errors.values())


@pytest.mark.distributed
def test_nf4_run_saved_at_tp2_resumes_at_tp1(tmp_path):
    """The checkpoint holds the adapters (and Adam's moments) only; the base is loaded and
    quantized again at resume, at TP=1 to the TP=2 run's codes (blocks within a shard's row):
    the resumed run continues the TP=2 one within fp32 rounding (other reduction orders)."""
    make_hf_model("qwen2_moe", tmp_path / "source", **WHOLE_BLOCKS)
    tp2 = dict(tensor_model_parallel_size=2, sequence_parallel=True)
    straight2 = run_with_checkpoints(tmp_path, "straight2", 2, lora=NF4, **tp2)
    saved = tmp_path / "straight2-ckpts" / "epoch=0-step=2.ckpt"
    resumed = run_with_checkpoints(tmp_path, "resumed", 1, ckpt_path=str(saved), lora=NF4)
    assert len(straight2) == 4 and resumed == pytest.approx(straight2[2:], rel=1e-6), (resumed, straight2)
    want, got = saved_adapters(tmp_path, "straight2", "end", 2), saved_adapters(tmp_path, "resumed", "end", 1)
    fresh = saved_adapters(tmp_path, "straight2", "init", 2)
    assert max((want[k] - fresh[k]).abs().max().item() for k in want) > 1e-2, "nothing trained"
    assert got.keys() == want.keys()
    for key, tensor in want.items():
        torch.testing.assert_close(got[key], tensor, rtol=0, atol=1e-6, msg=key)


def test_docs_nf4_config_trains_and_exports_merged(tmp_path):
    """docs/lora.md's NF4 commands, verbatim: the NF4 base is reported and the export command
    (which rebuilds and quantizes the base) writes the merged model, marked nf4."""
    text = section("LoRA over an NF4 (4-bit) base", "lora.md")
    docs_config_trains_and_exports_merged(tmp_path, text, "nf4", "sft_lora_nf4")


def test_a_linear_of_partial_blocks_is_refused_before_launch(capsys):
    """The docs' config with down_proj targeted (the tiny Llama's 352 inputs): one `error:` line
    naming the keys, exit 2, before any worker starts."""
    from test_configs import fails

    err = fails(capsys, "--config", "configs/sft_lora_nf4.yaml", "--model.init_args.lora.target_modules", "all-linear")
    assert "error: invalid LoRA setting (model.init_args.lora.base_precision=nf4" in err
    assert "linear_fc2 has 352 inputs (ffn_hidden_size), not a multiple of 64" in err


def test_a_tensor_parallel_shard_that_splits_a_block_is_refused_before_launch():
    """Row-parallel inputs split over TP (experts: expert-TP): 128 FFN inputs hold whole blocks
    at TP=1 and TP=2 (64 a rank) but not at TP=4 (32); the refusal names the option to change.
    The experts' fc2 (256 inputs) splits over expert-TP alone."""
    from lightning_mcore.lora.checks import LoRAPlanError, check_lora_plan
    from toy import tiny_config

    lora = LoRAConfig(rank=8, alpha=16, target_modules=["down_proj"], base_precision="nf4")
    dense = tiny_config(hidden_size=128, ffn_hidden_size=128, num_attention_heads=4)
    for tp in (1, 2):
        check_lora_plan(lora, dense, tp=tp)
    with pytest.raises(LoRAPlanError, match=r"linear_fc2's 128 inputs \(ffn_hidden_size\) split over 4 "
                                            r"tensor-parallel ranks leave 32 per rank") as refused:
        check_lora_plan(lora, dense, tp=4)
    assert refused.value.options == ("tensor_model_parallel_size",)
    moe = tiny_config(hidden_size=128, num_moe_experts=4, moe_ffn_hidden_size=256, moe_router_topk=2)
    check_lora_plan(lora, moe, tp=8, etp=4)  # 256 / 4 = 64 a rank: whole blocks
    with pytest.raises(LoRAPlanError, match=r"experts' linear_fc2's 256 inputs .* leave 32 per rank") as refused:
        check_lora_plan(lora, moe, tp=1, etp=8)
    assert refused.value.options == ("expert_tensor_parallel_size",)


@pytest.mark.parametrize("name", ["fp8", "nf4", "mxfp4"])
def test_dequantizing_a_few_rows_at_a_time_gives_the_one_call_values(name, monkeypatch):
    """A weight is dequantized in chunks of rows (bounded fp32 intermediates): an experts block
    [E, out, in] chunked into 3 rows at a time, rows crossing expert boundaries, equals the codec's
    own dequantization of the whole block."""
    from lightning_mcore.lora import quantized_base

    codec = quantized_base.CODECS[name]
    block = torch.randn(3, 8, 128, generator=torch.Generator().manual_seed(0))
    codes, scales = codec.quantize(block, None)
    whole = codec.dequantize(codes, scales, torch.bfloat16)
    monkeypatch.setattr(quantized_base, "CHUNK_ELEMENTS", 3 * 128)
    chunked = quantized_base.dequantized(codec, codes, scales, torch.bfloat16)
    assert chunked.shape == whole.shape == block.shape and torch.equal(chunked, whole)
    assert torch.equal(quantized_base.dequantized(codec, codes[1], scales[1], torch.bfloat16), whole[1])
