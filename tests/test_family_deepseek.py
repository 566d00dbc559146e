"""Acceptance for the DeepSeek family (DeepSeek-V3 and V2, models/deepseek_v3.py, deepseek_v2.py):
multi-latent attention with q_lora_rank on and off, YaRN, rope_interleave on and off, a dense
first layer, shared experts, the sigmoid router with its bias, group-limited top-k and the
routed scaling factor, against transformers' own classes (tiny random models, CPU, fp32)."""

import json

import pytest
import torch

from hf_models import hf_config_dict, hf_logits, make_hf_model
from lightning_mcore import OptimizerSettings, models
from lightning_mcore.hf.config import HFCheckpointError
from lightning_mcore.hf.mappings import local_name
from lightning_mcore.hf.transforms import RopeRows
from lightning_mcore.lora.config import LoRAConfig
from lightning_mcore.model.flops import training_flops_per_token
from test_hf_roundtrip import check_logits_and_export
from test_lora import TOKENS, fit_lora_at_tp2_sp, peft_and_merged_match
from test_throughput import counted_training_flops
from toy import assemble, fit

LAYOUTS = {
    "tp1": (1, {}),
    "tp2_sp": (2, dict(tensor_model_parallel_size=2, sequence_parallel=True)),
    "pp2": (2, dict(pipeline_model_parallel_size=2)),
    "ep2": (2, dict(expert_model_parallel_size=2)),
    "ep2_tp2_sp": (4, dict(expert_model_parallel_size=2, tensor_model_parallel_size=2,
                           expert_tensor_parallel_size=1, sequence_parallel=True)),
}
CASES = ([("deepseek_v3", layout) for layout in LAYOUTS]
         + [("deepseek_v3_noq", "tp2_sp"), ("deepseek_v3_noq", "ep2_tp2_sp")]
         + [("deepseek_v2", "tp1"), ("deepseek_v2", "tp2_sp")])


@pytest.mark.distributed
@pytest.mark.parametrize("family,layout", CASES, ids=[f"{f}-{l}" for f, l in CASES])
def test_logits_and_export_match_transformers(family, layout, tmp_path):
    check_logits_and_export(family, layout, tmp_path, layouts=LAYOUTS)


DENSE = dict(num_moe_experts=None, moe_layer_freq=1, moe_shared_expert_intermediate_size=None,
             moe_router_score_function="softmax", moe_router_enable_expert_bias=False,
             moe_router_num_groups=None, moe_router_group_topk=None)
TRAINING = {  # name: (changes to the tiny model's config, TP=2 options, optimizer)
    "moe_sp": ({}, dict(sequence_parallel=True), OptimizerSettings(lr=1e-3)),
    # SGD: trained weights differ by lr x the gradients' difference (Adam would magnify the
    # float noise of a near-zero gradient: one embedding element here).
    "dense_no_sp": (DENSE, {}, OptimizerSettings(lr=0.1, optimizer="sgd")),
}


@pytest.mark.distributed
@pytest.mark.parametrize("case", list(TRAINING))
def test_training_at_tp2_follows_one_process(case, tmp_path):
    """3 steps from the same layout-invariant init: losses, trained weights and the routing bias
    (which mcore moves by token counts, outside the optimizer) equal the one-process run's."""
    changes, sp, optim = TRAINING[case]
    cfg, _ = models.gpt_config_from_hf(hf_config_dict("deepseek_v3"), seq_length=32,
                                       transformer_impl="local", **changes)
    runs = {}
    for name, devices, parallel in (("ref", 1, {}), ("tp2", 2, dict(tensor_model_parallel_size=2, **sp))):
        losses = fit(tmp_path, devices=devices, config=cfg, optim=optim, dump_weights=True, name=name,
                     **parallel)
        runs[name] = (losses, assemble(sorted(tmp_path.glob(f"{name}.init*.pt"))),
                      assemble(sorted(tmp_path.glob(f"{name}.end*.pt"))))
    (ref_losses, ref_init, ref_end), (losses, init, end) = runs["ref"], runs["tp2"]

    assert any("linear_kv_down_proj" in k for k in ref_end), sorted(ref_end)
    assert any(k.endswith("router.expert_bias") for k in ref_end) == (case == "moe_sp")
    assert init.keys() == ref_init.keys()
    for key, full in ref_init.items():
        assert torch.equal(init[key], full), f"initial {key} differs at TP=2"
    assert len(losses) == len(ref_losses) == 3
    for step, (got, want) in enumerate(zip(losses, ref_losses)):
        assert abs(got - want) <= 1e-5 * abs(want), f"step {step}: {got} vs {want}"
    bias = [k for k in ref_end if k.endswith("router.expert_bias")]
    assert not bias or any(not torch.equal(ref_end[k], ref_init[k]) for k in bias), "no bias moved"
    for key, full in ref_end.items():  # a bias stays put where its experts' loads were equal
        assert key in bias or not torch.equal(full, ref_init[key]), f"{key} was not trained"
        torch.testing.assert_close(end[key], full, rtol=0, atol=1e-5, msg=key)


# Attention only: peft (0.21, on transformers 5) reads gate_proj/up_proj/down_proj targets of a
# DeepSeek model as its fused routed experts, so the dense and shared-expert MLPs' adapters
# would not load there. The MLA linears by HF name, linear_q_proj by its mcore name (q_proj
# names GQA's linear_qkv).
LORA_TARGETS = {
    "deepseek_v3": ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"],
    "deepseek_v3_noq": ["linear_q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"],
}


def lora_parameters(c, targets, r: int) -> int:
    """r x (in + out) for each adapted linear of every layer."""
    q, h = c.num_attention_heads * (c.qk_nope_head_dim + c.qk_rope_head_dim), c.hidden_size
    sizes = {"q_a_proj": (h, c.q_lora_rank), "q_b_proj": (c.q_lora_rank, q), "linear_q_proj": (h, q),
             "kv_a_proj_with_mqa": (h, c.kv_lora_rank + c.qk_rope_head_dim),
             "kv_b_proj": (c.kv_lora_rank, c.num_attention_heads * (c.qk_nope_head_dim + c.v_head_dim)),
             "o_proj": (c.num_attention_heads * c.v_head_dim, h)}
    return c.num_hidden_layers * r * sum(sum(sizes[t]) for t in targets)


@pytest.mark.distributed
@pytest.mark.parametrize("family", list(LORA_TARGETS))
def test_lora_on_attention_exports_a_peft_adapter_at_tp2(family, tmp_path):
    """Adapters on the MLA linears at TP=2 (+SP), trained 3 steps: the PEFT export loads in peft
    with the mcore model's logits, the merged export equals peft's merge, and the base model,
    the routing bias included, is untouched."""
    source = tmp_path / "source"
    hf = make_hf_model(family, source)
    lora = LoRAConfig(target_modules=LORA_TARGETS[family], rank=4, alpha=8.0)
    fit_lora_at_tp2_sp(source, lora, tmp_path)

    facts = json.loads((tmp_path / "facts.json").read_text())
    assert facts["base_unchanged"]
    assert facts["trainable"] == lora_parameters(hf.config, LORA_TARGETS[family], 4)
    mcore = torch.load(tmp_path / "logits.pt")
    assert (mcore - hf_logits(hf, TOKENS)).abs().max() > 1e-3, "the adapters changed nothing"

    peft_and_merged_match(source, tmp_path, mcore)


YARN = hf_config_dict("deepseek_v3")["rope_parameters"]
REFUSED = [  # (tiny model, config.json changes, the field named, what the message says)
    ("deepseek_v3", dict(norm_topk_prob=False), "norm_topk_prob=False", "renormalises"),
    ("deepseek_v3", dict(n_group=4, topk_group=2), "topk_group=2", "num_experts_per_tok / topk_group = 2"),
    ("deepseek_v3", dict(n_group=3), "n_group=3", "do not split"),
    ("deepseek_v3", dict(scoring_func="softmax"), "scoring_func='softmax'", "sigmoid"),
    ("deepseek_v3", dict(topk_method="group_limited_greedy"), "topk_method", "noaux_tc"),
    ("deepseek_v3", dict(num_key_value_heads=2), "num_key_value_heads=2", "one key/value head"),
    ("deepseek_v3", dict(attention_bias=True), "attention_bias=True", "biases"),
    ("deepseek_v3", dict(moe_layer_freq=2), "moe_layer_freq=2", "every layer after the dense"),
    ("deepseek_v3", dict(rope_parameters=dict(YARN, rope_type="llama3", low_freq_factor=1.0,
                                              high_freq_factor=4.0)), "rope_parameters", "'llama3'"),
    ("deepseek_v3", dict(rope_parameters=dict(YARN, mscale=None)), "rope_parameters",
     "mscale_all_dim=0.8 and no mscale"),
    ("deepseek_v3", dict(rope_parameters=dict(YARN, attention_factor=1.5)), "rope_parameters",
     "attention_factor"),
    ("deepseek_v3", dict(rope_parameters=dict(YARN, truncate=False)), "rope_parameters", "truncate"),
    ("deepseek_v2", dict(topk_method="group_limited_greedy", n_group=2, topk_group=1), "topk_method",
     "'greedy'"),
]


@pytest.mark.parametrize("name,changes,field,why", REFUSED,
                         ids=[f"{r[0]}-{r[2].split('=')[0]}" for r in REFUSED])
def test_unsupported_variants_are_refused_by_name(name, changes, field, why):
    config = {**hf_config_dict(name), **changes}
    with pytest.raises(HFCheckpointError) as info:
        models.gpt_config_from_hf(config)
    assert field in str(info.value) and why in str(info.value), str(info.value)


def test_q_lora_rank_absent_is_refused_not_guessed():
    config = hf_config_dict("deepseek_v3")
    del config["q_lora_rank"]  # transformers would fill in DeepSeek-V3's 1536
    with pytest.raises(HFCheckpointError, match="q_lora_rank=None: not in config.json"):
        models.gpt_config_from_hf(config)


@pytest.mark.distributed
def test_published_mtp_layer_loads_and_is_carried_to_the_export(tmp_path):
    """A checkpoint as DeepSeek publishes it (num_nextn_predict_layers=1, the MTP layer's
    tensors after the last layer) loads without edits; the export holds them bit for bit."""
    from hf_models import add_mtp_layer

    check_logits_and_export("deepseek_v3", "ep2", tmp_path, layouts={"ep2": (2, dict(expert_model_parallel_size=2))},
                            prepare=add_mtp_layer)


def test_te_spec_names_of_the_mla_norms_map_to_the_local_ones():
    assert local_name("decoder.layers.2.self_attention.linear_q_up_proj.layer_norm_weight") == \
        "decoder.layers.2.self_attention.q_layernorm.weight"
    assert local_name("decoder.layers.0.self_attention.linear_kv_up_proj.layer_norm_weight") == \
        "decoder.layers.0.self_attention.kv_layernorm.weight"


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_rope_rows_reorder_halves_to_pairs_and_back(tp):
    """HF rotate-half rows (pairs i, i + d/2) become mcore's interleaved pairs (2i, 2i + 1) in
    every block; each TP rank reads its slice of the reordered rows; saving undoes it."""
    block, rope, blocks = 6, 4, 4  # per block: 2 rows without RoPE, then a0 a1 b0 b1
    hf = torch.arange(block * blocks * 3, dtype=torch.float32).reshape(block * blocks, 3)
    want = torch.cat([torch.cat([b[:2], b[[2, 4, 3, 5]]]) for b in hf.split(block)])
    reader = _Reader({"w": hf})
    transform = RopeRows(block, rope)
    shards = [transform.load(reader, ["w"], r, tp, None) for r in range(tp)]
    assert torch.equal(torch.cat(shards), want)
    assert torch.equal(transform.save(shards, ["w"], None)["w"], hf)


class _Reader:
    def __init__(self, tensors):
        self.tensors = tensors

    def get(self, name, dim=0, start=None, stop=None):
        t = self.tensors[name]
        start, stop = start or 0, t.shape[dim] if stop is None else stop
        return t.narrow(dim, start, stop - start)

    def shape(self, name):
        return tuple(self.tensors[name].shape)


@pytest.mark.parametrize("name", ["deepseek_v3", "deepseek_v3_noq", "deepseek_v2"])
def test_config_json_round_trip(name):
    """A model's GPTConfig picks its DeepSeek version and writes a config.json (through
    transformers' own config class) that reads back as the same GPTConfig."""
    cfg, family = models.gpt_config_from_hf(hf_config_dict(name))
    assert models.family_of(cfg) == family == name.removesuffix("_noq")
    written = models.hf_config_dict_from_gpt(cfg, family, max_position_embeddings=256)
    assert written["num_nextn_predict_layers" if family == "deepseek_v3" else "first_k_dense_replace"] \
        == (0 if family == "deepseek_v3" else 1)
    assert models.gpt_config_from_hf(written) == (cfg, family)


@pytest.mark.parametrize("name", ["deepseek_v3", "deepseek_v3_noq"])
def test_flops_per_token_equal_torch_flop_counter(name, tmp_path):
    """MLA's projections and QK^T / AV over unequal head dims, a dense first layer, routed and
    shared experts: the MFU numerator equals what torch counts on transformers' model."""
    hf = make_hf_model(name, tmp_path)
    cfg, _ = models.gpt_config_from_hf(tmp_path)
    hf.config._attn_implementation = "eager"  # explicit matmuls over the full s x s scores
    hf.config._experts_implementation = "eager"  # a loop of per-expert linears on routed tokens
    seq = 64
    expected = counted_training_flops(hf.train(), seq)
    assert training_flops_per_token(cfg, seq) == pytest.approx(expected, rel=1e-9)


def test_a_peft_export_peft_would_misread_is_refused_before_training():
    """peft (transformers 5) takes DeepSeek's gate/up/down_proj targets for its routed experts:
    an adapter on the dense/shared MLPs is refused as PEFT (merged is fine); attention is not."""
    from hf_models import hf_config_dict

    from lightning_mcore import LoRAConfig, models
    from lightning_mcore.hf.config import HFCheckpointError

    cfg, family = models.gpt_config_from_hf(hf_config_dict("deepseek_v3"))
    with pytest.raises(HFCheckpointError, match=r"linear_fc1, linear_fc2 would load wrong.*merged"):
        models.refuse_peft_export(cfg, family, LoRAConfig(target_modules="all-linear", experts=False))
    with pytest.raises(HFCheckpointError, match=r"PEFT export of LoRA on the routed experts.*merged"):
        models.refuse_peft_export(cfg, family, LoRAConfig(target_modules="all-linear"))
    models.refuse_peft_export(cfg, family, LoRAConfig(target_modules=["q_a_proj", "kv_b_proj", "o_proj"]))
    llama, name = models.gpt_config_from_hf(hf_config_dict("llama"))
    models.refuse_peft_export(llama, name, LoRAConfig(target_modules="all-linear"))


def as_kimi_k2(source) -> None:
    """Kimi-K2's config.json: DeepSeek-V3's architecture under its own model_type (read through
    remote code by transformers; our loader goes by architectures[0])."""
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps(config | {"model_type": "kimi_k2"}))


@pytest.mark.distributed
def test_kimi_k2_is_deepseek_v3_under_another_model_type(tmp_path):
    """Logits equal transformers' DeepseekV3ForCausalLM at EP=2 and the export is bit-identical
    (config.json copied as published)."""
    check_logits_and_export("deepseek_v3", "ep2", tmp_path, layouts={"ep2": (2, dict(expert_model_parallel_size=2))},
                            prepare=as_kimi_k2, reload=False)
    assert json.loads((tmp_path / "export" / "config.json").read_text())["model_type"] == "kimi_k2"
