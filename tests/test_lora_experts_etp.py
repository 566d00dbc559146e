"""Issue 19: LoRA on MoE routed experts with expert tensor parallelism (expert-TP 2). Each
expert's adapter shards like its linears (fc1: B over expert-TP, fc2: A), the replicated factor's
gradient is summed over expert-TP and the gradient norm counts each expert once: experts-only
LoRA (clipped) trains as at one rank at TP=2+SP with expert-TP 2 (alltoall and allgather
dispatchers), at EP=2 x expert-TP 2, at TP=1 with expert-TP 2 and with the distributed optimizer;
the PEFT export gathers the shards and loads in peft with our logits, the merged one equals
peft's merge_and_unload; an expert-TP 2 checkpoint reshards to one rank."""

import dataclasses
import json

import pytest
import torch

from hf_models import hf_logits, make_hf_model
from lightning_mcore.lora.config import LoRAConfig
from test_lora import TOKENS, peft_and_merged_match
from test_lora_experts import SGD, fit_at_ep2, trainable
from test_lora_experts_resume import adapters, run
from toy import TokenRows, fit

ETP2 = dict(tensor_model_parallel_size=2, sequence_parallel=True, expert_tensor_parallel_size=2)
LAYOUTS = {"tp2_sp_etp2": (2, ETP2), "ep2_etp2": (4, dict(ETP2, expert_model_parallel_size=2)),
           "etp2": (2, dict(expert_tensor_parallel_size=2)),  # TP=1: expert-TP ranks are not TP ranks
           "tp2_sp_etp1": (2, dict(ETP2, expert_tensor_parallel_size=1))}  # expert replicas on TP rank 1
EXPERTS_ONLY = LoRAConfig(target_modules=["gate_proj", "up_proj", "down_proj"], rank=4, alpha=8.0)


@pytest.mark.distributed
def test_expert_lora_trains_alike_with_expert_tensor_parallelism(tmp_path):
    source = tmp_path / "source"
    make_hf_model("qwen3_moe", source, num_experts=8)
    # Experts only: every change of the loss is theirs. Clipping below the gradient norm (about
    # 0.05 here): the update depends on the norm too, which counts each expert's factors once.
    optim = dataclasses.replace(SGD, lr=5.0, clip_grad=0.03)
    allgather = {"model_overrides": {"moe_token_dispatcher_type": "allgather"}}  # default: alltoall
    runs = {}
    for name, (devices, parallel) in {"ep1": (1, {}), **LAYOUTS, "allgather": (2, ETP2)}.items():
        runs[name] = fit(tmp_path, devices=devices, steps=3, gbs=4, mbs=1, config=str(source), optim=optim,
                         module_kwargs={"lora": EXPERTS_ONLY, **(allgather if name == "allgather" else {})},
                         name=name, dataset=TokenRows(n=4, seq=16, vocab=200), **parallel)  # one batch, repeated
    assert runs["ep1"][0] - runs["ep1"][-1] > 1e-2, runs["ep1"]
    for name in [*LAYOUTS, "allgather"]:
        for got, want in zip(runs[name], runs["ep1"]):
            assert abs(got - want) <= 1e-5 * want, (name, runs[name], runs["ep1"])


@pytest.mark.distributed
def test_expert_tp2_sums_fit_the_distributed_optimizer(tmp_path):
    """Expert-data-parallel 2 x expert-TP 2 with mcore's distributed optimizer (Adam: the only
    one it shards): the expert-TP sum runs on the reduce-scattered gradient buffer, as at one rank."""
    make_hf_model("qwen3_moe", tmp_path / "source", num_experts=8)
    optim = dataclasses.replace(SGD, optimizer="adam", lr=2e-2)
    runs = [fit(tmp_path, devices=devices, steps=3, gbs=4, mbs=1, config=str(tmp_path / "source"),
                optim=optim, module_kwargs={"lora": EXPERTS_ONLY}, name=f"run{devices}",
                dataset=TokenRows(n=4, seq=16, vocab=200), **parallel)
            for devices, parallel in ((1, {}), (4, dict(expert_tensor_parallel_size=2, use_distributed_optimizer=True)))]
    assert runs[0][0] - runs[0][-1] > 1e-2, runs[0]
    for got, want in zip(runs[1], runs[0]):
        assert abs(got - want) <= 1e-5 * want, runs

@pytest.mark.distributed
def test_expert_lora_at_expert_tp2_exports_peft_and_merged(tmp_path):
    source = tmp_path / "source"
    hf = make_hf_model("qwen3_moe", source, num_experts=8)
    # TP=1: the export must gather expert shards over expert-TP, not over TP
    fit_at_ep2(source, dataclasses.replace(EXPERTS_ONLY, target_modules="all-linear"), tmp_path,
               expert_tensor_parallel_size=2)

    facts = json.loads((tmp_path / "facts.json").read_text())
    assert facts["base_unchanged"] and facts["trainable"] == trainable(hf, 4)
    mcore = torch.load(tmp_path / "logits.pt")
    assert (mcore - hf_logits(hf, TOKENS)).abs().max() > 1e-3, "the adapters changed nothing"
    peft_and_merged_match(source, tmp_path, mcore)


@pytest.mark.distributed
def test_expert_tp2_checkpoint_reshards_to_one_rank(tmp_path):
    """One rank loads every expert's A/B as saved at expert-TP 2 (fc1's B in [gate; up] rows,
    fc2's A joined along its input; a copy: bitwise) and continues like the expert-TP 2 run
    (another reduction order: within 1e-5), Adam's moments included."""
    make_hf_model("qwen3_moe", tmp_path / "source")
    straight = run(tmp_path, "straight", 2, **ETP2)
    run(tmp_path, "first", 2, stop=2, **ETP2)
    resumed = run(tmp_path, "one", 1, ckpt_path=str(tmp_path / "first-ckpts" / "epoch=0-step=2.ckpt"))
    saved, loaded = adapters(tmp_path, "first", "end", 2), adapters(tmp_path, "one", "init", 1)
    assert saved and loaded.keys() == saved.keys()
    for key, tensor in saved.items():
        assert torch.equal(loaded[key], tensor), key  # NaN where a rank's shard was missing
    assert len(resumed) == 2
    for got, want in zip(resumed, straight[2:]):
        assert abs(got - want) <= 1e-5 * want, (resumed, straight)
