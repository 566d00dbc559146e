"""Issue 19, acceptance 4 on GPU: LoRA on grouped-GEMM experts, Transformer Engine's
(TEGroupedMLP) and torch's (TorchGroupedMLP, moe_grouped_gemm_backend='torch'), trains like LoRA on
the SequentialMLP experts (same adapter names, init and updates; bf16 logits within bf16 rounding
of each other), and peft on each export agrees with our logits. EP=2 in bf16, one torchrun launch
(gpu_lora_experts_script.py). Needs 2 GPUs and Transformer Engine; skipped otherwise."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch
from transformers import AutoModelForCausalLM

from hf_models import bf16_tolerance, hf_logits, make_hf_model
from lightning_mcore.verify import relative_diff

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
              pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is None, reason="needs TE")]

CASES = [{"name": "grouped", "overrides": {"moe_grouped_gemm": True, "moe_grouped_gemm_backend": "te"}},
         {"name": "torch", "overrides": {"moe_grouped_gemm": True, "moe_grouped_gemm_backend": "torch"}},
         {"name": "sequential", "overrides": {"moe_grouped_gemm": False}}]


def run(root: Path, accelerator: str, precision: str) -> None:
    here = Path(__file__).parent
    (root / "cases.json").write_text(json.dumps(CASES))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(here), os.environ.get("PYTHONPATH", "")])}
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                    str(here / "gpu_lora_experts_script.py"), accelerator, precision, str(root)],
                   env=env, check=True)


def test_grouped_gemm_expert_lora_trains_like_sequential_and_exports_to_peft(tmp_path):
    from peft import PeftModel

    hf = make_hf_model("qwen3_moe", tmp_path / "source")
    tokens = torch.randint(0, hf.config.vocab_size, (4, 33), generator=torch.Generator().manual_seed(1))
    torch.save(tokens, tmp_path / "tokens.pt")
    run(tmp_path, "gpu", "bf16-mixed")
    logits = {c["name"]: torch.load(tmp_path / c["name"] / "logits.pt") for c in CASES}
    facts = {c["name"]: json.loads((tmp_path / c["name"] / "facts.json").read_text()) for c in CASES}
    assert {n: f["experts"] for n, f in facts.items()} == {
        "grouped": ["TEGroupedMLP"], "torch": ["TorchGroupedMLP"], "sequential": ["SequentialMLP"]}, facts
    assert len({f["trainable"] for f in facts.values()}) == 1, facts
    probe = tokens[:2, :-1]
    base = hf_logits(hf, probe)
    tolerance = bf16_tolerance(hf, probe)
    adapters = {n: safetensors.torch.load_file(tmp_path / n / "peft" / "adapter_model.safetensors") for n in facts}
    experts = [k for k in adapters["sequential"] if ".experts." in k and "lora_B" in k]
    report = {"tolerance": tolerance, "trainable": facts["sequential"]["trainable"]}
    for name in ("grouped", "torch"):
        moved = relative_diff(logits[name], base)
        assert moved > 1e-2, f"{name}: the adapters changed nothing ({moved})"
        # Each expert's trained adapter is the same on both paths up to bf16 rounding; rows given
        # to the wrong expert would make them differ by their whole size.
        assert experts and adapters[name].keys() == adapters["sequential"].keys()
        for key in experts:
            g, s = adapters[name][key].float(), adapters["sequential"][key].float()
            assert s.norm() > 0 and (g - s).norm() <= 0.05 * s.norm(), (name, key, (g - s).norm() / s.norm())
        peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp_path / "source"),
                                               tmp_path / name / "peft")
        report[name] = {"moved": moved, "vs_sequential": relative_diff(logits[name], logits["sequential"]),
                        "vs_peft": relative_diff(logits[name], hf_logits(peft_model.eval(), probe))}
    print(json.dumps(report))
    for name in ("grouped", "torch"):
        assert report[name]["vs_sequential"] <= tolerance and report[name]["vs_peft"] <= tolerance, report
