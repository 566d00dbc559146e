"""Gemma 3 on the Transformer Engine spec: TE's zero-centred norms (fused into linear_qkv and
linear_fc1, the q/k norms, the final norm), the TE post norms of linear_proj/linear_fc2, TE's
softmax scale and the per-layer RoPE base give transformers' logits, and the export (TE names
mapped back) is bit-identical; LoRA's update goes through the post norm as peft's does.
fp32 on both sides: TE's kernels differ from torch's by rounding only. Skipped without CUDA."""

import lightning as L
import pytest
import torch
from hf_models import hf_logits, make_hf_model
from test_family_gemma3 import SEQ, LoRAProbe, tokens
from test_hf_roundtrip import SaveLogitsAndExport, tensors
from torch.utils.data import DataLoader
from toy import TokenRows
from transformers import AutoModelForCausalLM

from lightning_mcore import MegatronStrategy, OptimizerSettings, PretrainModule
from lightning_mcore.lora.config import LoRAConfig

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]


def test_te_logits_and_export_match_transformers(tmp_path):
    source = tmp_path / "source"
    hf = make_hf_model("gemma3", source)
    trainer = L.Trainer(
        accelerator="gpu", devices=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
        strategy=MegatronStrategy(global_batch_size=2, start_method="popen"),
        callbacks=[SaveLogitsAndExport(tmp_path)],
    )
    module = PretrainModule(str(source), model_overrides={"seq_length": SEQ})
    assert module.model_config.uses_te("gpu")
    trainer.predict(module, DataLoader([{"tokens": t} for t in tokens()], batch_size=2))
    logits = torch.load(tmp_path / "logits.pt").cpu()
    assert (logits - hf_logits(hf, tokens())).abs().max().item() <= 1e-3
    original, written = tensors(source), tensors(tmp_path / "export")
    assert written.keys() == original.keys()
    assert all(torch.equal(written[n], t) for n, t in original.items())


def test_te_lora_peft_export_matches_peft(tmp_path):
    from peft import PeftModel

    source = tmp_path / "source"
    hf = make_hf_model("gemma3", source)
    trainer = L.Trainer(
        accelerator="gpu", devices=1, max_steps=3, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[LoRAProbe(tmp_path)],
        strategy=MegatronStrategy(global_batch_size=4, micro_batch_size=2, start_method="popen"),
    )
    module = PretrainModule(str(source), OptimizerSettings(lr=2e-2, warmup_steps=0),
                            model_overrides={"seq_length": SEQ},
                            lora=LoRAConfig(target_modules="all-linear", rank=4, alpha=8.0))
    trainer.fit(module, DataLoader(TokenRows(n=16, seq=SEQ, vocab=200), batch_size=4))
    mcore = torch.load(tmp_path / "logits.pt").cpu()
    assert (mcore - hf_logits(hf, tokens())).abs().max() > 1e-3, "the adapters changed nothing"
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(source), tmp_path / "peft")
    assert (hf_logits(peft_model.eval(), tokens()) - mcore).abs().max().item() <= 1e-3


def test_te_full_recompute_trains_alike(tmp_path):
    """Activation recompute carries the stacked (global, local) rotary embedding through its
    checkpoints: the same SGD steps with and without it."""
    from toy import assemble, fit

    source = tmp_path / "source"
    make_hf_model("gemma3", source)
    runs = {}
    for name, overrides in (("plain", {}), ("recompute", {"recompute_granularity": "full"})):
        losses = fit(tmp_path, devices=1, steps=2, config=str(source), dump_weights=True, name=name,
                     accelerator="gpu", start_method="popen", dataset=TokenRows(seq=SEQ, vocab=200),
                     optim=OptimizerSettings(lr=0.1, optimizer="sgd", warmup_steps=0),
                     module_kwargs={"model_overrides": {"seq_length": SEQ, **overrides}})
        runs[name] = losses, assemble(sorted(tmp_path.glob(f"{name}.end*.pt")))
    (want, ref), (got, trained) = runs["plain"], runs["recompute"]
    assert got == pytest.approx(want, rel=1e-6)
    for key, full in ref.items():
        torch.testing.assert_close(trained[key], full, rtol=0, atol=1e-6, msg=key)
