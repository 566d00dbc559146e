"""fp32 logits (model/fp32_logits.py): the output layer's product kept in fp32.

- fp32 weights: the layer computes what mcore's own head computes, values and gradients, and a
  run at TP=2 + sequence parallelism with it trains as a TP=1 run with mcore's head;
- bf16 weights: its logits are the float64 product of the bf16 operands to fp32 precision, where
  mcore's head rounds them to bf16 (a step of 1/16 near 10); its gradients are bf16 gradients;
- GRPO turns it on where asked (RolloutCorrection.fp32_logits).
"""

import pytest
import torch

from lightning_mcore import GRPOModule, OptimizerSettings, RolloutCorrection
from lightning_mcore.export_checkpoint import single_process_megatron
from lightning_mcore.model.build import build_chunks
from lightning_mcore.model.config import to_transformer_config
from lightning_mcore.model.fp32_logits import Fp32LogitsLinear
from lightning_mcore.strategy.parallel import ParallelConfig
from toy import ROOT, fit, tiny_config


def _chunk(fp32_logits: bool):
    cfg = tiny_config(num_layers=2, fp32_logits=fp32_logits)
    torch.manual_seed(0)
    tf_config = to_transformer_config(cfg, ParallelConfig(), torch.float32, on_cpu=True, use_te=False)
    (chunk,) = build_chunks(cfg, tf_config, use_te=False)
    return chunk


def test_fp32_weights_give_mcores_logits_and_gradients():
    tokens = torch.randint(0, 500, (2, 16), generator=torch.Generator().manual_seed(1))
    position_ids = torch.arange(16).expand(2, 16)
    got = {}
    with single_process_megatron():
        for on in (False, True):
            chunk = _chunk(on)
            assert isinstance(chunk.output_layer, Fp32LogitsLinear) == on
            losses = chunk(tokens, position_ids, None, labels=tokens.roll(-1, 1))
            losses.sum().backward()
            got[on] = (losses.detach(), {n: p.grad.clone() for n, p in chunk.named_parameters()})
    (plain_loss, plain_grads), (ours_loss, ours_grads) = got[False], got[True]
    torch.testing.assert_close(ours_loss, plain_loss, rtol=1e-6, atol=1e-6)
    assert plain_grads.keys() == ours_grads.keys()
    for name, grad in plain_grads.items():
        torch.testing.assert_close(ours_grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)
    assert plain_grads["output_layer.weight"].abs().max() > 1e-4


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")])])
def test_bf16_logits_are_not_rounded_to_bf16(device):
    """On CUDA the product is torch.mm's bf16 GEMM with an fp32 output; on CPU an fp32 product."""
    with single_process_megatron():
        chunk = _chunk(True)
        head = chunk.output_layer.to(device, torch.bfloat16)
        gen = torch.Generator().manual_seed(2)
        with torch.no_grad():
            head.weight.copy_(torch.randn(head.weight.shape, generator=gen) * 0.3)
        hidden = torch.randn(5, 3, 64, generator=gen).to(device, torch.bfloat16).requires_grad_()
        logits, _ = head(hidden)
        logits = logits[..., :500]  # the vocab's rows; those padding it to 512 are masked
        exact = hidden.detach().double() @ head.weight.detach()[:500].double().t()
        assert logits.dtype == torch.float32 and exact.abs().max() > 8
        assert (logits.double() - exact).abs().max() < 1e-5 * exact.abs().max()
        rounded = exact.to(torch.bfloat16).double()  # what a bf16 head returns at best
        assert (rounded - exact).abs().max() > 1e-2
        # the backward pass: bf16 gradients of the same product
        grad = torch.randn(logits.shape, generator=gen).to(device)
        logits.backward(grad)
        want = grad.to(torch.bfloat16).double() @ head.weight.detach()[:500].double()
        assert hidden.grad.dtype == torch.bfloat16 and head.weight.grad.dtype == torch.bfloat16
        torch.testing.assert_close(hidden.grad.double(), want, rtol=2e-2, atol=2e-2)


@pytest.mark.distributed
def test_tp2_sequence_parallel_with_fp32_logits_trains_as_tp1(tmp_path):
    # plain SGD, no clipping: the update is the gradient itself (Adam would hide a scaled one)
    sgd = OptimizerSettings(lr=0.5, optimizer="sgd", clip_grad=0.0, weight_decay=0.0)
    plain = fit(tmp_path, devices=1, name="tp1", config=tiny_config(), optim=sgd)
    ours = fit(tmp_path, devices=2, name="tp2", config=tiny_config(fp32_logits=True), optim=sgd,
               tensor_model_parallel_size=2, sequence_parallel=True)
    assert len(plain) == len(ours) == 3
    for a, b in zip(plain, ours):
        assert b == pytest.approx(a, rel=1e-5, abs=1e-6)
    assert abs(plain[0] - plain[-1]) > 1e-3  # the updates moved the loss


def test_grpo_keeps_logits_in_fp32_when_told():
    tokenizer = str(ROOT / "configs/sample_data/tiny-llama")
    assert not GRPOModule(tokenizer).model_config.fp32_logits
    assert GRPOModule(tokenizer, correction=RolloutCorrection(fp32_logits=True)).model_config.fp32_logits
