"""HF config.json -> GPTConfig, checked against the models transformers itself builds from it."""

import json

import pytest
import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
)

from lightning_mcore.hf.config import HFCheckpointError, HFCheckpointNotFoundError
from lightning_mcore.models import (
    ARCHITECTURES,
    gpt_config_from_hf,
    hf_config_dict_from_gpt,
    read_hf_config,
)
from lightning_mcore.model.rope import rope_inv_freq

TINY = dict(
    vocab_size=96, hidden_size=64, intermediate_size=80, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    rms_norm_eps=1e-5, initializer_range=0.01,
)
LLAMA3 = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
              original_max_position_embeddings=64)

# name: (config class, architecture, family, extra kwargs). rope_theta/rope_scaling kwargs are
# what transformers 4 takes; transformers 5 accepts them and writes rope_parameters.
CASES = {
    "llama3": (LlamaConfig, "LlamaForCausalLM", "llama", dict(
        rope_theta=500000.0, rope_scaling=LLAMA3)),
    "llama_tied": (LlamaConfig, "LlamaForCausalLM", "llama", dict(tie_word_embeddings=True)),
    "mistral": (MistralConfig, "MistralForCausalLM", "mistral", dict(
        sliding_window=None, head_dim=32)),
    "qwen2": (Qwen2Config, "Qwen2ForCausalLM", "qwen2", dict(
        rope_theta=1e6, rope_scaling={"rope_type": "linear", "factor": 2.0})),
    "qwen3": (Qwen3Config, "Qwen3ForCausalLM", "qwen3", dict(head_dim=32, rope_theta=1e6)),
    "qwen3_moe": (Qwen3MoeConfig, "Qwen3MoeForCausalLM", "qwen3_moe", dict(
        head_dim=24, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        norm_topk_prob=True)),
}


def fresh(kwargs: dict) -> dict:
    """Deep-enough copy: transformers 5 adds rope_theta to the rope_scaling dict it is given."""
    return {k: dict(v) if isinstance(v, dict) else v for k, v in kwargs.items()}


def hf_dict(name, **kw):
    cls, arch, _, extra = CASES[name]
    return cls(**fresh({**TINY, **extra, **kw}), architectures=[arch]).to_dict()


def write(tmp_path, hf: dict):
    (tmp_path / "config.json").write_text(json.dumps(hf))
    return tmp_path


@pytest.mark.parametrize("name", CASES)
def test_fields_match_the_model_transformers_builds(name, tmp_path):
    cls, arch, family, extra = CASES[name]
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cls(**TINY, **fresh(extra))).save_pretrained(tmp_path)
    ref = AutoModelForCausalLM.from_pretrained(tmp_path)  # the independent reference
    assert type(ref).__name__ == arch

    cfg, got_family = gpt_config_from_hf(tmp_path)

    assert got_family == family
    c, layer = ref.config, ref.model.layers[0]
    attn = layer.self_attn
    assert cfg.num_layers == len(ref.model.layers)
    assert cfg.hidden_size == ref.model.embed_tokens.embedding_dim
    assert cfg.vocab_size == ref.model.embed_tokens.num_embeddings
    assert cfg.num_attention_heads == c.num_attention_heads
    assert cfg.head_dim == attn.head_dim == attn.q_proj.out_features // c.num_attention_heads
    assert cfg.num_query_groups == attn.k_proj.out_features // attn.head_dim
    assert cfg.add_qkv_bias == (attn.q_proj.bias is not None)
    assert attn.o_proj.bias is None
    assert cfg.qk_layernorm == hasattr(attn, "q_norm")
    assert cfg.norm_epsilon == ref.model.norm.variance_epsilon
    assert cfg.init_method_std == c.initializer_range
    tied = ref.lm_head.weight.data_ptr() == ref.model.embed_tokens.weight.data_ptr()
    assert cfg.tie_word_embeddings == tied
    assert cfg.seq_length == min(c.max_position_embeddings, 4096)
    assert cfg.transformer_impl == "auto"
    # RoPE: base and scaling reproduce the frequencies HF rotates with.
    ours = rope_inv_freq(cfg.head_dim, cfg.rotary_base, cfg.rope_scaling)
    torch.testing.assert_close(ours, ref.model.rotary_emb.inv_freq, rtol=1e-6, atol=0)
    if cfg.num_moe_experts:
        gate = layer.mlp.gate
        assert cfg.num_moe_experts == gate.num_experts == layer.mlp.experts.num_experts
        assert cfg.moe_router_topk == gate.top_k
        assert cfg.moe_ffn_hidden_size == layer.mlp.experts.intermediate_dim
        assert cfg.moe_router_pre_softmax == (not gate.norm_topk_prob)
    else:
        assert cfg.ffn_hidden_size == layer.mlp.gate_proj.out_features


def test_rope_scaling_is_hf_style():
    cfg, _ = gpt_config_from_hf(hf_dict("llama3"))
    assert cfg.rotary_base == 500000.0 and cfg.rope_scaling == LLAMA3
    cfg, _ = gpt_config_from_hf(hf_dict("qwen3"))
    assert cfg.rope_scaling is None and cfg.rotary_base == 1e6


def v4_style(hf5: dict) -> dict:
    """The same config as transformers 4 wrote it: rope_theta + rope_scaling, num_experts."""
    hf = dict(hf5)
    rope = dict(hf.pop("rope_parameters"))
    hf["rope_theta"] = rope.pop("rope_theta")
    kind = rope.pop("rope_type")
    hf["rope_scaling"] = None if kind == "default" else {"type": kind, **rope}  # oldest key
    if "num_local_experts" in hf:
        hf["num_experts"] = hf.pop("num_local_experts")
    return hf


@pytest.mark.parametrize("name", CASES)
def test_transformers4_and_5_configs_agree(name):
    hf5 = hf_dict(name)
    assert "rope_parameters" in hf5  # installed transformers writes the 5.x style
    assert gpt_config_from_hf(v4_style(hf5)) == gpt_config_from_hf(hf5)


@pytest.mark.parametrize("name", CASES)
def test_round_trip(name, tmp_path):
    cls, arch, family, _ = CASES[name]
    cfg, _ = gpt_config_from_hf(hf_dict(name))
    write(tmp_path, hf_config_dict_from_gpt(cfg, family))

    loaded = AutoConfig.from_pretrained(tmp_path)
    assert type(loaded) is cls and loaded.architectures == [arch]
    for key, value in TINY.items():
        assert getattr(loaded, key) == value, key
    assert gpt_config_from_hf(tmp_path) == (cfg, family)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_moe_routing_matches_hf(norm_topk_prob):
    """mcore's router, configured as we map norm_topk_prob, gives HF's expert weights."""
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    hf = Qwen3MoeConfig(**TINY, num_experts=8, num_experts_per_tok=3, norm_topk_prob=norm_topk_prob)
    cfg, _ = gpt_config_from_hf(hf.to_dict())
    torch.manual_seed(0)
    router = Qwen3MoeTopKRouter(hf)
    torch.nn.init.normal_(router.weight)
    logits, weights, experts = router(torch.randn(64, TINY["hidden_size"]))

    probs, routing_map = topk_routing_with_score_function(
        logits, cfg.moe_router_topk, use_pre_softmax=cfg.moe_router_pre_softmax
    )
    expected = torch.zeros_like(logits).scatter(1, experts, weights)
    torch.testing.assert_close(probs, expected)
    assert torch.equal(routing_map, expected > 0)


# --- refusals ---------------------------------------------------------------------------------


def test_not_a_directory(tmp_path):
    with pytest.raises(HFCheckpointNotFoundError, match="not a directory"):
        read_hf_config(tmp_path / "missing")


def test_missing_config_json(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json.*Hugging Face checkpoint dir"):
        gpt_config_from_hf(tmp_path)


def test_unsupported_architecture_lists_supported(tmp_path):
    write(tmp_path, {**hf_dict("llama_tied"), "architectures": ["GPT2LMHeadModel"]})
    with pytest.raises(HFCheckpointError, match="GPT2LMHeadModel") as e:
        read_hf_config(tmp_path)
    assert all(name in str(e.value) for name in ARCHITECTURES)
    assert str(tmp_path / "config.json") in str(e.value)


def test_missing_field():
    hf = hf_dict("qwen3")
    del hf["head_dim"], hf["vocab_size"]
    with pytest.raises(HFCheckpointError, match="vocab_size, head_dim"):
        gpt_config_from_hf(hf)


@pytest.mark.parametrize("rope", [
    dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64),
    dict(rope_type="dynamic", factor=2.0),
])
def test_unsupported_rope_type(rope):
    with pytest.raises(HFCheckpointError, match=f"rope_type '{rope['rope_type']}'"):
        gpt_config_from_hf(hf_dict("llama_tied", rope_scaling=rope))


@pytest.mark.parametrize("field, value, match", [
    ("attention_bias", True, "attention_bias=True.*o_proj"),
    ("mlp_bias", True, "mlp_bias"),
    ("hidden_act", "gelu", "hidden_act='gelu'"),
])
def test_unsupported_llama_options(field, value, match):
    with pytest.raises(HFCheckpointError, match=match):
        gpt_config_from_hf(hf_dict("llama_tied", **{field: value}))


@pytest.mark.parametrize("kw", [dict(mlp_only_layers=[0]), dict(decoder_sparse_step=2)])
def test_mixed_dense_moe(kw):
    with pytest.raises(HFCheckpointError, match="mixed dense/MoE"):
        gpt_config_from_hf(hf_dict("qwen3_moe", **kw))
