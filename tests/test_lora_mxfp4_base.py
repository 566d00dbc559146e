"""LoRA over an MXFP4 frozen base (LoRAConfig.base_precision="mxfp4", lora/mxfp4.py).

References, each computed here independently of the codec:
  - the OCP MXFP4 format by hand: per block of 32 inputs the smallest power of two 2^e with
    amax <= 6 * 2^e (found by search), each element the nearest E2M1 value (a tie to the even
    code); the codes decode as transformers' own function decodes GPT-OSS's blocks;
  - weights that are MXFP4 already (random published-style blocks and scales) come back with the
    same values, bit for bit;
  - a model's loss and adapter gradients equal a bf16 model's whose base is the hand-dequantized
    weights (dense layers and torch's grouped experts), and autograd saves no base weight;
  - GPT-OSS's published MXFP4 experts: LoRA on them over an mxfp4 base trains exactly as over
    the loaded (dequantized) bf16 base, with a reported quantization error of 0, and its first
    logits are transformers' own on the MXFP4 checkpoint.
"""

import json

import pytest
import torch
from safetensors.torch import load_file

from hf_models import hf_logits, make_hf_model
from lightning_mcore.lora import mxfp4
from lightning_mcore.lora.config import LoRAConfig
from test_family_gpt_oss import quantize_experts
from test_lora import TOKENS
from test_lora_fp8_base import EXPERTS, computes_with_the_codes_and_saves_no_weight, train
from toy import tiny_config

def published_dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """transformers' decoding of GPT-OSS's MXFP4 blocks [E, out, G, 16] and scales [E, out, G]:
    [E, in, out] in fp32."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    return convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)


E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)


def mxfp4_by_hand(w: torch.Tensor) -> torch.Tensor:
    """W' per block of 32 along the last dimension, in fp64 then fp32."""
    blocks = w.double().reshape(*w.shape[:-1], -1, 32)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    exponents = torch.arange(-60, 61, dtype=torch.float64)
    fits = amax <= 6 * 2.0 ** exponents  # [..., G, 121]: the first True is the smallest exponent
    e = exponents[fits.double().argmax(dim=-1, keepdim=True)]  # [..., G, 1]
    scaled = blocks.abs() / 2.0 ** e
    distance = (scaled.unsqueeze(-1) - E2M1).abs()
    nearest = distance == distance.amin(dim=-1, keepdim=True)
    even = nearest & (torch.arange(8) % 2 == 0)  # a tie: the even code
    index = torch.where(even.any(-1), even.double().argmax(-1), nearest.double().argmax(-1))
    return (blocks.sign() * E2M1[index] * 2.0 ** e).reshape(w.shape).float()


# ---------------------------------------------------------------- the codec
def test_codec_is_ocp_mxfp4_by_hand():
    w = torch.randn(6, 128, generator=torch.Generator().manual_seed(0)) * 0.02
    w[1, 32:64] *= 300  # blocks of very different scales in one row: each has its own exponent
    w[2, :32] = -w[2, :32].abs()  # a block whose amax is a negative element
    # every tie between neighbouring E2M1 values, in a block whose largest element is 6 (e = 0)
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    w[3, :32] = 0
    w[3, :7], w[3, 7:14], w[3, 14] = ties, -ties, 6.0
    w[4, :32] = 0
    w[4, 0] = 7.0  # above 6 * 2^0: e = 1, no element clipped (7 / 2 = 3.5 -> 4 -> 8)
    w[5, 96:] = 0  # an all-zero block
    codes, scales = mxfp4.quantize_blocks(w)
    assert codes.dtype == scales.dtype == torch.uint8 and codes.shape == (6, 64) and scales.shape == (6, 4)
    got = mxfp4.dequantize_blocks(codes, scales, torch.float32)
    torch.testing.assert_close(got, mxfp4_by_hand(w), rtol=0, atol=0)
    assert got[3, :7].tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    assert got[4, 0] == 8.0 and torch.equal(got[5, 96:], torch.zeros(32))
    # decoded as GPT-OSS's published blocks are: [out, G, 16] bytes, the first element in the low nibble
    published = published_dequantize(codes.reshape(1, 6, 4, 16), scales[None])  # [1, in, out]
    torch.testing.assert_close(published[0].t(), got, rtol=0, atol=0)
    index = torch.randint(0, 16, (3, 8), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    assert torch.equal(mxfp4.pack(index), index[:, 0::2] + 16 * index[:, 1::2])
    assert torch.equal(mxfp4.unpack(mxfp4.pack(index)), index)


def test_published_mxfp4_weights_keep_their_values():
    """Blocks as GPT-OSS publishes them (any bytes, exponents around 2^-8), and blocks whose largest
    code is each E2M1 magnitude in turn (the ones quantized again at a smaller exponent), decode,
    quantize and decode back to the same values."""
    gen = torch.Generator().manual_seed(2)
    blocks = torch.randint(0, 256, (4, 24, 4, 16), generator=gen, dtype=torch.uint8)
    for k, top in enumerate(range(1, 8)):  # row k: every code at most `top` (magnitude E2M1[top])
        codes = torch.randint(0, top + 1, (4, 32), generator=gen, dtype=torch.uint8)
        codes[:, 0] = top
        codes += 8 * torch.randint(0, 2, codes.shape, generator=gen, dtype=torch.uint8)
        blocks[0, k] = mxfp4.pack(codes).reshape(4, 16)
    scales = torch.randint(110, 130, (4, 24, 4), generator=gen, dtype=torch.uint8)
    weight = published_dequantize(blocks, scales).transpose(-1, -2)  # [E, out, in]
    again = mxfp4.dequantize_blocks(*mxfp4.quantize_blocks(weight), torch.float32)
    torch.testing.assert_close(again, weight, rtol=0, atol=0)


@pytest.mark.parametrize("experts", [{}, EXPERTS], ids=["dense", "torch_experts"])
def test_mxfp4_base_computes_with_the_codes_and_saves_no_weight(experts):
    computes_with_the_codes_and_saves_no_weight(experts, "mxfp4", mxfp4_by_hand)


def test_a_linear_of_partial_blocks_is_refused_before_launch():
    from lightning_mcore.lora.checks import LoRAPlanError, check_lora_plan

    lora = LoRAConfig(target_modules="all-linear", base_precision="mxfp4")
    with pytest.raises(LoRAPlanError, match=r"'mxfp4' quantizes blocks of 32 inputs, but linear_fc2 has 48"):
        check_lora_plan(lora, tiny_config(ffn_hidden_size=48))
    with pytest.raises(LoRAPlanError, match=r"linear_fc2's 96 inputs .* leave 48 per rank"):
        check_lora_plan(lora, tiny_config(ffn_hidden_size=96), tp=2)
    check_lora_plan(lora, tiny_config(ffn_hidden_size=96))


# ---------------------------------------------------------------- GPT-OSS as published
def test_gpt_oss_published_experts_train_exactly_over_an_mxfp4_base(tmp_path):
    """LoRA on GPT-OSS's experts (its only MLPs), the checkpoint's MXFP4 experts held as MXFP4:
    every value is the checkpoint's (reported error 0), so 3 steps give the losses and adapters
    of the same LoRA over the loaded bf16 base, bit for bit, and the first logits are
    transformers' on the MXFP4 checkpoint."""
    from transformers import AutoModelForCausalLM

    source = tmp_path / "source"
    make_hf_model("gpt_oss", source)
    quantize_experts(source)
    assert any(n.endswith("_blocks") for n in load_file(source / "model.safetensors"))
    experts = dict(target_modules=["linear_fc1", "linear_fc2"], rank=8, alpha=16.0)
    runs = {precision: train(tmp_path, precision, source, LoRAConfig(**experts, base_precision=precision))
            for precision in ("mxfp4", "bf16")}
    (losses, adapters, out), (ref_losses, ref_adapters, _) = runs["mxfp4"], runs["bf16"]
    assert json.loads((out / "error.json").read_text()) == {"experts.linear_fc1": 0.0, "experts.linear_fc2": 0.0}
    assert losses == ref_losses and ref_losses[0] != ref_losses[-1]
    assert adapters.keys() == ref_adapters.keys() and adapters
    for key, value in ref_adapters.items():
        torch.testing.assert_close(adapters[key], value, rtol=0, atol=0, msg=key)
    hf = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    torch.testing.assert_close(torch.load(out / "first_logits.pt"), hf_logits(hf, TOKENS), rtol=0, atol=1e-4)
