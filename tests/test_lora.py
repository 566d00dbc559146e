"""Acceptance (LoRA): adapters on TP-sharded mcore linears, exported as a PEFT adapter that peft
loads with the mcore model's logits; merged export equals peft's merge_and_unload; base weights
untouched; the trainable count follows the formula; TP=1, TP=2, PP=2 train alike."""

import json

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from safetensors.torch import load_file
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM

from hf_models import hf_logits, make_hf_model
from lightning_mcore import MegatronStrategy, OptimizerSettings, PretrainModule
from lightning_mcore.cli import main
from lightning_mcore.lora.config import LoRAConfig, LoRAError
from toy import TokenRows, fit, sharded_weights, tiny_config

TOKENS = torch.randint(0, 200, (2, 16), generator=torch.Generator().manual_seed(4))


def tensors(directory) -> dict:
    return {k: v for f in sorted(directory.glob("*.safetensors")) for k, v in load_file(f).items()}


def base_weights(module) -> dict:
    return {key: t for key, _, _, t in sharded_weights(module) if not key.startswith("lora.")}


class Probe(L.Callback):
    """Base weights before and after; at the end logits, the PEFT and merged exports (rank 0
    writes files), and the trainable count the module computed."""

    def __init__(self, out) -> None:
        self.out = out

    def on_fit_start(self, trainer, pl_module):
        self.before = base_weights(pl_module)

    def on_train_end(self, trainer, pl_module):
        logits = trainer.lightning_module.forward_logits(TOKENS)
        pl_module.save_hf_checkpoint(self.out / "peft", mode="peft")
        pl_module.save_hf_checkpoint(self.out / "merged", mode="merged")
        after = base_weights(pl_module)  # after the merged export took its adapters back out
        same = all(torch.equal(after[k], v) for k, v in self.before.items())
        if trainer.global_rank == 0:
            torch.save(logits, self.out / "logits.pt")
            (self.out / "facts.json").write_text(json.dumps(
                {"trainable": pl_module.lora_trainable_parameters, "base_unchanged": same,
                 "trainable_tensors": sum(p.requires_grad for p in pl_module.parameters())}))


def peft_and_merged_match(source, out, mcore: torch.Tensor) -> dict:
    """peft on `out`/peft gives our logits `mcore` (1e-4, fp32) and its merge_and_unload equals
    `out`/merged (1e-6); returns merge_and_unload's state dict."""
    from peft import PeftModel

    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(source), out / "peft")
    assert (hf_logits(peft_model.eval(), TOKENS) - mcore).abs().max().item() <= 1e-4
    merged_ref = peft_model.merge_and_unload().state_dict()
    merged = AutoModelForCausalLM.from_pretrained(out / "merged").state_dict()
    assert merged.keys() == merged_ref.keys()
    for name, tensor in merged_ref.items():
        torch.testing.assert_close(merged[name], tensor, rtol=0, atol=1e-6, msg=name)
    return merged_ref


def fit_lora_at_tp2_sp(source, lora, out) -> None:
    """Three LoRA steps at TP=2+SP from the HF directory `source`; Probe writes to `out`."""
    trainer = L.Trainer(
        accelerator="cpu", devices=2, max_steps=3, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, callbacks=[Probe(out)],
        strategy=MegatronStrategy(tensor_model_parallel_size=2, sequence_parallel=True,
                                  global_batch_size=4, micro_batch_size=2, start_method="fork"),
    )
    module = PretrainModule(str(source), OptimizerSettings(lr=2e-2, warmup_steps=0), lora=lora)
    trainer.fit(module, DataLoader(TokenRows(n=16, seq=16, vocab=200), batch_size=4))


def formula(cfg, r: int) -> int:
    h, f = cfg.hidden_size, cfg.intermediate_size
    head = getattr(cfg, "head_dim", None) or h // cfg.num_attention_heads
    q, kv = cfg.num_attention_heads * head, cfg.num_key_value_heads * head
    per_layer = r * ((h + q + 2 * kv) + (q + h) + (h + 2 * f) + (f + h))
    return cfg.num_hidden_layers * per_layer


@pytest.mark.distributed
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_peft_export_and_merge_match_peft_at_tp2(family, tmp_path):
    source = tmp_path / "source"
    hf = make_hf_model(family, source)
    lora = LoRAConfig(target_modules="all-linear", rank=4, alpha=8.0)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, max_steps=3, logger=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=tmp_path,
        callbacks=[Probe(tmp_path), ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=3)],
        strategy=MegatronStrategy(tensor_model_parallel_size=2, global_batch_size=4, micro_batch_size=2,
                                  start_method="fork"),
    )
    module = PretrainModule(str(source), OptimizerSettings(lr=2e-2, warmup_steps=0), lora=lora)
    trainer.fit(module, DataLoader(TokenRows(n=16, seq=16, vocab=200), batch_size=4))

    facts = json.loads((tmp_path / "facts.json").read_text())
    assert facts["base_unchanged"]
    assert facts["trainable"] == formula(hf.config, 4)
    mcore = torch.load(tmp_path / "logits.pt")
    assert (mcore - hf_logits(hf, TOKENS)).abs().max() > 1e-3, "the adapters changed nothing"

    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8.0
    assert sorted(config["target_modules"]) == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    peft_and_merged_match(source, tmp_path, mcore)

    saved = tmp_path / "ckpt" / "epoch=0-step=3.ckpt"
    from megatron.core import dist_checkpointing

    keys = dist_checkpointing.load_tensors_metadata(str(saved / "weights"))
    assert keys and all(k.startswith(("lora.", "optimizer.")) for k in keys), sorted(keys)[:5]

    # The export command rebuilds base + adapters from the adapter-only checkpoint (in-process:
    # the command in a fresh interpreter is test_hf_export_from_training's).
    for mode in ("peft", "merged"):
        main(["export", "--checkpoint", str(saved), "--output", str(tmp_path / f"cmd-{mode}"), "--mode", mode])
        a, b = tensors(tmp_path / mode), tensors(tmp_path / f"cmd-{mode}")
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), (mode, tmp_path)


@pytest.mark.distributed
def test_lora_losses_agree_across_layouts(tmp_path):
    """Adapters start the same at any layout (seeded by name), so TP=2 (+SP) and PP=2 runs
    follow the single-process one. Clipped SGD (the clip below the gradient norm): each update
    scales with the norm, which must count every TP rank's shard of the sharded factor once."""
    lora = {"lora": LoRAConfig(target_modules="all-linear", rank=4, alpha=8.0)}
    optim = OptimizerSettings(lr=20.0, optimizer="sgd", weight_decay=0.0, warmup_steps=0, clip_grad=0.02)
    runs = {name: fit(tmp_path, devices=devices, steps=3, optim=optim, module_kwargs=lora, name=name,
                      **parallel)
            for name, devices, parallel in (
                ("tp1", 1, {}),
                ("tp2_sp", 2, dict(tensor_model_parallel_size=2, sequence_parallel=True)),
                ("pp2", 2, dict(pipeline_model_parallel_size=2)))}
    assert runs["tp1"][0] > runs["tp1"][-1]
    for name in ("tp2_sp", "pp2"):
        for got, want in zip(runs[name], runs["tp1"]):
            assert abs(got - want) <= 1e-5 * want, (name, runs[name], runs["tp1"])


def test_lora_config_errors_are_clear():
    with pytest.raises(LoRAError, match="rank must be a positive int"):
        LoRAConfig(rank=0)
    with pytest.raises(LoRAError, match="available: 'all-linear', linear_qkv") as info:
        LoRAConfig(target_modules=["query_key_value"])
    assert "q_proj" in str(info.value)
    with pytest.raises(LoRAError, match="mcore fuses k_proj, q_proj, v_proj into linear_qkv"):
        LoRAConfig(target_modules=["q_proj", "v_proj"])
    assert LoRAConfig(target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]).rank == 8
