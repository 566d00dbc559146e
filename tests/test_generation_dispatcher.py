"""Generation's MoE dispatcher (model/generation_dispatcher.py) computes what mcore's all-to-all
dispatcher computes, on one process: the same MoE layer, fp32, eval, with and without mcore's
inference flag; and against a hand computation of sum_k p_k FFN_k(x) per token. End to end,
generation goes through it at EP=1 (greedy equals transformers, tests/test_generation.py; the
rollouts' log-probs equal the training forward's, tests/test_grpo_rollout_mismatch.py); at
EP > 1 and expert-TP > 1 generation keeps mcore's dispatcher."""

import pytest
import torch
import torch.nn.functional as F

from lightning_mcore.export_checkpoint import single_process_megatron
from lightning_mcore.model import inference_context
from lightning_mcore.model.build import build_chunks
from lightning_mcore.model.config import to_transformer_config
from lightning_mcore.model.generation_dispatcher import GenerationDispatcher
from lightning_mcore.strategy.parallel import ParallelConfig
from toy import tiny_config


@pytest.mark.parametrize("topk,experts,extra", [(2, 4, {}), (4, 4, {}), (1, 3, dict(moe_router_pre_softmax=True))],
                         ids=["top2of4", "top4of4", "top1of3"])
def test_generation_dispatcher_equals_the_all_to_all_and_a_hand_computation(topk, experts, extra):
    cfg = tiny_config(num_layers=1, num_moe_experts=experts, moe_ffn_hidden_size=32, moe_router_topk=topk, **extra)
    with single_process_megatron(), torch.no_grad():
        torch.manual_seed(0)
        tf_config = to_transformer_config(cfg, ParallelConfig(), torch.float32, on_cpu=True, use_te=False)
        (chunk,) = build_chunks(cfg, tf_config, use_te=False)
        layer = chunk.decoder.layers[0].mlp.eval()
        assert isinstance(layer.generation_dispatcher, GenerationDispatcher)
        x = torch.randn(7, 3, cfg.hidden_size)  # [s, b, h]
        trained, _ = layer(x)
        assert layer.token_dispatcher is layer.training_dispatcher
        with inference_context.inference_mode():
            generated, _ = layer(x)
            assert layer.token_dispatcher is layer.generation_dispatcher
        probs, chosen = layer.router(x)
        by_hand = torch.zeros(21, cfg.hidden_size)
        flat = x.reshape(21, -1)
        for e, expert in enumerate(layer.experts.local_experts):
            gate, up = F.linear(flat, expert.linear_fc1.weight).chunk(2, dim=-1)
            out = F.linear(F.silu(gate) * up, expert.linear_fc2.weight)
            by_hand += torch.where(chosen[:, e:e + 1], probs[:, e:e + 1] * out, 0.0)
    torch.testing.assert_close(generated, trained, rtol=0, atol=1e-6)
    torch.testing.assert_close(generated.reshape(21, -1), by_hand, rtol=0, atol=1e-6)
    assert generated.abs().max() > 1e-3  # the experts contributed


def test_only_at_one_expert_rank_and_expert_tp_1():
    from types import SimpleNamespace

    from lightning_mcore.model.generation_dispatcher import serves_generation

    config = SimpleNamespace(moe_expert_capacity_factor=None, moe_pad_expert_input_to_capacity=False,
                             moe_shared_expert_overlap=False)
    assert serves_generation(SimpleNamespace(ep_size=1, tp_size=1), config)
    assert not serves_generation(SimpleNamespace(ep_size=2, tp_size=1), config)
    assert not serves_generation(SimpleNamespace(ep_size=1, tp_size=2), config)
    assert not serves_generation(SimpleNamespace(ep_size=1, tp_size=1),
                                 SimpleNamespace(**{**vars(config), "moe_expert_capacity_factor": 1.0}))
