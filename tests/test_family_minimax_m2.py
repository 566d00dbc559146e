"""Acceptance for MiniMax-M2 (MiniMaxM2ForCausalLM): logits equal transformers' at TP=2 with
sequence parallelism (q/k norms over all heads: their sum of squares all-reduced over the
tensor-parallel ranks), PP=2, EP=2 and DP=2; the export is bit-identical; greedy generation with
the KV cache equals transformers'; TP=2 training equals one process."""

import pytest

from hf_models import hf_config_dict, make_hf_model
from lightning_mcore.models import gpt_config_from_hf, hf_config_dict_from_gpt
from test_hf_roundtrip import FAMILY_LAYOUTS, check_logits_and_export

SEQ = 24
TP2_SP = dict(tensor_model_parallel_size=2, sequence_parallel=True)
LAYOUTS = FAMILY_LAYOUTS


@pytest.mark.distributed
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_logits_and_export_match_transformers(layout, tmp_path):
    check_logits_and_export("minimax_m2", layout, tmp_path, seq=SEQ, layouts=LAYOUTS)


@pytest.mark.distributed
def test_cached_generation_equals_transformers_greedy(tmp_path):
    from test_generation import check_cache, hf_greedy, run

    source = tmp_path / "minimax_m2"
    want = hf_greedy(make_hf_model("minimax_m2", source))
    got = run(tmp_path, str(source), 2, "tp2", full=False, **TP2_SP)
    check_cache(got)
    assert got["greedy"] == want


@pytest.mark.distributed
def test_training_is_layout_invariant_and_resumes_at_another_layout(tmp_path):
    """The q/k norm weights' gradients at TP=2 (each rank its heads' slice, summed) against one
    process; every expert chosen (top-k = all 4) so that no routing choice flips on a last bit."""
    from test_family_qwen3_5 import check_layout_invariant_training

    check_layout_invariant_training("minimax_m2", TP2_SP, tmp_path, moe_router_topk=4, resume_at=(
        ("pp2_tp2", 4, dict(pipeline_model_parallel_size=2, **TP2_SP)),))


def test_config_round_trips_through_transformers():
    cfg, family = gpt_config_from_hf(hf_config_dict("minimax_m2"), seq_length=SEQ)
    assert family == "minimax_m2"
    assert (cfg.qk_layernorm, cfg.qk_norm_across_heads, cfg.rotary_percent) == (True, True, 0.5)
    assert (cfg.moe_router_score_function, cfg.moe_router_enable_expert_bias) == ("sigmoid", True)
    again, _ = gpt_config_from_hf(hf_config_dict_from_gpt(cfg, family), seq_length=SEQ)
    assert again == cfg


def test_released_config_fields_read_as_transformers_reads_them():
    """The released config.json says rotary_dim (and the MiniMax names of the router's kind)."""
    released = {**hf_config_dict("minimax_m2"), "rotary_dim": 4, "scoring_func": "sigmoid",
                "use_routing_bias": True, "qk_norm_type": "per_layer", "shared_intermediate_size": 0}
    released["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    cfg, _ = gpt_config_from_hf(released, seq_length=SEQ)
    assert cfg.rotary_percent == 0.25
    with pytest.raises(Exception, match="scoring_func"):
        gpt_config_from_hf({**released, "scoring_func": "softmax"}, seq_length=SEQ)
