"""Acceptance for the Gated DeltaNet hybrids, Qwen3.5 (dense and MoE, text) and Qwen3-Next:
logits equal transformers' at TP=1, TP=2 with sequence parallelism, PP=2 (linear and full
attention on both stages), EP=2 (MoE) and DP=2; the export is bit-identical."""

import pytest

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
