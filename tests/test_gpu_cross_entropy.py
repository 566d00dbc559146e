"""On GPU with Transformer Engine 2.18 or later: the model config uses TE's fused cross entropy,
mcore 0.19's warning about TE's kernel (true before 2.18) is silenced, and TE's loss and gradient
are torch's float32 cross entropy, the gradient within bf16 rounding."""

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]


def test_te_cross_entropy_where_it_keeps_fp32_gradients():
    from test_quickstart import warned
    from toy import tiny_config

    from lightning_mcore.model.config import te_cross_entropy_in_fp32, to_transformer_config
    from lightning_mcore.strategy.parallel import ParallelConfig

    if not te_cross_entropy_in_fp32():
        pytest.skip("Transformer Engine before 2.18: mcore's fusion is used")
    built = []
    said = warned(lambda: built.append(to_transformer_config(
        tiny_config(), ParallelConfig(), torch.bfloat16, on_cpu=False, use_te=True)), silenced=True)
    assert built[0].cross_entropy_loss_fusion and built[0].cross_entropy_fusion_impl == "te"
    assert not [w for w in said if "cross entropy" in w], said

    from transformer_engine.pytorch.cross_entropy import parallel_cross_entropy

    torch.manual_seed(0)
    vocab = 32000
    logits = (torch.randn(2, 64, vocab, device="cuda") * 3).to(torch.bfloat16).requires_grad_()
    target = torch.randint(0, vocab, (2, 64), device="cuda")
    reference = logits.detach().float().requires_grad_()
    expected = torch.nn.functional.cross_entropy(reference.reshape(-1, vocab), target.reshape(-1),
                                                 reduction="none").reshape(2, 64)
    loss = parallel_cross_entropy(logits, target, 0.0, False, None)
    upstream = torch.rand_like(expected) + 0.5
    loss.backward(upstream)
    expected.backward(upstream)
    torch.testing.assert_close(loss.float(), expected.detach(), rtol=1e-5, atol=1e-5)
    # within 2 bf16 steps (TE computes the softmax in another order: 117 of 4M elements on H100)
    torch.testing.assert_close(logits.grad.float(), reference.grad.to(torch.bfloat16).float(),
                               rtol=2 ** -7, atol=1e-9)
