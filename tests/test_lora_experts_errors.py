"""Issue 19: LoRA on MoE experts fails early and exports in either layout.

Settings that cannot work (experts asked of a dense model, a rank beyond the expert's width,
grouped-GEMM experts without Transformer Engine) are refused by MegatronStrategy.validate_module, before any
process group, and by the CLI with one `error:` line naming the keys. The PEFT export writes
expert adapters fused (peft's target_parameters) or per expert (vLLM's names), and refuses a
layout the model cannot hold before writing anything."""

import functools
import json

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from safetensors.torch import load_file
from torch.utils.data import DataLoader

from hf_models import make_hf_model
from process_state import leaves_no_process_state
from lightning_mcore import GPTConfig, MegatronStrategy, OptimizerSettings, PretrainModule
from lightning_mcore.cli import main
from lightning_mcore.hf.peft_export import PeftExportError, experts_layout
from lightning_mcore.lora.checks import check_lora_plan
from lightning_mcore.lora.config import LoRAConfig, LoRAError
from test_bad_inputs import MODEL, refused, snapshot, write_config
from toy import TokenRows

MOE = dict(MODEL, num_moe_experts=4, moe_ffn_hidden_size=32, moe_router_topk=2)  # hidden 64
TP2_SP = ("--trainer.strategy.init_args.sequence_parallel", "true")
ETP1 = ("--trainer.strategy.init_args.expert_tensor_parallel_size", "1")


@pytest.fixture
def no_fit(monkeypatch):
    """A missed refusal would start training: make that fail instead."""
    @functools.wraps(L.Trainer.fit)  # the CLI reads fit's arguments from its signature
    def refuse(*args, **kwargs):
        raise AssertionError("Trainer.fit must not run: the mistake was not found before launch")

    monkeypatch.setattr(L.Trainer, "fit", refuse)


def check(model: dict, lora: LoRAConfig, **parallel) -> None:
    """MegatronStrategy.validate_module on a 2-rank CPU trainer: no process group, no model."""
    strategy = MegatronStrategy(global_batch_size=4, micro_batch_size=2, **parallel)
    L.Trainer(accelerator="cpu", devices=2, strategy=strategy, logger=False)
    strategy.validate_module(PretrainModule(GPTConfig(**model), lora=lora))


# ------------------------------------------------------------- refused before workers start
@pytest.mark.usefixtures("no_fit")
def test_experts_true_without_expert_targets_is_one_cli_error(capsys, tmp_path):
    lora = {"target_modules": ["q_proj", "k_proj", "v_proj"], "experts": True}
    line = refused(capsys, tmp_path, write_config(tmp_path, model=MOE, lora=lora), *TP2_SP, *ETP1)
    assert line.startswith("error: model.init_args.lora (LoRAConfig): LoRA experts=True"), line
    assert "name no expert linear" in line and "experts=False" in line


@pytest.mark.usefixtures("no_fit")
def test_experts_true_on_a_dense_model_is_refused_before_launch(capsys, tmp_path):
    lora = LoRAConfig(target_modules="all-linear", experts=True)
    with pytest.raises(LoRAError, match="experts=True, but the model has no MoE experts"):
        check(MODEL, lora, tensor_model_parallel_size=2)
    check(MODEL, LoRAConfig(target_modules="all-linear"), tensor_model_parallel_size=2)  # unset: fine
    line = refused(capsys, tmp_path, write_config(tmp_path, lora={"experts": True}))
    assert "invalid LoRA setting" in line and "model.init_args.lora.experts=True" in line
    assert "model.init_args.model.num_moe_experts=None" in line and "no MoE experts" in line


@pytest.mark.usefixtures("no_fit")
def test_rank_beyond_the_expert_width_is_refused_before_launch(capsys, tmp_path):
    # The expert linears are [2*32, 64] (fc1) and [64, 32] (fc2): rank <= min(64, 32).
    check(MOE, LoRAConfig(target_modules="all-linear", rank=32))
    with pytest.raises(LoRAError, match="LoRA rank 33 is larger than the expert linear"):
        check(MOE, LoRAConfig(target_modules="all-linear", rank=33))
    wide = dict(MOE, moe_ffn_hidden_size=128)  # the hidden size is the smaller side then
    check(wide, LoRAConfig(target_modules=["down_proj"], rank=64))
    with pytest.raises(LoRAError, match="rank <= 64"):
        check(wide, LoRAConfig(target_modules=["down_proj"], rank=65))
    check(MOE, LoRAConfig(target_modules="all-linear", rank=33, experts=False))  # experts frozen
    line = refused(capsys, tmp_path, write_config(tmp_path, model=MOE, lora={"rank": 40}), *TP2_SP, *ETP1)
    assert "model.init_args.lora.rank=40" in line and "rank <= 32" in line, line


def test_expert_tensor_parallelism_passes_the_pre_launch_checks():
    """Expert adapters shard over expert-TP (tests/test_lora_experts_etp.py)."""
    lora = LoRAConfig(target_modules="all-linear")
    check(MOE, lora, tensor_model_parallel_size=2, sequence_parallel=True)  # unset, expert-TP follows TP
    check(MOE, lora, expert_tensor_parallel_size=2)


@pytest.mark.usefixtures("no_fit")
def test_grouped_gemm_experts_without_te_are_refused_before_launch(capsys, tmp_path):
    grouped = dict(MOE, moe_grouped_gemm=True)
    # rank 4 is no multiple of 8: 'auto' keeps TE's kernel (lora/checks.py), not on CPU
    with pytest.raises(LoRAError, match="grouped-GEMM experts"):
        check(grouped, LoRAConfig(target_modules="all-linear", rank=4))
    with pytest.raises(LoRAError, match="grouped-GEMM experts"):  # set through `extra` too
        check(dict(MOE, extra={"moe_grouped_gemm": True}), LoRAConfig(target_modules="all-linear", rank=4))
    check(grouped, LoRAConfig(target_modules="all-linear", rank=4, experts=False))
    check(grouped, LoRAConfig(target_modules="all-linear"))  # rank 8: 'auto' is torch's, on CPU too
    line = refused(capsys, tmp_path, write_config(tmp_path, model=grouped, lora={"rank": 4}), *TP2_SP, *ETP1)
    assert "model.init_args.model.moe_grouped_gemm=True" in line and "needs torch's grouped experts" in line
    # with Transformer Engine's grouped experts (GPU) they take adapters (tests/test_gpu_lora_experts.py)
    check_lora_plan(LoRAConfig(target_modules="all-linear"), GPTConfig(**grouped), uses_te=True)
    # so do torch's, without TE (tests/test_lora_torch_experts.py)
    check_lora_plan(LoRAConfig(target_modules="all-linear", rank=8),
                    GPTConfig(**grouped, moe_grouped_gemm_backend="torch"))


# ------------------------------------------------------------------------ export layouts
R, ALPHA = 4, 8.0


@pytest.fixture(scope="module")
def moe_run(tmp_path_factory):
    """Two SGD steps of all-linear LoRA on the tiny Qwen3-MoE (4 layers, 4 experts, hidden 64,
    expert FFN 32), one forked rank; the directory of its checkpoint and its source."""
    tmp = tmp_path_factory.mktemp("moe_run")
    make_hf_model("qwen3_moe", tmp / "source")
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=2, logger=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0,
        callbacks=[ModelCheckpoint(dirpath=tmp / "ckpt", filename="final", every_n_train_steps=2)],
        strategy=MegatronStrategy(global_batch_size=4, micro_batch_size=2, start_method="fork"),
    )
    module = PretrainModule(str(tmp / "source"), OptimizerSettings(lr=0.5, optimizer="sgd", weight_decay=0.0,
                                                                   warmup_steps=0),
                            lora=LoRAConfig(target_modules="all-linear", rank=R, alpha=ALPHA))
    with leaves_no_process_state():  # module-scoped: the per-test cleanup does not cover it
        trainer.fit(module, DataLoader(TokenRows(n=8, seq=16, vocab=200), batch_size=4))
    return tmp


def export(run, name: str, *args: str):
    """`lightning-mcore export` of the run's checkpoint to run/name, in this process."""
    out = run / name
    main(["export", "--checkpoint", str(run / "ckpt" / "final.ckpt"), "--output", str(out), *args])
    return out


def adapter(directory) -> dict:
    return load_file(directory / "adapter_model.safetensors")


def per_expert_shapes(layers=4, experts=4, h=64, f=32) -> dict:
    """vLLM's per-expert names and peft's shapes (A [r, in], B [out, r]), written out by hand."""
    shapes = {}
    for layer in range(layers):
        for e in range(experts):
            stem = f"base_model.model.model.layers.{layer}.mlp.experts.{e}."
            for proj, (i, o) in {"gate_proj": (h, f), "up_proj": (h, f), "down_proj": (f, h)}.items():
                shapes[f"{stem}{proj}.lora_A.weight"] = (R, i)
                shapes[f"{stem}{proj}.lora_B.weight"] = (o, R)
    return shapes


def test_per_expert_export_names_shapes_and_values(moe_run):
    out = export(moe_run, "per_expert", "--mode", "peft", "--lora_experts_layout", "per_expert")
    per = adapter(out)
    fused = adapter(export(moe_run, "fused", "--mode", "peft"))  # the default layout
    merged = export(moe_run, "merged", "--mode", "merged")

    experts = {k: tuple(v.shape) for k, v in per.items() if ".mlp." in k}
    assert experts == per_expert_shapes()
    dense = {k for k in per if ".mlp." not in k}
    assert {k.split(".")[-3] for k in dense} == {"q_proj", "k_proj", "v_proj", "o_proj"}
    assert all(torch.equal(per[k], fused[k]) for k in dense)
    config = json.loads((out / "adapter_config.json").read_text())
    assert sorted(config["target_modules"]) == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj",
                                                "up_proj", "v_proj"]
    assert not config.get("target_parameters")

    # fused: lora_A [E*r, in], expert e in rows e*r..; lora_B [out, r*E], column k*E+e = column
    # k of expert e (gate_up_proj innermost, under base_layer.; down_proj outermost)
    E = 4
    for layer in range(4):
        head = f"base_model.model.model.layers.{layer}.mlp.experts."
        for e in range(E):
            stem = f"{head}{e}."
            gate_up_b = torch.cat([per[stem + "gate_proj.lora_B.weight"], per[stem + "up_proj.lora_B.weight"]])
            assert torch.equal(per[stem + "gate_proj.lora_A.weight"], per[stem + "up_proj.lora_A.weight"])
            for fused_stem, a, b in ((head + "base_layer.", per[stem + "gate_proj.lora_A.weight"], gate_up_b),
                                     (head, per[stem + "down_proj.lora_A.weight"], per[stem + "down_proj.lora_B.weight"])):
                assert torch.equal(fused[fused_stem + "lora_A.weight"][e * R:(e + 1) * R], a)
                for k in range(R):
                    assert torch.equal(fused[fused_stem + "lora_B.weight"][:, k * E + e], b[:, k])

    # the values against the merged export: W_merged - W_base = (alpha / r) B A, per expert
    base = load_file(moe_run / "source" / "model.safetensors")
    weights = {k: v for f in merged.glob("*.safetensors") for k, v in load_file(f).items()}
    changed = 0
    for key in (k for k in per_expert_shapes() if k.endswith("lora_A.weight")):
        stem = key.removesuffix(".lora_A.weight")
        name = stem.removeprefix("base_model.model.") + ".weight"
        delta = ALPHA / R * per[stem + ".lora_B.weight"] @ per[key]
        torch.testing.assert_close(weights[name] - base[name], delta, rtol=0, atol=1e-6)
        changed += delta.abs().max().item() > 1e-4
    assert changed == len(per_expert_shapes()) // 2, "some expert adapters were not trained"


def test_an_export_layout_the_model_cannot_hold_is_refused_before_writing(moe_run, capsys, tmp_path):
    before = snapshot(moe_run)
    with pytest.raises(SystemExit) as info:
        main(["export", "--checkpoint", str(moe_run / "ckpt" / "final.ckpt"), "--output",
              str(moe_run / "refused"), "--mode", "merged", "--lora_experts_layout", "per_expert"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert info.value.code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("lightning-mcore export: error: lora_experts_layout='per_expert' applies to PEFT")
    assert snapshot(moe_run) == before

    # a model without expert adapters (attention only on experts, or a dense model)
    attention = PretrainModule(str(moe_run / "source"), lora=LoRAConfig(target_modules=["q_proj", "k_proj", "v_proj"]))
    dense = PretrainModule(GPTConfig(**MODEL), lora=LoRAConfig(target_modules="all-linear"))
    for module in (attention, dense):
        for layout in ("fused", "per_expert"):
            with pytest.raises(PeftExportError, match="has no LoRA adapters on routed experts"):
                module.save_hf_checkpoint(tmp_path / "out", mode="peft", lora_experts_layout=layout)
    # a family with no fused expert layout registered (every MoE family here has one): per_expert only
    with pytest.raises(PeftExportError, match="no fused expert layout.*per_expert"):
        experts_layout("fused", "peft", True, None)
    make_hf_model("mixtral", tmp_path / "mixtral")
    mixtral = PretrainModule(str(tmp_path / "mixtral"), lora=LoRAConfig(target_modules="all-linear"))
    with pytest.raises(PeftExportError, match="must be one of fused, per_expert"):
        mixtral.save_hf_checkpoint(tmp_path / "out", mode="peft", lora_experts_layout="stacked")
    assert experts_layout("per_expert", "peft", True, None) == "per_expert"
    assert not (tmp_path / "out").exists()
