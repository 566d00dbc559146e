"""Acceptance for Phi-3 / Phi-4 (Phi3ForCausalLM): fused qkv_proj and gate_up_proj split over
tensor-parallel ranks, partial RoPE and windows; logits equal transformers' at TP=2 + SP, PP=2
and DP=2; the export is bit-identical; greedy generation equals transformers'; LoRA exports to peft."""

import pytest

from hf_models import hf_config_dict, make_hf_model
from lightning_mcore.models import gpt_config_from_hf, hf_config_dict_from_gpt
from test_hf_roundtrip import FAMILY_LAYOUTS, check_logits_and_export

SEQ = 24
LAYOUTS = {k: v for k, v in FAMILY_LAYOUTS.items() if k != "ep2"}


@pytest.mark.distributed
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_logits_and_export_match_transformers(layout, tmp_path):
    check_logits_and_export("phi3", layout, tmp_path, seq=SEQ, layouts=LAYOUTS)


@pytest.mark.distributed
def test_cached_generation_equals_transformers_greedy(tmp_path):
    from test_generation import check_one_layout, hf_greedy, run

    source = tmp_path / "phi3"
    want = hf_greedy(make_hf_model("phi3", source))
    got = run(tmp_path, str(source), 2, "tp2", tensor_model_parallel_size=2)
    check_one_layout(got)
    assert got["greedy"] == want


def test_config_round_trips_through_transformers():
    cfg, family = gpt_config_from_hf(hf_config_dict("phi3"), seq_length=SEQ)
    assert family == "phi3" and (cfg.rotary_percent, cfg.sliding_window) == (0.75, 8)
    again, _ = gpt_config_from_hf(hf_config_dict_from_gpt(cfg, family), seq_length=SEQ)
    assert again == cfg


@pytest.mark.parametrize("changes,field", [
    (dict(rope_parameters={"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 8,
                           "long_factor": [1.0] * 8}), "rope_parameters"),
    (dict(resid_pdrop=0.1), "resid_pdrop"),
], ids=["longrope", "dropout"])
def test_unsupported_variants_are_refused_by_name(changes, field):
    from lightning_mcore.hf.config import HFCheckpointError

    with pytest.raises(HFCheckpointError, match=rf"\b{field}\b"):
        gpt_config_from_hf({**hf_config_dict("phi3"), **changes})


@pytest.mark.distributed
def test_lora_exports_a_peft_adapter_with_equal_logits(tmp_path):
    """Adapters on the fused qkv_proj and gate_up_proj too (peft adapts the fused linears), at TP=2."""
    from test_family_qwen3_5 import check_peft_export

    written = check_peft_export("phi3", dict(tensor_model_parallel_size=2, sequence_parallel=True),
                                "all-linear", 4, tmp_path)
    assert written == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}
