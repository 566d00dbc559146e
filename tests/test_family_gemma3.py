"""Acceptance for Gemma 3 (text): logits equal transformers' at TP=1, TP=2 with sequence
parallelism and PP=2, for inputs 4x the sliding window; the export is bit-identical; a TP=2
training step equals TP=1; a packed batch equals its samples one per row; LoRA exports a PEFT
adapter that peft loads with equal logits; what we do not compute is refused by name.

The tiny model (tests/hf_models.py "gemma3") has local and global layers on both pipeline
stages, each with its own RoPE base, head_dim != hidden/heads and query_pre_attn_scalar !=
head_dim, random (1+w) norms, tied embeddings.
"""

import dataclasses
import json

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM

from hf_models import hf_config_dict, hf_logits, make_hf_model
from lightning_mcore import MegatronStrategy, OptimizerSettings, PretrainModule
from lightning_mcore.data.packing import build_row, pack
from lightning_mcore.hf.config import HFCheckpointError
from lightning_mcore.lora.config import LoRAConfig
from lightning_mcore.models import gpt_config_from_hf, hf_config_dict_from_gpt
from lightning_mcore.objectives.sft import SFTModule
from test_hf_roundtrip import check_logits_and_export
from test_sft_packing import LENGTHS, samples
from test_sft_packing import SEQ as PACKED_SEQ
from test_sft_packing import run as run_sft
from toy import TokenRows, assemble, fit

SEQ = 32  # 4x the tiny model's sliding window (8)
LAYOUTS = {
    "tp1": (1, {}),
    "tp2_sp": (2, dict(tensor_model_parallel_size=2, sequence_parallel=True)),
    "pp2": (2, dict(pipeline_model_parallel_size=2)),
}


def tokens(seq: int = SEQ, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 200, (2, seq), generator=torch.Generator().manual_seed(seed))


@pytest.mark.distributed
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_logits_and_export_match_transformers(layout, tmp_path):
    check_logits_and_export("gemma3", layout, tmp_path, seq=SEQ, layouts=LAYOUTS,
                            model_overrides={"seq_length": SEQ})


@pytest.mark.distributed
def test_training_steps_at_tp2_sp_equal_tp1(tmp_path):
    """Post norms and q/k norms get whole gradients under TP + sequence parallelism. SGD: Adam's
    first steps move each weight by about +-lr whatever the size of its gradient, so a weight
    whose gradient is near zero (two of this model's k/v weights) follows the rounding noise of
    the TP reduction; SGD's update is proportional to the gradient being compared."""
    source = tmp_path / "source"
    make_hf_model("gemma3", source)
    runs = {}
    for name, devices, overrides, parallel in (
            ("tp1", 1, {}, {}),
            ("tp2_sp", 2, {}, dict(tensor_model_parallel_size=2, sequence_parallel=True))):
        losses = fit(tmp_path, devices=devices, config=str(source), dump_weights=True, name=name,
                     dataset=TokenRows(seq=SEQ, vocab=200), optim=OptimizerSettings(
                         lr=0.1, optimizer="sgd", warmup_steps=0),
                     module_kwargs={"model_overrides": {"seq_length": SEQ, **overrides}}, **parallel)
        runs[name] = losses, assemble(sorted(tmp_path.glob(f"{name}.end*.pt")))
    ref_losses, ref_trained = runs.pop("tp1")
    initial = assemble(sorted(tmp_path.glob("tp1.init*.pt")))
    post_norm = "decoder.layers.self_attention.linear_proj.post_layernorm.weight"
    assert not torch.equal(ref_trained[post_norm], initial[post_norm])
    for name, (losses, trained) in runs.items():
        for step, (got, want) in enumerate(zip(losses, ref_losses)):
            assert abs(got - want) <= 1e-5 * abs(want), f"{name} step {step}: {losses} vs {ref_losses}"
        assert trained.keys() == ref_trained.keys()
        for key, full in ref_trained.items():
            torch.testing.assert_close(trained[key], full, rtol=0, atol=1e-5, msg=f"{name} {key}")


@pytest.mark.distributed
def test_packed_batch_equals_one_sample_per_row(tmp_path):
    """Local and global RoPE restart at each packed sample and windows stay within it, at TP=1
    and TP=2 + SP (one SGD step: equal losses and equal gradients, as tests/test_sft_packing.py)."""
    cfg, _ = gpt_config_from_hf(hf_config_dict("gemma3"), seq_length=SEQ)
    check_packed_batch_equals_one_sample_per_row(tmp_path, cfg)


def check_packed_batch_equals_one_sample_per_row(tmp_path, cfg, **tp2) -> None:
    """test_sft_packing's samples packed into rows (SFT) against one per row (pretraining), at
    TP=1 and TP=2 + SP (`tp2`: more of that layout's settings): equal losses and gradients
    after one SGD step."""
    cfg = dataclasses.replace(cfg, seq_length=PACKED_SEQ, vocab_size=500)
    data = samples()
    packed = [build_row([data[i] for i in row], PACKED_SEQ, pad_id=0) for row in pack(LENGTHS, PACKED_SEQ)]
    single = [{k: v for k, v in build_row([s], PACKED_SEQ, pad_id=0).items() if k != "segment_ids"}
              for s in data]
    ref_loss, ref = run_sft(tmp_path, "reference", single, PretrainModule, config=cfg)
    for name, devices, parallel in (("packed", 1, {}), ("packed_tp2_sp", 2, dict(
            tensor_model_parallel_size=2, sequence_parallel=True, **tp2))):
        loss, got = run_sft(tmp_path, name, packed, SFTModule, devices, config=cfg, **parallel)
        assert abs(loss - ref_loss) <= 1e-5 * ref_loss, (name, loss, ref_loss)
        for key in ref:
            torch.testing.assert_close(got[key], ref[key], rtol=0, atol=1e-5, msg=f"{name} {key}")


class LoRAProbe(L.Callback):
    def __init__(self, out) -> None:
        self.out = out

    def on_train_end(self, trainer, pl_module):
        logits = pl_module.forward_logits(tokens())
        pl_module.save_hf_checkpoint(self.out / "peft", mode="peft")
        if trainer.global_rank == 0:
            torch.save(logits, self.out / "logits.pt")


@pytest.mark.distributed
def test_lora_exports_a_peft_adapter_with_equal_logits(tmp_path):
    from peft import PeftModel

    source = tmp_path / "source"
    hf = make_hf_model("gemma3", source)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, max_steps=3, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[LoRAProbe(tmp_path)],
        strategy=MegatronStrategy(tensor_model_parallel_size=2, sequence_parallel=True,
                                  global_batch_size=4, micro_batch_size=2, start_method="fork"),
    )
    module = PretrainModule(str(source), OptimizerSettings(lr=2e-2, warmup_steps=0),
                            model_overrides={"seq_length": SEQ},
                            lora=LoRAConfig(target_modules="all-linear", rank=4, alpha=8.0))
    trainer.fit(module, DataLoader(TokenRows(n=16, seq=SEQ, vocab=200), batch_size=4))

    mcore = torch.load(tmp_path / "logits.pt")
    assert (mcore - hf_logits(hf, tokens())).abs().max() > 1e-3, "the adapters changed nothing"
    targets = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())["target_modules"]
    assert {"o_proj", "down_proj", "q_proj", "gate_proj"} <= set(targets)
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(source), tmp_path / "peft")
    assert (hf_logits(peft_model.eval(), tokens()) - mcore).abs().max().item() <= 1e-4


def test_config_round_trips_through_transformers():
    """config.json -> GPTConfig -> transformers' Gemma3TextConfig -> GPTConfig is the same model,
    and a transformers 4 config.json (rope_theta, rope_local_base_freq, sliding_window_pattern)
    reads as the transformers 5 one."""
    cfg, family = gpt_config_from_hf(hf_config_dict("gemma3"), seq_length=SEQ)
    assert family == "gemma3_text"
    assert (cfg.zero_centered_norm, cfg.post_norms, cfg.qk_layernorm, cfg.activation) == (
        True, True, True, "gelu_tanh")
    assert cfg.embedding_scale == 64**0.5 and cfg.softmax_scale == 32**-0.5
    assert (cfg.rotary_base, cfg.local_rotary_base, cfg.rope_scaling) == (
        100000.0, 1000.0, {"rope_type": "linear", "factor": 2.0})
    assert [cfg.is_window_layer(i) for i in range(4)] == [True, False, False, True]
    again, _ = gpt_config_from_hf(hf_config_dict_from_gpt(cfg, family), seq_length=SEQ)
    assert again == cfg

    old = {k: v for k, v in hf_config_dict("gemma3").items()
           if k not in ("rope_parameters", "layer_types")}
    old.update(rope_theta=100000.0, rope_scaling={"rope_type": "linear", "factor": 2.0},
               rope_local_base_freq=1000.0, num_hidden_layers=12, sliding_window_pattern=3)
    cfg4, _ = gpt_config_from_hf(old, seq_length=SEQ)
    assert [cfg4.is_window_layer(i) for i in range(12)] == [True, True, False] * 4
    assert (cfg4.rotary_base, cfg4.local_rotary_base, cfg4.rope_scaling) == (
        cfg.rotary_base, cfg.local_rotary_base, cfg.rope_scaling)


REFUSED = [  # (the field the error must name, config.json changes)
    ("attn_logit_softcapping", dict(attn_logit_softcapping=50.0)),
    ("final_logit_softcapping", dict(final_logit_softcapping=30.0)),
    ("use_bidirectional_attention", dict(use_bidirectional_attention=True)),
    ("hidden_activation", dict(hidden_activation="gelu")),
    ("attention_bias", dict(attention_bias=True)),
    ("rope_parameters", dict(rope_parameters={
        "full_attention": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}})),
    ("rope_parameters", dict(rope_parameters={
        "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}})),
    ("query_pre_attn_scalar", dict(query_pre_attn_scalar=None)),
]


@pytest.mark.parametrize("field,changes", REFUSED, ids=[str(c) for _, c in REFUSED])
def test_unsupported_variants_are_refused_by_name(field, changes):
    with pytest.raises(HFCheckpointError, match=rf"\b{field}\b"):
        gpt_config_from_hf({**hf_config_dict("gemma3"), **changes}, seq_length=SEQ)


def test_multimodal_gemma3_is_refused():
    hf = {**hf_config_dict("gemma3"), "architectures": ["Gemma3ForConditionalGeneration"],
          "model_type": "gemma3"}
    with pytest.raises(HFCheckpointError, match="Gemma3ForConditionalGeneration' is not supported"):
        gpt_config_from_hf(hf)


def test_post_norms_fit_an_mlp_spec_given_as_a_partial():
    """mcore 0.19's local spec gives the dense MLP as functools.partial(MLP, submodules=...)."""
    import functools

    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLP, MLPSubmodules

    from lightning_mcore.model.build import layer_spec
    from lightning_mcore.model.config import GPTConfig
    from lightning_mcore.model.post_norm import RowParallelLinearPostNorm, with_post_norms

    spec = layer_spec(GPTConfig(), use_te=False)
    spec.submodules.mlp = functools.partial(MLP, submodules=MLPSubmodules(
        linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear))
    out = with_post_norms(spec, use_te=False)
    assert out.submodules.mlp.func is MLP
    assert out.submodules.mlp.keywords["submodules"].linear_fc2 is RowParallelLinearPostNorm
    assert spec.submodules.mlp.keywords["submodules"].linear_fc2 is RowParallelLinear  # a copy
