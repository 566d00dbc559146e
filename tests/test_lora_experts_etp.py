"""Issue 19: LoRA on MoE routed experts with expert tensor parallelism (expert-TP 2). Each
expert's adapter shards like its linears (fc1: B over expert-TP, fc2: A), the replicated factor's
gradient is summed over expert-TP: experts-only LoRA trains as at one rank, at TP=2+SP with
expert-TP 2 and at EP=2 x expert-TP 2; the PEFT export gathers the shards and loads in peft with
our logits, the merged one equals peft's merge_and_unload."""

import dataclasses
import json

import pytest
import torch

from hf_models import hf_logits, make_hf_model
from lightning_mcore.model.lora import LoRAConfig
from test_lora import TOKENS, peft_and_merged_match
from test_lora_experts import SGD, fit_at_ep2, trainable
from toy import TokenRows, fit

ETP2 = dict(tensor_model_parallel_size=2, sequence_parallel=True, expert_tensor_parallel_size=2)
LAYOUTS = {"tp2_sp_etp2": (2, ETP2), "ep2_etp2": (4, dict(ETP2, expert_model_parallel_size=2))}
EXPERTS_ONLY = LoRAConfig(target_modules=["gate_proj", "up_proj", "down_proj"], rank=4, alpha=8.0)


@pytest.mark.distributed
def test_expert_lora_trains_alike_with_expert_tensor_parallelism(tmp_path):
    source = tmp_path / "source"
    make_hf_model("qwen3_moe", source, num_experts=8)
    optim = dataclasses.replace(SGD, lr=5.0)  # experts only: every change of the loss is theirs
    runs = {}
    for name, (devices, parallel) in {"ep1": (1, {}), **LAYOUTS}.items():
        runs[name] = fit(tmp_path, devices=devices, steps=3, gbs=4, mbs=1, config=str(source),
                         optim=optim, module_kwargs={"lora": EXPERTS_ONLY}, name=name,
                         dataset=TokenRows(n=4, seq=16, vocab=200), **parallel)  # one batch, repeated
    assert runs["ep1"][0] - runs["ep1"][-1] > 1e-2, runs["ep1"]
    for name in LAYOUTS:
        for got, want in zip(runs[name], runs["ep1"]):
            assert abs(got - want) <= 1e-5 * want, (name, runs[name], runs["ep1"])


@pytest.mark.distributed
def test_expert_lora_at_expert_tp2_exports_peft_and_merged(tmp_path):
    source = tmp_path / "source"
    hf = make_hf_model("qwen3_moe", source, num_experts=8)
    fit_at_ep2(source, dataclasses.replace(EXPERTS_ONLY, target_modules="all-linear"), tmp_path, **ETP2)

    facts = json.loads((tmp_path / "facts.json").read_text())
    assert facts["base_unchanged"] and facts["trainable"] == trainable(hf, 4)
    mcore = torch.load(tmp_path / "logits.pt")
    assert (mcore - hf_logits(hf, TOKENS)).abs().max() > 1e-3, "the adapters changed nothing"
    peft_and_merged_match(source, tmp_path, mcore)
