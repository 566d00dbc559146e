"""Acceptance (issue 19, CPU part): LoRA on the routed experts of a tiny Qwen3-MoE (8 experts,
top-2; the local SequentialMLP). Each expert has its own A/B on its EP rank: EP=1, EP=2 and
EP=2 x TP=2 + SP (expert-TP 1) train alike; the base weights stay bit for bit; the trainable
count follows the formula; the merged export equals peft's merge_and_unload, and the PEFT
export (fused 3-D experts through peft's target_parameters) loads in peft with our logits."""

import dataclasses
import json

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from hf_models import hf_logits, make_hf_model
from lightning_mcore import MegatronStrategy, OptimizerSettings, PretrainModule
from lightning_mcore.lora.config import LoRAConfig, LoRAError
from test_lora import TOKENS, Probe, peft_and_merged_match, tensors
from toy import TokenRows, fit

SGD = OptimizerSettings(lr=0.5, optimizer="sgd", weight_decay=0.0, warmup_steps=0)
LAYOUTS = {
    "ep2": (2, dict(expert_model_parallel_size=2)),
    "ep2_tp2_sp": (4, dict(expert_model_parallel_size=2, tensor_model_parallel_size=2,
                           sequence_parallel=True, expert_tensor_parallel_size=1)),
}


def fit_at_ep2(source, lora: LoRAConfig, out, model_overrides=None, **parallel) -> None:
    """Three SGD steps at EP=2 (or `parallel`; two fork-launched CPU ranks); Probe writes to `out`."""
    trainer = L.Trainer(
        accelerator="cpu", devices=2, max_steps=3, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, callbacks=[Probe(out)],
        strategy=MegatronStrategy(**(parallel or dict(expert_model_parallel_size=2)), global_batch_size=4,
                                  micro_batch_size=2, start_method="fork"),
    )
    module = PretrainModule(str(source), SGD, lora=lora, model_overrides=model_overrides)
    trainer.fit(module, DataLoader(TokenRows(n=12, seq=16, vocab=200), batch_size=2))


def trainable(hf, r: int) -> int:
    """r x (in + out) per adapted linear: attention (fused q/k/v share one A) and every expert's
    fc1 ([gate; up] share one A) and fc2."""
    c = hf.config
    h, f = c.hidden_size, c.moe_intermediate_size
    head = getattr(c, "head_dim", None) or h // c.num_attention_heads
    q, kv = c.num_attention_heads * head, c.num_key_value_heads * head
    per_expert = r * ((h + 2 * f) + (f + h))
    return c.num_hidden_layers * (r * ((h + q + 2 * kv) + (q + h)) + c.num_experts * per_expert)


@pytest.mark.distributed
def test_expert_lora_trains_alike_at_ep1_ep2_and_ep2_tp2(tmp_path):
    source = tmp_path / "source"
    make_hf_model("qwen3_moe", source, num_experts=8)
    # Experts only (HF names), so that every change of the loss is theirs; the dense optimizer
    # is then mcore's stub.
    lora = {"lora": LoRAConfig(target_modules=["gate_proj", "up_proj", "down_proj"], rank=4, alpha=8.0)}
    optim = dataclasses.replace(SGD, lr=5.0)
    runs = {}
    for name, (devices, parallel) in {"ep1": (1, {}), **LAYOUTS}.items():
        runs[name] = fit(tmp_path, devices=devices, steps=3, gbs=4, mbs=1, config=str(source),
                         optim=optim, module_kwargs=lora, name=name,
                         dataset=TokenRows(n=4, seq=16, vocab=200), **parallel)  # one batch, repeated
    assert runs["ep1"][0] - runs["ep1"][-1] > 1e-2, runs["ep1"]
    for name in LAYOUTS:
        for got, want in zip(runs[name], runs["ep1"]):
            assert abs(got - want) <= 1e-5 * want, (name, runs[name], runs["ep1"])


@pytest.mark.distributed
def test_expert_lora_at_ep2_exports_merged_like_peft_merge_and_unload(tmp_path):
    source = tmp_path / "source"
    hf = make_hf_model("qwen3_moe", source, num_experts=8)
    fit_at_ep2(source, LoRAConfig(target_modules="all-linear", rank=4, alpha=8.0), tmp_path)

    facts = json.loads((tmp_path / "facts.json").read_text())
    assert facts["base_unchanged"] and facts["trainable"] == trainable(hf, 4)
    # One A and one B per layer and expert linear, stacked over the rank's experts (not one per
    # expert: 128 experts x 48 layers would overflow Transformer Engine's multi-tensor kernels):
    # per layer linear_qkv, linear_proj, experts' linear_fc1 and linear_fc2.
    assert facts["trainable_tensors"] == hf.config.num_hidden_layers * 4 * 2
    mcore = torch.load(tmp_path / "logits.pt")
    assert (mcore - hf_logits(hf, TOKENS)).abs().max() > 1e-3, "the adapters changed nothing"

    adapter = tensors(tmp_path / "peft")
    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert sorted(config["target_parameters"]) == ["mlp.experts.down_proj", "mlp.experts.gate_up_proj"]
    assert adapter["base_model.model.model.layers.0.mlp.experts.base_layer.lora_A.weight"].shape == (8 * 4, 64)  # experts x rank
    peft_and_merged_match(source, tmp_path, mcore)


def test_expert_lora_config_errors_are_clear():
    with pytest.raises(LoRAError, match="experts=True but target_modules.*name no expert linear"):
        LoRAConfig(target_modules=["q_proj", "k_proj", "v_proj"], experts=True)
    assert LoRAConfig(target_modules=["down_proj"], experts=True).experts


@pytest.mark.distributed
def test_expert_rank_larger_than_the_expert_is_refused(tmp_path):
    source = tmp_path / "source"
    make_hf_model("qwen3_moe", source, num_experts=8)  # experts 32 wide
    with pytest.raises(Exception, match="LoRA rank 48 is larger than the expert linear"):
        fit(tmp_path, devices=1, steps=1, gbs=2, mbs=1, config=str(source),
            dataset=TokenRows(n=4, seq=16, vocab=200),
            module_kwargs={"lora": LoRAConfig(target_modules=["linear_fc2"], rank=48)})
