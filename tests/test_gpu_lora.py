"""LoRA on the Transformer Engine spec (fused LayerNorm+Linear hands the adapter its normalised
input): the PEFT export loads in peft with the mcore model's logits; skipped without CUDA."""

import json

import lightning as L
import pytest
import torch
from hf_models import hf_logits, make_hf_model
from test_lora import TOKENS, Probe, formula
from torch.utils.data import DataLoader
from toy import TokenRows
from transformers import AutoModelForCausalLM

from lightning_mcore import MegatronStrategy, OptimizerSettings, PretrainModule
from lightning_mcore.lora.config import LoRAConfig

pytestmark = [pytest.mark.gpu]


def test_te_lora_peft_export_matches_peft(tmp_path):
    from peft import PeftModel

    source = tmp_path / "source"
    hf = make_hf_model("llama", source)
    trainer = L.Trainer(
        accelerator="gpu", devices=1, max_steps=3, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, callbacks=[Probe(tmp_path)],
        strategy=MegatronStrategy(global_batch_size=4, micro_batch_size=2, start_method="popen"),
    )
    module = PretrainModule(str(source), OptimizerSettings(lr=2e-2, warmup_steps=0),
                            lora=LoRAConfig(rank=4, alpha=8.0))
    assert module.model_config.uses_te("gpu")
    trainer.fit(module, DataLoader(TokenRows(n=16, seq=16, vocab=200), batch_size=4))
    facts = json.loads((tmp_path / "facts.json").read_text())
    assert facts["base_unchanged"] and facts["trainable"] == formula(hf.config, 4)
    mcore = torch.load(tmp_path / "logits.pt").cpu()
    assert (mcore - hf_logits(hf, TOKENS)).abs().max() > 1e-3
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(source), tmp_path / "peft")
    # fp32 on both sides; TE's kernels differ from torch's by rounding only
    assert (hf_logits(peft_model.eval(), TOKENS) - mcore).abs().max().item() <= 1e-3
