"""Acceptance for Mixtral and Qwen2-MoE beyond logits and export (tests/test_hf_roundtrip.py):
training steps at TP=2 (+SP) and EP=2 x TP=2 (expert-TP 1) follow the one-process run of the
same checkpoint; LoRA adapters export as a PEFT adapter that peft loads with our logits;
configs we cannot express are refused by name before any process starts.

The Qwen2-MoE model mixes dense and MoE layers (mlp_only_layers) and has the shared expert
with its sigmoid gate, whose replicated weight sees a sequence shard under SP (its gradient is
summed over TP ranks, as for norms).
"""

import json

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM

from hf_models import hf_logits, make_hf_model
from lightning_mcore import MegatronStrategy, OptimizerSettings, PretrainModule
from lightning_mcore.model.lora import LoRAConfig
from test_lora import TOKENS, Probe, tensors
from toy import TokenRows, assemble, fit

LAYOUTS = {
    "tp2_sp": (2, dict(tensor_model_parallel_size=2, sequence_parallel=True)),
    "ep2_tp2": (4, dict(expert_model_parallel_size=2, tensor_model_parallel_size=2,
                        sequence_parallel=True, expert_tensor_parallel_size=1)),
}
TRAIN_CASES = [("mixtral", "tp2_sp"), ("qwen2_moe", "tp2_sp"), ("qwen2_moe", "ep2_tp2")]


def train(source, tmp, name: str, devices: int = 1, **parallel):
    """Two steps from the HF checkpoint (one row per microbatch: every layout sees the same
    microbatches); (losses, weights before, weights after)."""
    losses = fit(tmp, devices=devices, steps=2, gbs=4, mbs=1, config=str(source),
                 optim=OptimizerSettings(lr=1e-3, warmup_steps=0), dump_weights=True, name=name,
                 dataset=TokenRows(n=8, seq=16, vocab=200), **parallel)
    return (losses, assemble(sorted(tmp.glob(f"{name}.init*.pt"))),
            assemble(sorted(tmp.glob(f"{name}.end*.pt"))))


@pytest.fixture(scope="module")
def single_process(tmp_path_factory):
    """Per family: its tiny checkpoint and the one-process run, computed once, when first needed."""
    cache = {}

    def get(family: str):
        if family not in cache:
            tmp = tmp_path_factory.mktemp(f"ref_{family}")
            make_hf_model(family, tmp / "source")
            cache[family] = tmp / "source", train(tmp / "source", tmp, "ref")
        return cache[family]

    return get


@pytest.mark.distributed
@pytest.mark.parametrize("family,layout", TRAIN_CASES, ids=[f"{f}-{l}" for f, l in TRAIN_CASES])
def test_training_steps_match_single_process(family, layout, single_process, tmp_path):
    source, (ref_losses, ref_init, ref_trained) = single_process(family)
    devices, parallel = LAYOUTS[layout]
    losses, init, trained = train(source, tmp_path, "run", devices, **parallel)

    assert any("shared_experts.gate_weight" in k for k in ref_init) == (family == "qwen2_moe")
    assert init.keys() == ref_init.keys()
    for key, full in ref_init.items():  # loaded from the same checkpoint; NaN: a shard no rank wrote
        assert torch.equal(init[key], full), f"initial {key} differs under {layout}"
    assert len(losses) == len(ref_losses) == 2
    for step, (got, want) in enumerate(zip(losses, ref_losses)):
        assert abs(got - want) <= 1e-5 * abs(want), f"step {step}: {got} vs {want} ({layout})"
    for key, full in ref_trained.items():
        assert not torch.equal(full, ref_init[key]), f"{key} was not trained"
        torch.testing.assert_close(trained[key], full, rtol=0, atol=1e-5, msg=f"{key} ({layout})")


@pytest.mark.distributed
@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_lora_on_attention_exports_a_peft_adapter(family, tmp_path):
    from peft import PeftModel

    source = tmp_path / "source"
    hf = make_hf_model(family, source)
    lora = LoRAConfig(target_modules=["linear_qkv", "linear_proj"], rank=4, alpha=8.0)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, max_steps=3, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, callbacks=[Probe(tmp_path)],
        strategy=MegatronStrategy(tensor_model_parallel_size=2, sequence_parallel=True,
                                  global_batch_size=4, micro_batch_size=2, start_method="fork"),
    )
    module = PretrainModule(str(source), OptimizerSettings(lr=2e-2, warmup_steps=0), lora=lora)
    trainer.fit(module, DataLoader(TokenRows(n=16, seq=16, vocab=200), batch_size=4))

    assert json.loads((tmp_path / "facts.json").read_text())["base_unchanged"]
    mcore = torch.load(tmp_path / "logits.pt")
    assert (mcore - hf_logits(hf, TOKENS)).abs().max() > 1e-3, "the adapters changed nothing"
    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert sorted(config["target_modules"]) == ["k_proj", "o_proj", "q_proj", "v_proj"]
    assert all(".self_attn." in k for k in tensors(tmp_path / "peft"))

    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(source), tmp_path / "peft")
    assert (hf_logits(peft_model.eval(), TOKENS) - mcore).abs().max().item() <= 1e-4
    merged_ref = peft_model.merge_and_unload().state_dict()
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").state_dict()
    assert merged.keys() == merged_ref.keys()
    for name, tensor in merged_ref.items():
        torch.testing.assert_close(merged[name], tensor, rtol=0, atol=1e-6, msg=name)
