"""The grouped-GEMM experts' LoRA hook (model/lora_grouped.py), on CPU against a hand computation:
a stand-in for TE's grouped linear (one weight per local expert, rows sorted by expert with
counts m_splits) gets each expert's x_e W_e^T + scale * B_e A_e x_e, empty experts included.
The hook on TE's real module is checked on GPU (tests/test_gpu_lora_experts.py)."""

import torch

from lightning_mcore.model.lora import LoRAAdapter, LoRAConfig
from lightning_mcore.model.lora_grouped import expert_weights, grouped_hook, is_grouped_linear


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
    adapters = [LoRAAdapter("column", 5, 4, lora, False, torch.float32, "cpu", expert=True) for _ in range(3)]
    for a in adapters:
        torch.nn.init.normal_(a.lora_A)
        torch.nn.init.normal_(a.lora_B)
    assert is_grouped_linear(linear) and len(expert_weights(linear)) == 3
    linear.register_forward_hook(grouped_hook(adapters), with_kwargs=True)
    splits = [2, 0, 3]
    x = torch.randn(sum(splits), 5)
    out, bias = linear(x, splits)
    expected, start = [], 0
    for e, n in enumerate(splits):
        xe = x[start:start + n]
        w = getattr(linear, f"weight{e}") + 3.0 * adapters[e].lora_B @ adapters[e].lora_A
        expected.append(xe @ w.T)
        start += n
    torch.testing.assert_close(out, torch.cat(expected))
    assert bias is None
    out.sum().backward()  # the update is differentiable through each expert's own A and B
    assert adapters[1].lora_A.grad.abs().sum() == 0 and adapters[0].lora_A.grad.abs().sum() > 0


def test_disabled_or_merged_adapters_add_nothing():
    torch.manual_seed(1)
    lora = LoRAConfig(rank=2)
    linear = GroupedLinear(2, 3, 3)
    adapters = [LoRAAdapter("row", 3, 3, lora, False, torch.float32, "cpu", expert=True) for _ in range(2)]
    for a in adapters:  # A is allocated uninitialised (apply_lora draws it): draw both here
        torch.nn.init.normal_(a.lora_A)
        torch.nn.init.normal_(a.lora_B)
    base = linear(torch.ones(4, 3), [1, 3])[0]
    linear.register_forward_hook(grouped_hook(adapters), with_kwargs=True)
    assert not torch.equal(linear(torch.ones(4, 3), [1, 3])[0], base)
    adapters[0].enabled = adapters[1].enabled = False
    assert torch.equal(linear(torch.ones(4, 3), torch.tensor([1, 3]))[0], base)
    adapters[0].enabled = adapters[1].enabled = True
    adapters[0].merged = adapters[1].merged = True
    assert torch.equal(linear(torch.ones(4, 3), [1, 3])[0], base)
