"""benchmarks/hf_fsdp2.py, the HF + FSDP2 baseline of issue 47: two gloo ranks of it (fully_shard per
layer, micro batches, the global token count) train as one process of plain transformers (eager
attention, eager experts; + peft for LoRA) with torch's AdamW over the whole global batch, the loss
written out by hand; and its LoRA trains the adapters only, the experts' included."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hf_fsdp2_masked import THEN, MaskedRows
from readme import free_port

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))  # the benchmark scripts import each other by name
import hf_baseline  # noqa: E402

SEQ, GBS, STEPS, LR = 32, 4, 2, 1e-3


# 2 rows per rank; in micro batches of 1, gradients are reduce-scattered twice per step
RUNS = {"llama": ["--shape", "tiny-llama", "--mbs", "1"],
        "qwen3-moe": ["--shape", "tiny-qwen3-moe", "--mbs", "1"],
        "lora": ["--shape", "tiny-qwen3-moe", "--mbs", "2", "--lora-rank", "4", "--ac"]}


@pytest.fixture(scope="module")
def fsdp2_runs(tmp_path_factory) -> dict:
    """hf_fsdp2.main for each of RUNS on `world` gloo ranks (tests/hf_fsdp2_masked.py: MaskedRows
    as its data), the runs one after another in the same two fresh interpreters; rank 0's dump
    of each, by name."""
    tmp, world = tmp_path_factory.mktemp("fsdp2"), 2
    argv = []
    for name, args in RUNS.items():
        argv += [*([THEN] if argv else []), str(free_port()), *args, "--seq", str(SEQ),
                 "--gbs", str(GBS), "--steps", str(STEPS), "--warmup", "1", "--lr", str(LR), "--precision", "fp32",
                 "--dump", str(tmp / f"{name}.pt")]
    script = Path(__file__).parent / "hf_fsdp2_masked.py"
    ranks = [subprocess.Popen([sys.executable, str(script), *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env={**os.environ, "RANK": str(r), "LOCAL_RANK": str(r),
                                              "WORLD_SIZE": str(world), "MASTER_ADDR": "localhost",
                                              "PYTHONWARNINGS": "ignore", "CUDA_VISIBLE_DEVICES": ""})
             for r in range(world)]
    try:
        outputs = [rank.communicate(timeout=600) for rank in ranks]
    finally:  # a rank that failed leaves the other waiting in a collective
        for rank in ranks:
            rank.kill()
    for rank, (out, err) in zip(ranks, outputs):
        assert rank.returncode == 0, f"rank exited {rank.returncode}:\n{out}\n{err[-3000:]}"
    assert outputs[0][0].count('"impl": "hf-fsdp2"') == len(RUNS)  # rank 0's RESULT line of each run
    return {name: torch.load(tmp / f"{name}.pt") for name in RUNS}


def reference(shape: dict, init: dict, lora_rank=None, data=None) -> tuple[list[float], dict, dict]:
    """One process, transformers' plainest code: eager attention with its mask, a loop over the
    experts; each step one forward over the whole global batch of `data` (default MaskedRows), the
    masked mean by hand, clipping at 1.0, torch's AdamW (weight decay 0.01 on matrices). Returns the
    losses, the first step's gradients and the final weights."""
    model = hf_baseline.build_model(shape, SEQ, "fp32", "cpu", experts="eager", attn="eager")
    if lora_rank:
        from peft import LoraConfig, get_peft_model

        experts = {"target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"],
                   "target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]}
        dense = {"target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}
        model = get_peft_model(model, LoraConfig(r=lora_rank, lora_alpha=2 * lora_rank, task_type="CAUSAL_LM",
                                                 **(experts if shape.get("num_moe_experts") else dense)))
    model.load_state_dict(init, strict=True)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW([{"params": [p for p in trainable if p.ndim >= 2], "weight_decay": 0.01},
                             {"params": [p for p in trainable if p.ndim < 2], "weight_decay": 0.0}],
                            lr=LR, betas=(0.9, 0.95), foreach=False)
    data = MaskedRows(GBS * (STEPS + 2), SEQ, shape["vocab_size"]) if data is None else data
    losses, first_grads = [], None
    for step in range(STEPS):
        rows = [data[i] for i in range(step * GBS, (step + 1) * GBS)]
        tokens, labels, mask = (torch.stack([r[k] for r in rows]) for k in ("tokens", "labels", "loss_mask"))
        logits = model(input_ids=tokens, position_ids=torch.arange(SEQ).expand(GBS, SEQ)).logits
        token_loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="none")
        loss = (token_loss * mask.flatten()).sum() / mask.sum()
        loss.backward()
        if first_grads is None:
            first_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, first_grads, {n: p.detach().clone() for n, p in model.named_parameters()}


def assert_matches(got: dict, shape: dict, lora_rank=None, data=None) -> dict:
    losses, grads, end = reference(shape, got["init"], lora_rank, data)
    assert got["losses"] == pytest.approx(losses, rel=1e-5)
    assert got["first_grads"].keys() == grads.keys()
    for name, want in grads.items():
        torch.testing.assert_close(got["first_grads"][name], want, rtol=1e-4, atol=1e-6 * want.abs().max().item(),
                                   msg=name)
    # Adam moves each weight by about lr a step, by less only where eps weighs against the gradient,
    # and there a gradient's rounding (the 1e-9 above) can move it by ~1e-5: 1% of the 2 steps' move
    assert got["end"].keys() == end.keys()
    for name, want in end.items():
        torch.testing.assert_close(got["end"][name], want, rtol=0, atol=0.01 * STEPS * LR, msg=name)
    return end


def assert_initialised(init: dict) -> None:
    """Materialised from the meta device: norms 1, matrices normal(0, 0.02), LoRA's B zero."""
    for name, w in init.items():
        if "lora_B" in name:
            assert not w.any(), name
        elif "lora_A" not in name and w.ndim == 1:
            assert torch.equal(w, torch.ones_like(w)), name
        elif "lora_A" not in name and w.numel() > 4000:
            assert abs(w.std().item() - 0.02) < 0.002 and abs(w.mean().item()) < 0.002, name


@pytest.mark.distributed
@pytest.mark.parametrize("name", ["llama", "qwen3-moe"])
def test_two_fsdp2_ranks_train_as_one_process(name, fsdp2_runs):
    got = fsdp2_runs[name]
    assert_initialised(got["init"])
    end = assert_matches(got, hf_baseline.SELFTEST_SHAPES[name])
    assert all(not torch.equal(end[n], w) for n, w in got["init"].items())  # every weight trained


@pytest.mark.distributed
def test_lora_trains_only_the_adapters_experts_included(fsdp2_runs):
    shape = hf_baseline.SELFTEST_SHAPES["qwen3-moe"]
    got = fsdp2_runs["lora"]
    assert_initialised(got["init"])
    end = assert_matches(got, shape, lora_rank=4)
    adapters = {n for n in end if "lora_" in n}
    assert set(got["first_grads"]) == adapters  # nothing else is trainable
    assert {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in adapters} >= {"q_proj", "o_proj", "experts", "base_layer"}
    # each expert adapter of rank 4 per expert: A [E * 4, in]
    experts = [n for n in adapters if "experts" in n and "lora_A" in n]
    assert len(experts) == 2 * shape["num_layers"]
    assert all(end[n].shape[0] == shape["num_moe_experts"] * 4 for n in experts)
    for n, w in got["init"].items():
        assert torch.equal(end[n], w) != (n in adapters), n  # adapters moved, the base did not
