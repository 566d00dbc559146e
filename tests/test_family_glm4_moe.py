"""Acceptance for GLM-4.5 (Glm4MoeForCausalLM): logits equal transformers' at TP=2 with
sequence parallelism, PP=2, EP=2 and DP=2; the export is bit-identical; the published
multi-token-prediction layer (model.layers.<num_hidden_layers>.*) is carried to the export
unchanged; greedy generation with the KV cache equals transformers'."""

import pytest

from hf_models import add_mtp_layer, hf_config_dict, make_hf_model
from lightning_mcore.models import gpt_config_from_hf, hf_config_dict_from_gpt
from test_hf_roundtrip import FAMILY_LAYOUTS, check_logits_and_export

SEQ = 24
LAYOUTS = FAMILY_LAYOUTS


@pytest.mark.distributed
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_logits_and_export_match_transformers(layout, tmp_path):
    check_logits_and_export("glm4_moe", layout, tmp_path, seq=SEQ, layouts=LAYOUTS)


@pytest.mark.distributed
def test_published_mtp_layer_is_carried_through_to_the_export(tmp_path):
    check_logits_and_export("glm4_moe", "ep2", tmp_path, seq=SEQ, layouts=LAYOUTS, prepare=add_mtp_layer)


@pytest.mark.distributed
def test_cached_generation_equals_transformers_greedy(tmp_path):
    from test_generation import check_one_layout, hf_greedy, run

    source = tmp_path / "glm4_moe"
    want = hf_greedy(make_hf_model("glm4_moe", source))
    got = run(tmp_path, str(source), 2, "ep2", expert_model_parallel_size=2)
    check_one_layout(got)
    assert got["greedy"] == want


@pytest.mark.distributed
def test_attention_lora_exports_a_peft_adapter_with_equal_logits(tmp_path):
    """q/k/v (with their biases frozen) and o_proj adapters at TP=2 + SP; MLP adapters of this
    family export merged only (peft reads them as the routed experts')."""
    from test_family_qwen3_5 import check_peft_export

    written = check_peft_export("glm4_moe", dict(tensor_model_parallel_size=2, sequence_parallel=True),
                                ["linear_qkv", "linear_proj"], 4, tmp_path)
    assert written == {"q_proj", "k_proj", "v_proj", "o_proj"}


def test_config_round_trips_through_transformers():
    cfg, family = gpt_config_from_hf(hf_config_dict("glm4_moe"), seq_length=SEQ)
    assert family == "glm4_moe"
    assert (cfg.rotary_percent, cfg.add_qkv_bias, cfg.qk_layernorm) == (0.5, True, True)
    assert (cfg.moe_router_score_function, cfg.moe_router_num_groups, cfg.moe_router_group_topk) == (
        "sigmoid", 2, 1)
    assert [cfg.is_moe_layer(i) for i in range(4)] == [False, True, True, True]
    again, _ = gpt_config_from_hf(hf_config_dict_from_gpt(cfg, family), seq_length=SEQ)
    assert again == cfg


@pytest.mark.parametrize("changes,field", [
    (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                           "rope_theta": 1e4, "partial_rotary_factor": 0.5}), "rope_parameters"),
    (dict(n_group=3), "n_group"),
    (dict(hidden_act="gelu"), "hidden_act"),
], ids=["rope", "n_group", "hidden_act"])
def test_unsupported_variants_are_refused_by_name(changes, field):
    from lightning_mcore.hf.config import HFCheckpointError

    with pytest.raises(HFCheckpointError, match=rf"\b{field}\b"):
        gpt_config_from_hf({**hf_config_dict("glm4_moe"), **changes})
