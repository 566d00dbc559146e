"""LoRA over an FP8 base multiplied by FP8 GEMMs (LoRAConfig.base_gemm="fp8", lora/fp8_gemm.py).

The reference is computed by hand in fp64 from the loaded weights: W' = e4m3(W / s) * s per output
row (the base's codes), and each call's input rounded to e4m3 per row, x' = e4m3(x / sx) * sx with
sx = amax(|x row|) / 448 (in fp32):
  - mcore's column- and row-parallel linears and torch's grouped experts give y = x' W'^T, and
    input gradients dy W' (exact for the dequantized weight, the input's rounding passed through);
  - in a whole model (dense layers and grouped experts) the weights are never materialised, autograd
    saves none of them, and the loss moves from the dequantize-into-bf16 run's by the inputs'
    rounding only (within e4m3's 2^-4, and not zero);
  - TP=2 with sequence parallelism (row-parallel inputs split over TP and expert-TP) trains as TP=1.
The settings are refused where they cannot run.
"""

import pytest
import torch

from lightning_mcore.export_checkpoint import single_process_megatron
from lightning_mcore.lora.adapters import apply_lora
from lightning_mcore.lora.config import LoRAConfig, LoRAError
from lightning_mcore.lora.fp8_gemm import Fp8GemmLinear, Fp8GroupedLinear
from hf_models import make_hf_model
from test_lora_fp8_base import EXPERTS, LORA, _adapted_weights, _chunk, _saved_during, by_hand, train
from toy import tiny_config

FP8_GEMM = LoRAConfig(target_modules="all-linear", rank=8, alpha=16.0, base_precision="fp8", base_gemm="fp8")


def rounded_rows(x: torch.Tensor) -> torch.Tensor:
    """x' = e4m3(x / sx) * sx per row, sx = amax / 448, both in fp32 as the module docstring says (in
    fp64 a quotient near a rounding boundary can round the other way: 6 of 230,400 on an H200), x' in fp64."""
    x = x.float()
    scale = x.abs().amax(dim=-1, keepdim=True) / 448.0
    return (x / scale).clamp(-448, 448).to(torch.float8_e4m3fn).double() * scale.double()


def _quantized_chunk(cfg, lora=FP8_GEMM):
    """An fp32 chunk with `lora` applied, and its adapted weights as loaded (name -> W)."""
    chunk = _chunk(cfg, torch.float32)
    loaded = {name: p.detach().clone() for name, p in chunk.named_parameters()}
    apply_lora([chunk], lora, seed=0)
    return chunk, loaded


@pytest.mark.parametrize("name", ["self_attention.linear_qkv", "self_attention.linear_proj"])
def test_linear_is_the_rounded_input_times_the_codes(name):
    with single_process_megatron():
        chunk, loaded = _quantized_chunk(tiny_config(num_layers=1))
        module = chunk.decoder.layers[0].get_submodule(name)
        assert isinstance(module, Fp8GemmLinear)
        w = by_hand(loaded[f"decoder.layers.0.{name}.weight"]).double()
        x = torch.randn(5, 2, w.shape[1], generator=torch.Generator().manual_seed(3), requires_grad=True)
        y, _ = module(x)  # the adapter adds B A x with B = 0: the base alone
        dy = torch.randn_like(y)
        y.backward(dy)
    torch.testing.assert_close(y.double(), rounded_rows(x.detach()) @ w.t(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad.double(), dy.double() @ w, rtol=1e-5, atol=1e-5)
    assert (rounded_rows(x.detach()) - x.detach().double()).abs().max() > 1e-4  # the rounding is there


def test_grouped_experts_are_each_experts_rounded_rows_times_its_codes():
    with single_process_megatron():
        chunk, loaded = _quantized_chunk(tiny_config(num_layers=1, **EXPERTS))
        experts = chunk.decoder.layers[0].mlp.experts
        gemm = experts.base_gemms["linear_fc1"]
        assert gemm.function is Fp8GroupedLinear and gemm.active
        prefix = "decoder.layers.0.mlp.experts.local_experts"
        w = [by_hand(loaded[f"{prefix}.{e}.linear_fc1.weight"]).double() for e in range(4)]
        counts = [3, 0, 5, 2]  # an expert without tokens too
        offsets = torch.tensor(counts).cumsum(0).to(torch.int32)
        x = torch.randn(sum(counts), w[0].shape[1], generator=torch.Generator().manual_seed(4), requires_grad=True)
        y = gemm(x, offsets)
        dy = torch.randn_like(y)
        y.backward(dy)
    rows = torch.arange(sum(counts)).split(counts)
    want = torch.cat([rounded_rows(x.detach()[r]) @ w[e].t() for e, r in enumerate(rows)])
    want_dx = torch.cat([dy.double()[r] @ w[e] for e, r in enumerate(rows)])
    torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad.double(), want_dx, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("experts", [{}, EXPERTS], ids=["dense", "torch_experts"])
def test_model_computes_from_the_codes_and_differs_by_the_inputs_rounding_only(experts):
    cfg = tiny_config(num_layers=2, **experts)
    tokens = torch.randint(0, 500, (1, 5), generator=torch.Generator().manual_seed(1))
    got = {}
    with single_process_megatron():
        for gemm in ("fp8", "bf16"):
            chunk, _ = _quantized_chunk(cfg, LoRAConfig(target_modules="all-linear", rank=8, alpha=16.0,
                                                        base_precision="fp8", base_gemm=gemm))
            weights = _adapted_weights(chunk)
            with torch.no_grad():
                for adapter in chunk.lora.values():  # B != 0: A's gradient too
                    adapter.lora_B.normal_(0, 0.05, generator=torch.Generator().manual_seed(2))
            materialised = []
            for module in chunk.modules():
                if hasattr(module, "weight_fp8") or getattr(module, "base_gemms", None):
                    module.register_forward_pre_hook(lambda *_: materialised.append(  # after the base's own
                        any(w.stride() != (0,) * w.dim() for w in weights)))
            loss, saved = _saved_during(chunk, tokens)
            loss.backward()
            grads = {n: p.grad.clone() for n, p in chunk.named_parameters() if p.requires_grad}
            shapes = {tuple(w.shape) for w in weights}
            got[gemm] = (float(loss), grads, [s for s in saved if s[0] in shapes], materialised)
    (loss8, grads8, saved8, seen8), (loss, grads, _, seen) = got["fp8"], got["bf16"]
    assert seen8 and not any(seen8), "an FP8 GEMM's weight was materialised"
    assert any(seen)  # the dequantizing run gives them values per call (what the check above would see)
    assert not saved8, "a weight was saved"
    assert 0 < abs(loss8 - loss) / abs(loss) < 2.0 ** -4
    for name, g in grads.items():
        cos = torch.nn.functional.cosine_similarity(grads8[name].flatten(), g.flatten(), dim=0)
        assert cos > 0.99, (name, float(cos))


@pytest.mark.distributed
def test_fp8_gemm_trains_at_tp2_with_sp_as_at_tp1(tmp_path):
    """Row-parallel inputs (linear_proj at TP=2, the experts' fc2 at expert-TP 2) are split across
    ranks: their rows' scales come from the whole row, so TP=2 gives TP=1's losses and adapters."""
    source = tmp_path / "source"
    make_hf_model("qwen2_moe", source)
    tp1 = train(tmp_path, "tp1", source, FP8_GEMM)
    tp2 = train(tmp_path, "tp2", source, FP8_GEMM, 2, tensor_model_parallel_size=2, sequence_parallel=True)
    plain = train(tmp_path, "plain", source, LORA)
    assert tp2[0] == pytest.approx(tp1[0], rel=1e-5)
    assert tp1[0] != pytest.approx(plain[0], rel=1e-4)  # the FP8 path ran
    assert tp2[1].keys() == tp1[1].keys()
    for key, value in tp1[1].items():
        torch.testing.assert_close(tp2[1][key], value, rtol=0, atol=1e-5, msg=key)


def test_fp8_gemm_is_refused_where_it_cannot_run():
    with pytest.raises(LoRAError, match="base_gemm='fp8' multiplies FP8 codes, but base_precision is 'nf4'"):
        LoRAConfig(base_precision="nf4", base_gemm="fp8")
    with pytest.raises(LoRAError, match="base_gemm 'int8' is not supported"):
        LoRAConfig(base_precision="fp8", base_gemm="int8")
