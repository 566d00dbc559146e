"""Acceptance for the DeepSeek family (DeepSeek-V3 and V2, models/deepseek_v3.py, deepseek_v2.py):
multi-latent attention with q_lora_rank on and off, YaRN, rope_interleave on and off, a dense
first layer, shared experts, the sigmoid router with its bias, group-limited top-k and the
routed scaling factor, against transformers' own classes (tiny random models, CPU, fp32)."""

import json

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM

from hf_models import hf_config_dict, hf_logits, make_hf_model
from lightning_mcore import MegatronStrategy, OptimizerSettings, PretrainModule, models
from lightning_mcore.model.lora import LoRAConfig
from test_hf_roundtrip import SaveLogitsAndExport, tensors
from test_lora import TOKENS, Probe
from toy import TokenRows, assemble, fit

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


DENSE = dict(num_moe_experts=None, moe_layer_freq=1, moe_shared_expert_intermediate_size=None,
             moe_router_score_function="softmax", moe_router_enable_expert_bias=False,
             moe_router_num_groups=None, moe_router_group_topk=None)
TRAINING = {  # name: (changes to the tiny model's config, TP=2 options, optimizer)
    "moe_sp": ({}, dict(sequence_parallel=True), OptimizerSettings(lr=1e-3)),
    # SGD: trained weights differ by lr x the gradients' difference (Adam would magnify the
    # float noise of a near-zero gradient: one embedding element here).
    "dense_no_sp": (DENSE, {}, OptimizerSettings(lr=0.1, optimizer="sgd")),
}


@pytest.mark.distributed
@pytest.mark.parametrize("case", list(TRAINING))
def test_training_at_tp2_follows_one_process(case, tmp_path):
    """3 steps from the same layout-invariant init: losses, trained weights and the routing bias
    (which mcore moves by token counts, outside the optimizer) equal the one-process run's."""
    changes, sp, optim = TRAINING[case]
    cfg, _ = models.gpt_config_from_hf(hf_config_dict("deepseek_v3"), seq_length=32,
                                       transformer_impl="local", **changes)
    runs = {}
    for name, devices, parallel in (("ref", 1, {}), ("tp2", 2, dict(tensor_model_parallel_size=2, **sp))):
        losses = fit(tmp_path, devices=devices, config=cfg, optim=optim, dump_weights=True, name=name,
                     **parallel)
        runs[name] = (losses, assemble(sorted(tmp_path.glob(f"{name}.init*.pt"))),
                      assemble(sorted(tmp_path.glob(f"{name}.end*.pt"))))
    (ref_losses, ref_init, ref_end), (losses, init, end) = runs["ref"], runs["tp2"]

    assert any("linear_kv_down_proj" in k for k in ref_end), sorted(ref_end)
    assert any(k.endswith("router.expert_bias") for k in ref_end) == (case == "moe_sp")
    assert init.keys() == ref_init.keys()
    for key, full in ref_init.items():
        assert torch.equal(init[key], full), f"initial {key} differs at TP=2"
    assert len(losses) == len(ref_losses) == 3
    for step, (got, want) in enumerate(zip(losses, ref_losses)):
        assert abs(got - want) <= 1e-5 * abs(want), f"step {step}: {got} vs {want}"
    for key, full in ref_end.items():
        assert not torch.equal(full, ref_init[key]), f"{key} was not trained"
        torch.testing.assert_close(end[key], full, rtol=0, atol=1e-5, msg=key)


LORA_TARGETS = {  # the MLA linears by HF name, and linear_q_proj by its mcore name (q_proj would
    # name GQA's fused linear_qkv)
    "deepseek_v3": ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"],
    "deepseek_v3_noq": ["linear_q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"],
}


def mla_lora_parameters(c, targets, r: int) -> int:
    """r x (in + out) for each adapted linear of every layer."""
    q, h = c.num_attention_heads * (c.qk_nope_head_dim + c.qk_rope_head_dim), c.hidden_size
    sizes = {"q_a_proj": (h, c.q_lora_rank), "q_b_proj": (c.q_lora_rank, q), "linear_q_proj": (h, q),
             "kv_a_proj_with_mqa": (h, c.kv_lora_rank + c.qk_rope_head_dim),
             "kv_b_proj": (c.kv_lora_rank, c.num_attention_heads * (c.qk_nope_head_dim + c.v_head_dim)),
             "o_proj": (c.num_attention_heads * c.v_head_dim, h)}
    return c.num_hidden_layers * r * sum(sum(sizes[t]) for t in targets)


@pytest.mark.distributed
@pytest.mark.parametrize("family", list(LORA_TARGETS))
def test_lora_on_attention_exports_a_peft_adapter_at_tp2(family, tmp_path):
    """Adapters on the MLA linears at TP=2 (+SP), trained 3 steps: the PEFT export loads in peft
    with the mcore model's logits, the merged export equals peft's merge, and the base model,
    the routing bias included, is untouched."""
    from peft import PeftModel

    source = tmp_path / "source"
    hf = make_hf_model(family, source)
    lora = LoRAConfig(target_modules=LORA_TARGETS[family], rank=4, alpha=8.0)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, max_steps=3, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, callbacks=[Probe(tmp_path)],
        strategy=MegatronStrategy(tensor_model_parallel_size=2, sequence_parallel=True,
                                  global_batch_size=4, micro_batch_size=2, start_method="fork"),
    )
    module = PretrainModule(str(source), OptimizerSettings(lr=2e-2, warmup_steps=0), lora=lora)
    trainer.fit(module, DataLoader(TokenRows(n=16, seq=16, vocab=200), batch_size=4))

    facts = json.loads((tmp_path / "facts.json").read_text())
    assert facts["base_unchanged"]
    assert facts["trainable"] == mla_lora_parameters(hf.config, LORA_TARGETS[family], 4)
    mcore = torch.load(tmp_path / "logits.pt")
    assert (mcore - hf_logits(hf, TOKENS)).abs().max() > 1e-3, "the adapters changed nothing"

    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(source), tmp_path / "peft")
    assert (hf_logits(peft_model.eval(), TOKENS) - mcore).abs().max().item() <= 1e-4
    merged_ref = peft_model.merge_and_unload().state_dict()
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").state_dict()
    for name, tensor in merged_ref.items():
        torch.testing.assert_close(merged[name], tensor, rtol=0, atol=1e-6, msg=name)
