"""LoRA under full activation recompute. mcore recomputes each layer inside an autograd
function whose output needs a gradient only if one of its inputs does (the adapters inside do
not count); with every base weight frozen, the decoder's input needs none. The reference: the
same model, adapters and tokens without recompute; the adapters' gradients must be equal.
(Recompute needs CUDA's RNG state in mcore; here it is run on CPU with that state left out:
these layers draw no random numbers.)"""

import contextlib
from unittest import mock

import pytest
import torch

from lightning_mcore.export_checkpoint import single_process_megatron
from lightning_mcore.lora.adapters import apply_lora
from lightning_mcore.lora.config import LoRAConfig
from test_lora_fp8_base import _chunk
from toy import tiny_config

LORA = LoRAConfig(target_modules="all-linear", rank=4, alpha=8.0)


@contextlib.contextmanager
def recompute_on_cpu():
    """mcore's checkpoint saves and restores the CUDA RNG state; on CPU there is none to keep."""
    import megatron.core.tensor_parallel.random as rng  # only this test reaches into mcore's RNG

    with mock.patch.object(rng, "_get_cuda_rng_state", lambda *a, **k: None), \
            mock.patch.object(rng, "_set_cuda_rng_state", lambda *a, **k: None):
        yield


def adapter_gradients(recompute: dict) -> dict:
    chunk = _chunk(tiny_config(num_layers=2, **recompute), torch.float32)
    apply_lora([chunk], LORA, seed=0)
    with torch.no_grad():
        for adapter in chunk.lora.values():  # B != 0: A's gradient too
            adapter.lora_B.normal_(0, 0.05, generator=torch.Generator().manual_seed(2))
    tokens = torch.randint(0, 500, (2, 8), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(8).expand_as(tokens)
    with torch.no_grad():  # as generation runs: nothing is marked, no graph is built
        assert not chunk(tokens, positions, None).requires_grad
    chunk(tokens, positions, None, labels=tokens.roll(-1, 1)).sum().backward()
    return {n: (p.grad if p.grad is not None else torch.zeros_like(p)).clone()
            for n, p in chunk.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("method", ["uniform", "block"])
def test_recomputed_layers_give_the_adapters_their_gradients(method):
    with single_process_megatron(), recompute_on_cpu():
        plain = adapter_gradients({})
        recomputed = adapter_gradients(dict(recompute_granularity="full", recompute_method=method,
                                            recompute_num_layers=1))
    assert plain.keys() == recomputed.keys() and all(n.startswith("lora.") for n in plain)
    for name, grad in plain.items():
        assert grad.abs().max() > 0, name
        torch.testing.assert_close(recomputed[name], grad, rtol=1e-5, atol=1e-7, msg=name)
