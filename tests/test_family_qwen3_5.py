"""Acceptance for Qwen3.5 (text): logits equal transformers' at TP=1, TP=2 with sequence
parallelism, PP=2 (linear and full attention on both stages) and DP=2; the export is
bit-identical."""

import pytest

from test_hf_roundtrip import check_logits_and_export

SEQ = 24
LAYOUTS = {
    "tp1": (1, {}),
    "tp2_sp": (2, dict(tensor_model_parallel_size=2, sequence_parallel=True)),
    "pp2": (2, dict(pipeline_model_parallel_size=2)),
    "dp2": (2, {}),
}


@pytest.mark.distributed
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_logits_and_export_match_transformers(layout, tmp_path):
    check_logits_and_export("qwen3_5", layout, tmp_path, seq=SEQ, layouts=LAYOUTS)
