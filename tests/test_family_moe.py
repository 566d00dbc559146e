"""Acceptance for Mixtral and Qwen2-MoE beyond logits and export (tests/test_hf_roundtrip.py):
training steps at TP=2 (+SP) and EP=2 x TP=2 (expert-TP 1) follow the one-process run of the
same checkpoint; LoRA adapters export as a PEFT adapter that peft loads with our logits; the
configs agree with the layers transformers builds from them, and those we cannot express are
refused by name before any process starts.

The Qwen2-MoE model mixes dense and MoE layers (mlp_only_layers) and has the shared expert
with its sigmoid gate, whose replicated weight sees a sequence shard under SP (its gradient is
summed over TP ranks, as for norms)."""

import json

import pytest
import torch
import transformers as tf
from transformers import AutoConfig

from hf_models import COMMON, FAMILIES, hf_logits, make_hf_model
from lightning_mcore import GPTConfig, OptimizerSettings, PretrainModule
from lightning_mcore.hf.config import HFCheckpointError
from lightning_mcore.lora.config import LoRAConfig
from lightning_mcore.model.flops import training_flops_per_token
from lightning_mcore.models import family_of, gpt_config_from_hf, hf_config_dict_from_gpt
from test_lora import TOKENS, fit_lora_at_tp2_sp, peft_and_merged_match, tensors
from test_throughput import counted_training_flops
from toy import TokenRows, assemble, fit

CONFIGS = ["mixtral", "qwen2_moe", "qwen2_moe_step"]

LAYOUTS = {
    "tp2_sp": (2, dict(tensor_model_parallel_size=2, sequence_parallel=True)),
    "ep2_tp2": (4, dict(expert_model_parallel_size=2, tensor_model_parallel_size=2,
                        sequence_parallel=True, expert_tensor_parallel_size=1)),
}
TRAIN_CASES = [("mixtral", "tp2_sp"), ("qwen2_moe", "tp2_sp"), ("qwen2_moe", "ep2_tp2")]


def train(source, tmp, name: str, devices: int = 1, **parallel):
    """Two steps from the HF checkpoint (one row per microbatch: every layout sees the same
    microbatches); (losses, weights before, weights after)."""
    losses = fit(tmp, devices=devices, steps=2, gbs=4, mbs=1, config=str(source),
                 optim=OptimizerSettings(lr=1e-3, warmup_steps=0), dump_weights=True, name=name,
                 dataset=TokenRows(n=8, seq=16, vocab=200), **parallel)
    return (losses, assemble(sorted(tmp.glob(f"{name}.init*.pt"))),
            assemble(sorted(tmp.glob(f"{name}.end*.pt"))))


@pytest.fixture(scope="module")
def single_process(tmp_path_factory):
    """Per family: its tiny checkpoint and the one-process run, computed once, when first needed."""
    cache = {}

    def get(family: str):
        if family not in cache:
            tmp = tmp_path_factory.mktemp(f"ref_{family}")
            make_hf_model(family, tmp / "source")
            cache[family] = tmp / "source", train(tmp / "source", tmp, "ref")
        return cache[family]

    return get


@pytest.mark.distributed
@pytest.mark.parametrize("family,layout", TRAIN_CASES, ids=[f"{f}-{l}" for f, l in TRAIN_CASES])
def test_training_steps_match_single_process(family, layout, single_process, tmp_path):
    source, (ref_losses, ref_init, ref_trained) = single_process(family)
    devices, parallel = LAYOUTS[layout]
    losses, init, trained = train(source, tmp_path, "run", devices, **parallel)

    assert any("shared_experts.gate_weight" in k for k in ref_init) == (family == "qwen2_moe")
    assert init.keys() == ref_init.keys()
    for key, full in ref_init.items():  # loaded from the same checkpoint; NaN: a shard no rank wrote
        assert torch.equal(init[key], full), f"initial {key} differs under {layout}"
    assert len(losses) == len(ref_losses) == 2
    for step, (got, want) in enumerate(zip(losses, ref_losses)):
        assert abs(got - want) <= 1e-5 * abs(want), f"step {step}: {got} vs {want} ({layout})"
    for key, full in ref_trained.items():
        assert not torch.equal(full, ref_init[key]), f"{key} was not trained"
        torch.testing.assert_close(trained[key], full, rtol=0, atol=1e-5, msg=f"{key} ({layout})")


ATTENTION = ["k_proj", "o_proj", "q_proj", "v_proj"]
# Mixtral's MLPs are all routed experts (not adapted): attention only. Qwen2-MoE's dense layer
# and shared experts take the MLP targets; its routed experts stay frozen (experts=False; expert
# adapters: tests/test_lora_experts.py).
LORA_CASES = {"mixtral": (["linear_qkv", "linear_proj"], ATTENTION),
              "qwen2_moe": ("all-linear", sorted(ATTENTION + ["down_proj", "gate_proj", "up_proj"]))}


def trainable(hf, r: int) -> int:
    """A and B of every adapted linear: r x (in + out); fused q/k/v and gate/up share one A."""
    c = hf.config
    h, head = c.hidden_size, c.hidden_size // c.num_attention_heads
    q, kv = c.num_attention_heads * head, c.num_key_value_heads * head
    total = 0
    for layer in hf.model.layers:
        total += r * ((h + q + 2 * kv) + (q + h))
        if c.model_type == "qwen2_moe":  # the dense MLP or shared expert (Mixtral: none)
            f = getattr(layer.mlp, "shared_expert", layer.mlp).gate_proj.out_features
            total += r * ((h + 2 * f) + (f + h))
    return total


@pytest.mark.distributed
@pytest.mark.parametrize("family", list(LORA_CASES))
def test_lora_exports_a_peft_adapter_that_peft_loads(family, tmp_path):
    source = tmp_path / "source"
    hf = make_hf_model(family, source)
    targets, hf_targets = LORA_CASES[family]
    lora = LoRAConfig(target_modules=targets, rank=4, alpha=8.0, experts=False)
    fit_lora_at_tp2_sp(source, lora, tmp_path)

    facts = json.loads((tmp_path / "facts.json").read_text())
    assert facts["base_unchanged"] and facts["trainable"] == trainable(hf, 4)
    mcore = torch.load(tmp_path / "logits.pt")
    assert (mcore - hf_logits(hf, TOKENS)).abs().max() > 1e-3, "the adapters changed nothing"
    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert sorted(config["target_modules"]) == hf_targets
    adapted = {k.split(".lora_")[0].removeprefix("base_model.model.") for k in tensors(tmp_path / "peft")}
    expected = {f"model.layers.{i}.self_attn.{p}" for i in range(4) for p in ATTENTION}
    if family == "qwen2_moe":  # layer 2 is dense
        expected |= {f"model.layers.{i}.mlp.{'' if i == 2 else 'shared_expert.'}{p}"
                     for i in range(4) for p in ("gate_proj", "up_proj", "down_proj")}
    assert adapted == expected

    peft_and_merged_match(source, tmp_path, mcore)


# --- config.json <-> GPTConfig ----------------------------------------------------------------


def hf_dict(name: str, **kw) -> dict:
    config_cls, model_cls, extra = FAMILIES[name]()
    return config_cls(**{**COMMON, **extra, **kw}, architectures=[model_cls.__name__]).to_dict()


@pytest.mark.parametrize("name", CONFIGS)
def test_fields_match_the_model_transformers_builds(name, tmp_path):
    ref = make_hf_model(name, tmp_path)  # the independent reference: transformers' own layers
    cfg, family = gpt_config_from_hf(tmp_path)
    assert family == ref.config.model_type
    layers = ref.model.layers
    assert cfg.add_qkv_bias == (layers[0].self_attn.q_proj.bias is not None)
    assert [cfg.is_moe_layer(i) for i in range(len(layers))] == [hasattr(x.mlp, "experts") for x in layers]
    assert any(not hasattr(x.mlp, "experts") for x in layers) == (name != "mixtral")
    for layer in layers:
        mlp = layer.mlp
        if not hasattr(mlp, "experts"):
            assert cfg.ffn_hidden_size == mlp.gate_proj.out_features
            continue
        assert cfg.num_moe_experts == mlp.gate.num_experts == mlp.experts.num_experts
        assert cfg.moe_router_topk == mlp.gate.top_k
        assert cfg.moe_ffn_hidden_size == mlp.experts.intermediate_dim
        # Mixtral always renormalises the top-k probabilities (no norm_topk_prob field).
        assert cfg.moe_router_pre_softmax == (not getattr(mlp.gate, "norm_topk_prob", True))
        shared = getattr(mlp, "shared_expert", None)
        assert cfg.moe_shared_expert_intermediate_size == (shared.gate_proj.out_features if shared else None)
        assert cfg.moe_shared_expert_gate == hasattr(mlp, "shared_expert_gate")


def v4_style(hf5: dict) -> dict:
    """The config as transformers 4 wrote it: rope_theta, no layer_types, and no qkv_bias
    (always biased)."""
    assert hf5.get("qkv_bias", True)
    hf = {k: v for k, v in hf5.items() if k not in ("qkv_bias", "layer_types")}
    hf["rope_theta"] = hf.pop("rope_parameters")["rope_theta"]
    return hf


@pytest.mark.parametrize("name", CONFIGS)
def test_transformers4_configs_and_export_round_trip(name, tmp_path):
    hf = hf_dict(name)
    cfg, family = gpt_config_from_hf(hf)
    if hf.get("qkv_bias", True):  # transformers 4 cannot say qkv_bias=False
        assert gpt_config_from_hf(v4_style(hf)) == (cfg, family)
    (tmp_path / "config.json").write_text(json.dumps(hf_config_dict_from_gpt(cfg, family)))
    loaded = AutoConfig.from_pretrained(tmp_path)
    assert type(loaded).__name__ == type(AutoConfig.for_model(family)).__name__
    assert gpt_config_from_hf(tmp_path) == (cfg, family)


def test_models_built_from_scratch_export_as_the_family_that_expresses_them():
    moe = dict(num_moe_experts=4, moe_ffn_hidden_size=256)  # ffn_hidden_size is 256
    assert family_of(GPTConfig(**moe)) == "mixtral"
    assert family_of(GPTConfig(**moe, moe_router_pre_softmax=True)) is None  # Mixtral renormalises
    gated = dict(moe_shared_expert_intermediate_size=64, moe_shared_expert_gate=True)
    assert family_of(GPTConfig(**moe, **gated, add_qkv_bias=True, moe_layer_freq=[1, 0])) == "qwen2_moe"
    assert family_of(GPTConfig(**moe, **gated, qk_layernorm=True)) is None
    assert family_of(GPTConfig(**moe, moe_shared_expert_intermediate_size=64)) is None  # ungated


@pytest.mark.parametrize("name, fields, match", [
    ("mixtral", dict(router_jitter_noise=0.1), "router_jitter_noise=0.1"),
    ("mixtral", dict(hidden_act="gelu"), "hidden_act='gelu'"),
    ("mixtral", dict(num_local_experts=None), "missing required field.*num_local_experts"),
    ("qwen2_moe", dict(use_sliding_window=True), "use_sliding_window=True"),
    ("qwen2_moe", dict(num_experts=0), "num_experts=0"),
    ("qwen2_moe", dict(shared_expert_intermediate_size=0), "shared_expert_intermediate_size=0"),
    ("qwen2_moe", dict(mlp_only_layers=[0, 1, 2, 3]), "mlp_only_layers=.*no layer is MoE"),
    ("qwen2_moe", dict(decoder_sparse_step=0), "decoder_sparse_step=0"),
    ("qwen2_moe", dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}),
     "rope_type 'yarn'"),
])
def test_unsupported_variants_are_refused_by_name(name, fields, match, tmp_path):
    hf = {**hf_dict(name), **fields}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(HFCheckpointError, match=match) as info:
        PretrainModule(str(tmp_path))  # where a run reads it: before any process starts
    assert str(tmp_path / "config.json") in str(info.value)


def test_flops_of_a_mixed_stack_with_a_gated_shared_expert_equal_torch_flop_counter(tmp_path):
    hf = tf.Qwen2MoeConfig(**{**FAMILIES["qwen2_moe"]()[2], **COMMON})
    hf._attn_implementation, hf._experts_implementation = "eager", "eager"
    cfg, _ = gpt_config_from_hf(hf.to_dict())
    assert not cfg.is_moe_layer(2) and cfg.moe_shared_expert_gate
    torch.manual_seed(0)
    expected = counted_training_flops(tf.Qwen2MoeForCausalLM(hf).float(), 24)
    assert training_flops_per_token(cfg, 24) == pytest.approx(expected, rel=1e-9)
