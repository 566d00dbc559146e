"""benchmarks/hf_qlora.py (hf_fsdp2.py --qlora), transformers' QLoRA baseline of issue 49, on CPU:
its NF4 model is what from_pretrained(quantization_config=...) loads, bit for bit, and each code is
the NF4 value nearest its weight (a hand quantization); its loop trains the adapters only, as a
plain fp32 peft model holding the dequantized weights trains (losses, gradients, weights after two
AdamW steps). Skipped where bitsandbytes does not import (CI does not install it)."""

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from test_hf_fsdp2_baseline import GBS, LR, SEQ, STEPS, assert_matches

bnb = pytest.importorskip("bitsandbytes")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # the scripts import each other
import hf_baseline  # noqa: E402
import hf_fsdp2  # noqa: E402
import hf_qlora  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

SHAPE = hf_baseline.SELFTEST_SHAPES["llama"]
DECODER_LINEARS = 7 * SHAPE["num_layers"]  # q, k, v, o, gate, up, down
# the QLoRA paper's NF4 values (its appendix), in code order
NF4 = torch.tensor([-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
                    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
                    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
                    0.7229568362236023, 1.0])


def dequantized(model) -> dict:
    """Every parameter, NF4 weights dequantized by bitsandbytes, in fp32 on the CPU."""
    return {n: (bnb.functional.dequantize_4bit(p.data, p.quant_state) if isinstance(p, bnb.nn.Params4bit) else p)
            .detach().float().clone() for n, p in model.named_parameters()}


def test_nf4_model_is_what_from_pretrained_loads(tmp_path):
    model = hf_baseline.build_model(SHAPE, SEQ, "bf16", "cpu")
    model.save_pretrained(tmp_path)
    dense = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    ours = hf_qlora.quantize(model, hf_qlora.bnb_config("mixed"), torch.device("cpu"))
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=hf_qlora.bnb_config("mixed"),
                                                  dtype=torch.bfloat16, device_map="cpu")
    four_bit = [m for m in ours.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(four_bit) == DECODER_LINEARS and type(ours.lm_head) is torch.nn.Linear
    assert all(m.compute_dtype == torch.bfloat16 and m.weight.quant_state.nested for m in four_bit)  # double quant
    want = dict(loaded.named_parameters())
    assert dict(ours.named_parameters()).keys() == want.keys()
    for name, p in ours.named_parameters():
        assert type(p) is type(want[name]) and torch.equal(p.data, want[name].data), name
        if isinstance(p, bnb.nn.Params4bit):
            mine, theirs = p.quant_state.as_dict(packed=True), want[name].quant_state.as_dict(packed=True)
            assert mine.keys() == theirs.keys(), name
            for key, value in mine.items():
                assert torch.equal(value, theirs[key]) if torch.is_tensor(value) else value == theirs[key], (name, key)
            # by hand: blocks of 64 scaled by their absmax, each weight to its nearest NF4 value; bnb's
            # dequantized weight differs only by the absmax's 8-bit double quantization and bf16 rounding
            blocks = dense[name].reshape(-1, 64)
            absmax = blocks.abs().amax(1, keepdim=True)
            hand = NF4[(blocks / absmax).unsqueeze(-1).sub(NF4).abs().argmin(-1)] * absmax
            got = bnb.functional.dequantize_4bit(p.data, p.quant_state).float().reshape(-1, 64)
            assert ((got - hand).abs() <= 0.01 * absmax).all(), name
            assert ((got - blocks).abs() <= 0.16 * absmax).all(), name  # NF4's widest half-gap: 0.152


def test_qlora_trains_only_the_adapters_as_a_dequantized_model_does():
    from bench_lora_sft import PackedRows

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # conftest tears it down
    args = hf_fsdp2.parse_args(["--qlora", "--shape", "tiny-llama", "--lora-rank", "4", "--data", "sft", "--seq", str(SEQ),
                                "--gbs", str(GBS), "--mbs", "2", "--steps", str(STEPS), "--warmup", "1",
                                "--lr", str(LR), "--precision", "fp32"])
    cpu = torch.device("cpu")
    model = hf_fsdp2.build(SHAPE, SEQ, hf_fsdp2.settings_of(args), cpu, None)
    assert sum(isinstance(p, bnb.nn.Params4bit) for p in model.parameters()) == DECODER_LINEARS
    init, grads = dequantized(model), {}
    losses = hf_fsdp2.train(model, hf_baseline.make_optimizer(model, LR),
                            hf_fsdp2.make_loader(args, SHAPE["vocab_size"], 1, 0, False), STEPS, 2,
                            hf_baseline.WallTimer(), cpu, 1, grads)
    got = {"init": init, "losses": losses, "first_grads": grads, "end": dequantized(model)}
    end = assert_matches(got, SHAPE, lora_rank=4, data=PackedRows(GBS * (STEPS + 2), SEQ, SHAPE["vocab_size"], 1))
    adapters = {n for n in end if "lora_" in n}
    assert set(grads) == adapters and len(adapters) == 2 * DECODER_LINEARS
    for n, w in init.items():
        assert torch.equal(got["end"][n], w) != (n in adapters), n  # adapters moved, the base did not
