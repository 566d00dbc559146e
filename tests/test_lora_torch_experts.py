"""LoRA on torch's grouped experts (moe_grouped_gemm_backend='torch'): each layer's stacked expert
adapter runs as two more grouped GEMMs beside the experts' own. Against the local SequentialMLP,
whose per-expert adapters are checked against peft (test_lora_experts.py): experts-only LoRA
trains to the same losses at EP=1, EP=2 and expert-TP 2; the PEFT export loads in peft with our
logits and the merged export equals peft's merge_and_unload; the rank refusal names its keys."""

import dataclasses
import json

import lightning as L
import pytest
import torch

from hf_models import hf_logits, make_hf_model
from lightning_mcore.lora.checks import LoRAPlanError, check_lora_plan
from lightning_mcore.lora.config import LoRAConfig
from test_lora import TOKENS, peft_and_merged_match
from test_lora_experts import SGD, fit_at_ep2, trainable
from toy import TokenRows, fit, tiny_config

TORCH_EXPERTS = {"moe_grouped_gemm": True, "moe_grouped_gemm_backend": "torch"}
EXPERTS_ONLY = LoRAConfig(target_modules=["gate_proj", "up_proj", "down_proj"], rank=8, alpha=16.0)


class ExpertsReadInPlace(L.Callback):
    """After training: for each torch-experts linear, whether the grouped GEMM still reads the
    frozen experts' weights in place (they stayed back to back through the strategy's setup)."""

    def __init__(self, out) -> None:
        self.out = out

    def on_train_end(self, trainer, module):
        from lightning_mcore.model.torch_experts import TorchGroupedMLP, stacked

        in_place = [stacked(w).data_ptr() == w[0].data_ptr()
                    for chunk in module.chunks for m in chunk.modules() if isinstance(m, TorchGroupedMLP)
                    for w in ([getattr(e, n).weight for e in m.local_experts] for n in ("linear_fc1", "linear_fc2"))]
        if trainer.global_rank == 0:
            self.out.write_text(json.dumps(in_place))


@pytest.mark.distributed
def test_expert_lora_on_torch_experts_trains_as_sequential_mlp(tmp_path):
    """Also: the frozen experts are read in place (no per-GEMM copy) after the strategy's setup."""
    source = tmp_path / "source"
    make_hf_model("qwen3_moe", source, num_experts=8)
    optim = dataclasses.replace(SGD, lr=5.0, clip_grad=0.03)  # clipped: the norm counts too
    runs = {}
    for name, devices, overrides, parallel in [
            ("sequential", 1, {}, {}), ("torch", 1, TORCH_EXPERTS, {}),
            ("torch_ep2", 2, TORCH_EXPERTS, dict(expert_model_parallel_size=2)),
            ("torch_etp2", 2, TORCH_EXPERTS, dict(expert_tensor_parallel_size=2))]:
        callbacks = (ExpertsReadInPlace(tmp_path / "in_place.json"),) if name == "torch" else ()
        runs[name] = fit(tmp_path, devices=devices, steps=3, gbs=4, mbs=1, config=str(source), optim=optim,
                         module_kwargs={"lora": EXPERTS_ONLY, "model_overrides": overrides}, name=name,
                         dataset=TokenRows(n=4, seq=16, vocab=200), callbacks=callbacks, **parallel)
    in_place = json.loads((tmp_path / "in_place.json").read_text())
    assert len(in_place) >= 2 and all(in_place), in_place  # each MoE layer: fc1, fc2
    reference = runs.pop("sequential")
    assert reference[0] - reference[-1] > 1e-2, reference
    for name, losses in runs.items():
        for got, want in zip(losses, reference):
            assert abs(got - want) <= 1e-5 * want, (name, losses, reference)


@pytest.mark.distributed
def test_expert_lora_on_torch_experts_exports_peft_and_merged(tmp_path):
    source = tmp_path / "source"
    hf = make_hf_model("qwen3_moe", source, num_experts=8)
    fit_at_ep2(source, dataclasses.replace(EXPERTS_ONLY, target_modules="all-linear"), tmp_path,
               model_overrides=TORCH_EXPERTS)
    facts = json.loads((tmp_path / "facts.json").read_text())
    assert facts["base_unchanged"] and facts["trainable"] == trainable(hf, 8)
    mcore = torch.load(tmp_path / "logits.pt")
    assert (mcore - hf_logits(hf, TOKENS)).abs().max() > 1e-3, "the adapters changed nothing"
    peft_and_merged_match(source, tmp_path, mcore)


def test_rank_must_suit_the_grouped_gemm():
    model = tiny_config(num_moe_experts=4, moe_ffn_hidden_size=32, **TORCH_EXPERTS)
    with pytest.raises(LoRAPlanError, match="LoRA rank 4 on torch's grouped experts.*use lora.rank 8") as info:
        check_lora_plan(LoRAConfig(rank=4, experts=True), model)
    assert info.value.lora == ("rank",) and info.value.fields == ("moe_grouped_gemm_backend",)
    check_lora_plan(LoRAConfig(rank=8, experts=True), model)  # on CPU too: no TE needed
    check_lora_plan(LoRAConfig(rank=4, experts=False), model)  # experts frozen: any rank
    te_experts = dataclasses.replace(model, moe_grouped_gemm_backend="te")
    with pytest.raises(LoRAPlanError, match="needs torch's grouped experts.*or Transformer Engine's"):
        check_lora_plan(LoRAConfig(rank=4, experts=True), te_experts, uses_te=False)
    check_lora_plan(LoRAConfig(rank=4, experts=True), te_experts, uses_te=True)
