"""On bf16, the router that a family's HF config translates to picks, for every token, the experts
that transformers' own gate of that family picks (GPTConfig.moe_router_dtype): DeepSeek-V3's gate
computes in float32, Qwen3-MoE's and Mixtral's matmul in bf16 and then take top-k over float32
softmax. With the other choice, some tokens take other experts."""

import dataclasses

import pytest
import torch
import transformers as tf

from hf_models import COMMON, FAMILIES, hf_config_dict
from lightning_mcore.export_checkpoint import single_process_megatron
from lightning_mcore.model.config import to_transformer_config
from lightning_mcore.models import gpt_config_from_hf
from lightning_mcore.strategy.parallel import ParallelConfig

# Enough experts and tokens that the two ways of routing part somewhere.
WIDE = {
    "qwen3_moe": dict(num_experts=64, num_experts_per_tok=8),
    "mixtral": dict(num_local_experts=8, num_experts_per_tok=2),
    "deepseek_v3": dict(n_routed_experts=64, num_experts_per_tok=8, n_group=8, topk_group=4),
}
GATES = {"qwen3_moe": "qwen3_moe.modeling_qwen3_moe.Qwen3MoeTopKRouter",
         "mixtral": "mixtral.modeling_mixtral.MixtralTopKRouter",
         "deepseek_v3": "deepseek_v3.modeling_deepseek_v3.DeepseekV3TopkRouter"}
HIDDEN, TOKENS = 256, 4096


def translated(family: str):
    """Our GPTConfig of the family's wide config.json, as the family module translates it."""
    cfg, _ = gpt_config_from_hf({**hf_config_dict(family), **WIDE[family], "hidden_size": HIDDEN})
    return cfg


def hf_gate(family: str):
    module, name = GATES[family].rsplit(".", 1)
    config_cls, _, extra = FAMILIES[family]()
    config = config_cls(**{**COMMON, **extra, **WIDE[family], "hidden_size": HIDDEN})
    gate = getattr(__import__(f"transformers.models.{module}", fromlist=[name]), name)(config)
    torch.manual_seed(0)
    with torch.no_grad():
        gate.weight.normal_(0.0, 0.02)
        if hasattr(gate, "e_score_correction_bias"):  # DeepSeek-V3's balancing bias, kept in fp32
            gate.e_score_correction_bias.normal_(0.0, 0.02)
    return gate.to(torch.bfloat16)


def mcore_experts(family: str, gate, hidden: torch.Tensor, router_dtype="family") -> torch.Tensor:
    """[tokens, experts] bool: the experts mcore's router chooses with the family's config."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe.router import TopKRouter

    cfg = translated(family)
    if router_dtype != "family":
        cfg = dataclasses.replace(cfg, moe_router_dtype=router_dtype)
    with single_process_megatron(), torch.no_grad():
        config = to_transformer_config(cfg, ParallelConfig(), torch.bfloat16, on_cpu=True, use_te=False)
        router = TopKRouter(config=config, pg_collection=ProcessGroupCollection.use_mpu_process_groups())
        router.weight.copy_(gate.weight)
        if hasattr(gate, "e_score_correction_bias"):
            router.expert_bias.copy_(gate.e_score_correction_bias.float())
        router = router.to(torch.bfloat16)
        _, routing_map = router(hidden.unsqueeze(1))
    return routing_map


def hf_experts(gate, hidden: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        *_, indices = gate(hidden)
    chosen = torch.zeros(hidden.shape[0], gate.weight.shape[0], dtype=torch.bool)
    return chosen.scatter_(1, indices, True)


@pytest.fixture(scope="module")
def hidden():
    return torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)


@pytest.mark.parametrize("family,expected", [("qwen3_moe", None), ("mixtral", None), ("deepseek_v3", "fp32")])
def test_router_picks_the_experts_transformers_picks(family, expected, hidden):
    assert hasattr(tf.models, family)
    assert translated(family).moe_router_dtype == expected
    gate = hf_gate(family)
    ours, theirs = mcore_experts(family, gate, hidden), hf_experts(gate, hidden)
    assert ours.sum(1).eq(gate.top_k).all()
    assert torch.equal(ours, theirs), f"{(ours != theirs).any(1).sum()} of {TOKENS} tokens differ"


@pytest.mark.parametrize("family,other", [("qwen3_moe", "fp32"), ("deepseek_v3", None)])
def test_the_other_router_dtype_parts_from_transformers(family, other, hidden):
    """The test above can fail: routed the other way, some tokens take other experts."""
    gate = hf_gate(family)
    ours, theirs = mcore_experts(family, gate, hidden, router_dtype=other), hf_experts(gate, hidden)
    assert (ours != theirs).any(1).sum() > 0



def test_mcore_advice_on_router_dtype_is_silenced(hidden):
    """mcore advises float32 routing for 32+ experts. Building Qwen3-MoE's config gives that advice,
    which quiet.py silences: the router routes as transformers' Qwen3-MoE does (above)."""
    from test_quickstart import warned

    cfg = translated("qwen3_moe")

    def build():
        to_transformer_config(cfg, ParallelConfig(), torch.bfloat16, on_cpu=True, use_te=False)

    advice = [w for w in warned(build, silenced=False) if "experts" in w]
    assert advice and advice[0].startswith("Using a large number of experts (e.g. >=32) without fp32 routing")
    assert warned(build, silenced=True) == []
