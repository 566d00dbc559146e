"""Acceptance for the Gated DeltaNet hybrids, Qwen3.5 (dense and MoE, text) and Qwen3-Next:
logits equal transformers' at TP=1, TP=2 with sequence parallelism, PP=2 (linear and full
attention on both stages), EP=2 (MoE) and DP=2; the export is bit-identical."""

import pytest
import torch

from hf_models import make_hf_model

from test_hf_roundtrip import check_logits_and_export

SEQ = 24
LAYOUTS = {
    "tp1": (1, {}),
    "tp2_sp": (2, dict(tensor_model_parallel_size=2, sequence_parallel=True)),
    "pp2": (2, dict(pipeline_model_parallel_size=2)),
    "dp2": (2, {}),
    "ep2": (2, dict(expert_model_parallel_size=2)),
}
CASES = [("qwen3_5", layout) for layout in ("tp1", "tp2_sp", "pp2", "dp2")] + [
    (family, layout) for family in ("qwen3_5_moe", "qwen3_next") for layout in ("tp2_sp", "pp2", "ep2")]


@pytest.mark.distributed
@pytest.mark.parametrize("family,layout", CASES, ids=[f"{f}-{l}" for f, l in CASES])
def test_logits_and_export_match_transformers(family, layout, tmp_path):
    check_logits_and_export(family, layout, tmp_path, seq=SEQ, layouts=LAYOUTS)


@pytest.mark.distributed
def test_cached_generation_equals_transformers_greedy(tmp_path):
    """The convolution window and recurrent state of each linear-attention layer kept in the
    inference context: greedy generation with the cache equals no-cache decoding and
    transformers' `generate`, ragged prompts in one batch, at TP=1, TP=2 (sequence parallelism
    switched off for the cache) and PP=2; Qwen3-Next at EP=2."""
    from test_generation import check_cache, hf_greedy, run

    source = tmp_path / "qwen3_5"
    want = hf_greedy(make_hf_model("qwen3_5", source))
    for name, devices, parallel in (
            ("tp1", 1, {}), ("pp2", 2, dict(pipeline_model_parallel_size=2)),
            ("tp2_sp", 2, dict(tensor_model_parallel_size=2, sequence_parallel=True))):
        got = run(tmp_path, str(source), devices, name, full=False, **parallel)
        check_cache(got)
        assert got["greedy"] == want, name
    source = tmp_path / "qwen3_next"
    want = hf_greedy(make_hf_model("qwen3_next", source))
    got = run(tmp_path, str(source), 2, "next_ep2", full=False, expert_model_parallel_size=2)
    check_cache(got)
    assert got["greedy"] == want


ATTENTION = ["linear_qkv", "linear_proj", "in_proj", "out_proj"]
LORA_CASES = {  # family: (strategy layout, LoRA targets, rows per data-parallel rank)
    "qwen3_5": (dict(tensor_model_parallel_size=2, sequence_parallel=True), "all-linear", 4),
    # peft would load MLP adapters of this MoE wrong (refused; they export merged)
    "qwen3_next": (dict(expert_model_parallel_size=2), ATTENTION, 2),
}


@pytest.mark.distributed
@pytest.mark.parametrize("family", list(LORA_CASES))
def test_lora_exports_a_peft_adapter_with_equal_logits(family, tmp_path):
    """LoRA on the linear-attention in_proj/out_proj and the attention (and Qwen3.5's MLP),
    trained a few steps; the PEFT export loads into transformers' model with our logits."""
    written = check_peft_export(family, *LORA_CASES[family], tmp_path)
    assert {"out_proj", "o_proj", "q_proj"} <= written, written
    assert {"in_proj_qkv", "in_proj_z"} <= written or {"in_proj_qkvz", "in_proj_ba"} <= written


def check_peft_export(family: str, parallel: dict, targets, rows: int, tmp_path) -> set:
    """Train LoRA on `targets` a few steps at `parallel` (`rows` per data-parallel rank); the
    PEFT export loads into transformers' model with our logits. Returns its target_modules."""
    import json

    import lightning as L
    from peft import PeftModel
    from torch.utils.data import DataLoader
    from transformers import AutoModelForCausalLM

    from hf_models import hf_logits
    from lightning_mcore import MegatronStrategy, OptimizerSettings, PretrainModule
    from lightning_mcore.lora.config import LoRAConfig
    from test_family_gemma3 import LoRAProbe, tokens
    from toy import TokenRows

    source = tmp_path / "source"
    hf = make_hf_model(family, source)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, max_steps=3, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[LoRAProbe(tmp_path)],
        strategy=MegatronStrategy(global_batch_size=4, micro_batch_size=2, start_method="fork", **parallel))
    module = PretrainModule(str(source), OptimizerSettings(lr=2e-2, warmup_steps=0),
                            model_overrides={"seq_length": 32},
                            lora=LoRAConfig(target_modules=targets, rank=4, alpha=8.0))
    trainer.fit(module, DataLoader(TokenRows(n=16, seq=32, vocab=200), batch_size=rows))

    ours = torch.load(tmp_path / "logits.pt")
    assert (ours - hf_logits(hf, tokens())).abs().max() > 1e-3, "the adapters changed nothing"
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(source), tmp_path / "peft")
    assert (hf_logits(peft_model.eval(), tokens()) - ours).abs().max().item() <= 1e-4
    return set(json.loads((tmp_path / "peft" / "adapter_config.json").read_text())["target_modules"])


@pytest.mark.distributed
def test_training_is_layout_invariant_and_resumes_at_another_layout(tmp_path):
    check_layout_invariant_training("qwen3_5", dict(tensor_model_parallel_size=2, sequence_parallel=True),
                                    tmp_path)


def check_layout_invariant_training(family: str, tp2: dict, tmp_path, reference=(1, {}),
                                    resume_at=(("tp1", 1, {}), ("pp2", 2, dict(pipeline_model_parallel_size=2))),
                                    **changes) -> None:
    """From scratch (layout-invariant initial weights, A_log and biases included): 6 steps at
    `tp2` (a 2-rank layout) have the losses of 6 at `reference` (devices, layout; one process by
    default); the `tp2` run's checkpoint after 3 resumes at each of `resume_at` and continues with
    the same losses. `changes`: GPTConfig fields replaced."""
    import dataclasses

    from hf_models import hf_config_dict
    from lightning_mcore.models import gpt_config_from_hf
    from toy import fit_with_checkpoints as run

    cfg, _ = gpt_config_from_hf(hf_config_dict(family))
    cfg = dataclasses.replace(cfg, vocab_size=512, seq_length=32, **changes)  # the sample tokenizer's vocab
    straight = run(tmp_path, "straight", 2, config=cfg, **tp2)
    assert straight[-1] < straight[0]
    one = run(tmp_path, "one", reference[0], config=cfg, **reference[1])
    for got, want in zip(one, straight):
        assert abs(got - want) <= 1e-5 * abs(want), (one, straight)
    saved = str(tmp_path / "straight-ckpts" / "epoch=0-step=3.ckpt")
    for name, devices, layout in resume_at:
        resumed = run(tmp_path, name, devices, ckpt_path=saved, config=cfg, **layout)
        for got, want in zip(resumed, straight[3:]):
            assert abs(got - want) <= 1e-5 * abs(want), (name, resumed, straight[3:])


@pytest.mark.distributed
def test_packed_batch_equals_one_sample_per_row(tmp_path):
    """Each packed sample starts its own convolution window and recurrent state (and attends
    within itself), at TP=1 and TP=2 + SP: one SGD step gives equal losses and gradients."""
    from hf_models import hf_config_dict
    from lightning_mcore.models import gpt_config_from_hf
    from test_family_gemma3 import check_packed_batch_equals_one_sample_per_row

    cfg, _ = gpt_config_from_hf(hf_config_dict("qwen3_5"))
    check_packed_batch_equals_one_sample_per_row(tmp_path, cfg)


def add_mtp_layer(source) -> None:
    """What the published Qwen3-Next / Qwen3.5 checkpoints add: a multi-token-prediction layer
    (mtp.*, in bf16 beside an fp32 model here, so a conversion would show) and its config field."""
    import json

    from safetensors.torch import load_file, save_file

    weights = load_file(source / "model.safetensors")
    gen = torch.Generator().manual_seed(3)
    weights.update({name: torch.randn(shape, generator=gen).to(torch.bfloat16) for name, shape in (
        ("mtp.fc.weight", (64, 128)), ("mtp.norm.weight", (64,)),
        ("mtp.layers.0.self_attn.q_proj.weight", (128, 64)),
        ("mtp.layers.0.mlp.experts.0.down_proj.weight", (64, 32)))})
    save_file(weights, source / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps(config | {"mtp_num_hidden_layers": 1}))


@pytest.mark.distributed
def test_published_mtp_layer_is_carried_through_to_the_export(tmp_path):
    """A checkpoint with its MTP layer loads (nothing of it is dropped silently: it is kept) and
    the export holds the MTP tensors bit for bit, at TP=2 + SP."""
    check_logits_and_export("qwen3_next", "tp2_sp", tmp_path, seq=SEQ, layouts=LAYOUTS,
                            prepare=add_mtp_layer)


REFUSED = [  # (tiny model, config.json changes, the field the error must name)
    ("qwen3_5", dict(hidden_act="gelu"), "hidden_act"),
    ("qwen3_5", dict(attention_bias=True), "attention_bias"),
    ("qwen3_5", dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4,
                                      "partial_rotary_factor": 0.25}), "rope_parameters"),
    ("qwen3_5", dict(linear_num_value_heads=3), "linear_num_value_heads"),
    ("qwen3_5", dict(layer_types=["linear_attention", "sliding_attention"] * 2), "layer_types"),
    ("qwen3_next", dict(num_experts=0), "num_experts"),
]


@pytest.mark.parametrize("name,changes,field", REFUSED, ids=[f"{n}-{f}" for n, _, f in REFUSED])
def test_unsupported_variants_are_refused_by_name(name, changes, field):
    from hf_models import hf_config_dict
    from lightning_mcore.hf.config import HFCheckpointError
    from lightning_mcore.models import gpt_config_from_hf

    with pytest.raises(HFCheckpointError, match=rf"\b{field}\b"):
        gpt_config_from_hf({**hf_config_dict(name), **changes})


@pytest.mark.distributed
def test_expert_lora_exports_merged_with_equal_logits(tmp_path):
    """LoRA on every linear of Qwen3-Next, routed experts and linear attention included, at EP=2:
    the merged export (what these families take for MLP adapters) gives our logits in
    transformers."""
    base, trained = check_merged_lora("qwen3_next", tmp_path)
    for part in ("mlp.experts.gate_up_proj", "linear_attn.in_proj_qkvz", "linear_attn.out_proj"):
        name = next(n for n in base if part in n)
        assert (trained[name] - base[name]).abs().max() > 1e-5, name


def check_merged_lora(family: str, tmp_path):
    """3 steps of LoRA on every linear, experts included, at EP=2; the merged export's logits in
    transformers equal ours (and differ from the base's). Returns the base and merged state dicts."""
    import lightning as L
    from torch.utils.data import DataLoader
    from transformers import AutoModelForCausalLM

    from hf_models import hf_logits
    from lightning_mcore import MegatronStrategy, OptimizerSettings, PretrainModule
    from lightning_mcore.lora.config import LoRAConfig
    from test_family_gemma3 import tokens
    from toy import TokenRows

    class MergedProbe(L.Callback):
        def on_train_end(self, trainer, pl_module):
            logits = pl_module.forward_logits(tokens())
            pl_module.save_hf_checkpoint(tmp_path / "merged", mode="merged")
            if trainer.global_rank == 0:
                torch.save(logits, tmp_path / "logits.pt")

    source = tmp_path / "source"
    hf = make_hf_model(family, source)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, max_steps=3, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[MergedProbe()],
        strategy=MegatronStrategy(expert_model_parallel_size=2, global_batch_size=4, micro_batch_size=2,
                                  start_method="fork"))
    module = PretrainModule(str(source), OptimizerSettings(lr=2e-2, warmup_steps=0),
                            model_overrides={"seq_length": 32},
                            lora=LoRAConfig(target_modules="all-linear", rank=4, alpha=8.0, experts=True))
    trainer.fit(module, DataLoader(TokenRows(n=16, seq=32, vocab=200), batch_size=2))

    ours = torch.load(tmp_path / "logits.pt")
    assert (ours - hf_logits(hf, tokens())).abs().max() > 1e-3, "the adapters changed nothing"
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    assert (hf_logits(merged, tokens()) - ours).abs().max().item() <= 1e-4
    return hf.state_dict(), merged.state_dict()


@pytest.mark.parametrize("name", ["qwen3_5", "qwen3_5_moe", "qwen3_next"])
def test_config_round_trips_through_transformers(name):
    """config.json -> GPTConfig -> transformers' config class -> GPTConfig is the same model (what
    an export of a model built from scratch writes)."""
    from hf_models import hf_config_dict
    from lightning_mcore.models import gpt_config_from_hf, hf_config_dict_from_gpt

    cfg, family = gpt_config_from_hf(hf_config_dict(name), seq_length=SEQ)
    assert (cfg.rotary_percent, cfg.attention_output_gate, cfg.zero_centered_norm) == (0.25, True, True)
    assert [cfg.is_linear_attention_layer(i) for i in range(4)] == [True, False, True, False]
    again, _ = gpt_config_from_hf(hf_config_dict_from_gpt(cfg, family), seq_length=SEQ)
    assert again == cfg
