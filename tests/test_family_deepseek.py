"""Acceptance for the DeepSeek family (DeepSeek-V3 and V2, models/deepseek_v3.py, deepseek_v2.py):
multi-latent attention with q_lora_rank on and off, YaRN, rope_interleave on and off, a dense
first layer, shared experts, the sigmoid router with its bias, group-limited top-k and the
routed scaling factor, against transformers' own classes (tiny random models, CPU, fp32)."""

import pytest
import torch
import lightning as L
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM

from hf_models import hf_logits, make_hf_model
from lightning_mcore import MegatronStrategy, PretrainModule
from test_hf_roundtrip import SaveLogitsAndExport, tensors

LAYOUTS = {
    "tp1": (1, {}),
    "tp2_sp": (2, dict(tensor_model_parallel_size=2, sequence_parallel=True)),
    "pp2": (2, dict(pipeline_model_parallel_size=2)),
    "ep2": (2, dict(expert_model_parallel_size=2)),
    "ep2_tp2_sp": (4, dict(expert_model_parallel_size=2, tensor_model_parallel_size=2,
                           expert_tensor_parallel_size=1, sequence_parallel=True)),
}
CASES = ([("deepseek_v3", lay) for lay in LAYOUTS] + [("deepseek_v3_noq", "tp2_sp"), ("deepseek_v3_noq", "ep2_tp2_sp")]
         + [("deepseek_v2", "tp1"), ("deepseek_v2", "tp2_sp")])


@pytest.mark.distributed
@pytest.mark.parametrize("family,layout", CASES, ids=[f"{f}-{l}" for f, l in CASES])
def test_logits_and_export_match_transformers(family, layout, tmp_path):
    source = tmp_path / "source"
    hf = make_hf_model(family, source)
    tokens = torch.randint(0, hf.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    expected = hf_logits(hf, tokens)

    devices, parallel = LAYOUTS[layout]
    trainer = L.Trainer(
        accelerator="cpu", devices=devices, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
        strategy=MegatronStrategy(global_batch_size=2, start_method="fork", **parallel),
        callbacks=[SaveLogitsAndExport(tmp_path)],
    )
    trainer.predict(PretrainModule(str(source)), DataLoader([{"tokens": t} for t in tokens], batch_size=2))

    logits = torch.load(tmp_path / "logits.pt")
    assert logits.shape == expected.shape
    assert (logits - expected).abs().max().item() <= 1e-4

    original, written = tensors(source), tensors(tmp_path / "export")
    assert written.keys() == original.keys()
    for name, tensor in original.items():
        assert written[name].dtype == tensor.dtype and torch.equal(written[name], tensor), name
    reloaded, info = AutoModelForCausalLM.from_pretrained(tmp_path / "export", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    torch.testing.assert_close(hf_logits(reloaded.eval(), tokens), expected, rtol=0, atol=0)
