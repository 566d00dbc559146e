"""Acceptance for the Gated DeltaNet hybrids, Qwen3.5 (dense and MoE, text) and Qwen3-Next:
logits equal transformers' at TP=1, TP=2 with sequence parallelism, PP=2 (linear and full
attention on both stages), EP=2 (MoE) and DP=2; the export is bit-identical."""

import pytest

from hf_models import make_hf_model

from test_hf_roundtrip import check_logits_and_export

SEQ = 24
LAYOUTS = {
    "tp1": (1, {}),
    "tp2_sp": (2, dict(tensor_model_parallel_size=2, sequence_parallel=True)),
    "pp2": (2, dict(pipeline_model_parallel_size=2)),
    "dp2": (2, {}),
    "ep2": (2, dict(expert_model_parallel_size=2)),
}
CASES = [("qwen3_5", layout) for layout in ("tp1", "tp2_sp", "pp2", "dp2")] + [
    (family, layout) for family in ("qwen3_5_moe", "qwen3_next") for layout in ("tp2_sp", "pp2", "ep2")]


@pytest.mark.distributed
@pytest.mark.parametrize("family,layout", CASES, ids=[f"{f}-{l}" for f, l in CASES])
def test_logits_and_export_match_transformers(family, layout, tmp_path):
    check_logits_and_export(family, layout, tmp_path, seq=SEQ, layouts=LAYOUTS)


@pytest.mark.distributed
def test_cached_generation_equals_transformers_greedy(tmp_path):
    """The convolution window and recurrent state of each linear-attention layer kept in the
    inference context: greedy generation with the cache equals no-cache decoding and
    transformers' `generate`, ragged prompts in one batch, at TP=1, TP=2 (sequence parallelism
    switched off for the cache) and PP=2; Qwen3-Next at EP=2."""
    from test_generation import check_one_layout, hf_greedy, run

    source = tmp_path / "qwen3_5"
    want = hf_greedy(make_hf_model("qwen3_5", source))
    for name, devices, parallel in (
            ("tp1", 1, {}), ("pp2", 2, dict(pipeline_model_parallel_size=2)),
            ("tp2_sp", 2, dict(tensor_model_parallel_size=2, sequence_parallel=True))):
        got = run(tmp_path, str(source), devices, name, **parallel)
        check_one_layout(got)
        assert got["greedy"] == want, name
    source = tmp_path / "qwen3_next"
    want = hf_greedy(make_hf_model("qwen3_next", source))
    got = run(tmp_path, str(source), 2, "next_ep2", expert_model_parallel_size=2)
    check_one_layout(got)
    assert got["greedy"] == want
