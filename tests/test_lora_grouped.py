"""The grouped-GEMM experts' LoRA hook (lora/grouped.py), on CPU against a hand computation:
a stand-in for TE's grouped linear (one weight per local expert, rows sorted by expert with
counts m_splits) gets each expert's x_e W_e^T + scale * B_e A_e x_e (A_e, B_e: slices of the stacked adapter),
empty experts included.
The hook on TE's real module is checked on GPU (tests/test_gpu_lora_experts.py)."""

import torch

from lightning_mcore.lora.adapters import LoRAAdapter
from lightning_mcore.lora.config import LoRAConfig
from lightning_mcore.lora.grouped import expert_weights, grouped_hook, is_grouped_linear


class GroupedLinear(torch.nn.Module):
    """TE's GroupedLinear as mcore calls it: forward(x, m_splits) -> (out, bias)."""

    def __init__(self, n: int, in_f: int, out_f: int):
        super().__init__()
        self.num_gemms = n
        for e in range(n):
            self.register_parameter(f"weight{e}", torch.nn.Parameter(torch.randn(out_f, in_f)))

    def forward(self, x, m_splits):
        rows = x.split(list(m_splits))
        return torch.cat([r @ getattr(self, f"weight{e}").T for e, r in enumerate(rows)]), None


def test_each_expert_adds_its_own_update_to_its_rows():
    torch.manual_seed(0)
    lora = LoRAConfig(rank=2, alpha=6.0)
    linear = GroupedLinear(3, 5, 4)
    adapter = LoRAAdapter("column", 5, 4, lora, False, torch.float32, "cpu", experts=3)
    assert adapter.lora_A.shape == (3, 2, 5) and adapter.lora_B.shape == (3, 4, 2)
    torch.nn.init.normal_(adapter.lora_A)
    torch.nn.init.normal_(adapter.lora_B)
    assert is_grouped_linear(linear) and len(expert_weights(linear)) == 3
    linear.register_forward_hook(grouped_hook(adapter), with_kwargs=True)
    splits = [2, 0, 3]
    x = torch.randn(sum(splits), 5)
    out, bias = linear(x, splits)
    expected, start = [], 0
    for e, n in enumerate(splits):
        xe = x[start:start + n]
        w = getattr(linear, f"weight{e}") + 3.0 * adapter.lora_B[e] @ adapter.lora_A[e]
        expected.append(xe @ w.T)
        start += n
    torch.testing.assert_close(out, torch.cat(expected))
    assert bias is None
    out.sum().backward()  # the update is differentiable through each expert's own A and B
    grad = adapter.lora_A.grad
    assert grad[1].abs().sum() == 0 and grad[0].abs().sum() > 0 and grad[2].abs().sum() > 0


def test_disabled_or_merged_adapters_add_nothing():
    torch.manual_seed(1)
    lora = LoRAConfig(rank=2)
    linear = GroupedLinear(2, 3, 3)
    adapter = LoRAAdapter("row", 3, 3, lora, False, torch.float32, "cpu", experts=2)
    torch.nn.init.normal_(adapter.lora_A)  # A is allocated uninitialised (apply_lora draws it)
    torch.nn.init.normal_(adapter.lora_B)
    base = linear(torch.ones(4, 3), [1, 3])[0]
    linear.register_forward_hook(grouped_hook(adapter), with_kwargs=True)
    assert not torch.equal(linear(torch.ones(4, 3), [1, 3])[0], base)
    adapter.enabled = False
    assert torch.equal(linear(torch.ones(4, 3), torch.tensor([1, 3]))[0], base)
    adapter.enabled = True
    adapter.merged = True
    assert torch.equal(linear(torch.ones(4, 3), [1, 3])[0], base)
