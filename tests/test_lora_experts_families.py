"""PEFT export of LoRA on the routed experts of the other MoE families (Qwen3-MoE:
tests/test_lora_experts.py). transformers 5 fuses their experts alike (gate_up_proj [E, 2f, h],
down_proj [E, h, f]); Mixtral's sit under block_sparse_moe on disk and mlp in memory. Per
family: all-linear LoRA with experts, 3 SGD steps at EP=2; peft loads the PEFT export with our
logits and every adapter tensor in place, and the merged export equals its merge_and_unload.
DeepSeek with dense layers or shared experts is refused (peft rewrites its MLP targets); its
layout is tested on an all-routed variant."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

import hf_models
from hf_models import hf_config_dict, hf_logits, make_hf_model
from lightning_mcore import models
from lightning_mcore.hf.config import HFCheckpointError
from lightning_mcore.lora.config import LoRAConfig
from test_lora import TOKENS, peft_and_merged_match, tensors
from test_lora_experts import fit_at_ep2

ROUTED_ONLY = dict(n_shared_experts=0, first_k_dense_replace=0)


def routed_only(name: str):
    """A FAMILIES entry: DeepSeek `name` with every MLP routed (no dense layer, no shared expert)."""
    config_cls, model_cls, extra = hf_models.FAMILIES[name]()
    return lambda: (config_cls, model_cls, dict(extra, **ROUTED_ONLY))


def drop_empty_tensors(directory) -> None:
    """transformers saves the width-0 shared experts of n_shared_experts=0; our loader refuses
    tensors the model has no place for."""
    from safetensors.torch import load_file, save_file

    path = directory / "model.safetensors"
    save_file({k: v for k, v in load_file(path).items() if v.numel()}, path, metadata={"format": "pt"})


@pytest.mark.distributed
@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "deepseek_v3", "deepseek_v2"])
def test_expert_lora_at_ep2_exports_as_peft_loads_it(family, tmp_path, monkeypatch):
    from peft import PeftModel, get_peft_model_state_dict

    if family.startswith("deepseek"):
        monkeypatch.setitem(hf_models.FAMILIES, family + "_routed", routed_only(family))
        family += "_routed"
    source = tmp_path / "source"
    hf = make_hf_model(family, source)
    drop_empty_tensors(source)
    fit_at_ep2(source, LoRAConfig(target_modules="all-linear", rank=4, alpha=8.0), tmp_path)

    assert json.loads((tmp_path / "facts.json").read_text())["base_unchanged"]
    mcore = torch.load(tmp_path / "logits.pt")
    assert (mcore - hf_logits(hf, TOKENS)).abs().max() > 1e-3, "the adapters changed nothing"
    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert sorted(config["target_parameters"]) == ["mlp.experts.down_proj", "mlp.experts.gate_up_proj"]
    adapter = tensors(tmp_path / "peft")
    layers = [i for i, layer in enumerate(hf.model.layers) if hasattr(layer.mlp, "experts")]
    e, r, h = hf.model.layers[layers[0]].mlp.experts.num_experts, 4, hf.config.hidden_size
    for i in layers:  # gate_up_proj innermost, A [E*r, h]; down_proj outermost, B [h, r*E]
        stem = f"base_model.model.model.layers.{i}.mlp.experts."
        assert adapter[stem + "base_layer.lora_A.weight"].shape == (e * r, h)
        assert adapter[stem + "lora_B.weight"].shape == (h, r * e)

    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(source), tmp_path / "peft")
    loaded = get_peft_model_state_dict(peft_model)
    assert loaded.keys() == adapter.keys()  # nothing dropped, renamed or left at its init
    for name, tensor in adapter.items():
        assert torch.equal(loaded[name], tensor), name
    merged_ref = peft_and_merged_match(source, tmp_path, mcore)

    base = hf.state_dict()  # the expert adapters move the expert weights well past 1e-6
    for name in merged_ref:
        if ".mlp.experts." in name:
            assert (merged_ref[name] - base[name]).abs().max() > 1e-5, name


@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v2"])
def test_deepseek_expert_peft_export_with_dense_or_shared_mlps_is_refused(family):
    """peft (transformers 5) turns DeepSeek's gate/up/down_proj targets into its fused experts'
    target_parameters: the dense layer's and shared experts' adapters would be dropped."""
    from peft import LoraConfig
    from peft.utils.transformers_weight_conversion import convert_peft_config_for_transformers

    config_cls, model_cls, extra = hf_models.FAMILIES[family]()
    hf = model_cls(config_cls(**{**hf_models.COMMON, **extra}))
    peft_config = LoraConfig(r=4, target_modules=["o_proj", "gate_proj", "up_proj", "down_proj"],
                             target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    convert_peft_config_for_transformers(peft_config, hf, None)
    assert peft_config.target_modules == {"o_proj"}  # why the export is refused

    lora = LoRAConfig(target_modules="all-linear")
    cfg, name = models.gpt_config_from_hf(hf_config_dict(family))
    with pytest.raises(HFCheckpointError, match=r"routed experts of Deepseek.*dense layers or shared "
                                                r"experts would load wrong.*merged"):
        models.refuse_peft_export(cfg, name, lora)
    for change in ({"n_shared_experts": 0}, {"first_k_dense_replace": 0}):  # either one suffices
        one_left, _ = models.gpt_config_from_hf({**hf_config_dict(family), **change})
        with pytest.raises(HFCheckpointError, match="dense layers or shared experts"):
            models.refuse_peft_export(one_left, name, lora)
    routed, _ = models.gpt_config_from_hf({**hf_config_dict(family), **ROUTED_ONLY})
    models.refuse_peft_export(routed, name, lora)
    models.refuse_peft_export(cfg, name, LoRAConfig(target_modules=["o_proj"]))


def test_mixtral_and_qwen2_moe_expert_peft_exports_are_not_refused():
    lora = LoRAConfig(target_modules="all-linear")
    for family in ("mixtral", "qwen2_moe"):
        cfg, name = models.gpt_config_from_hf(hf_config_dict(family))
        models.refuse_peft_export(cfg, name, lora)
        assert models.peft_experts(cfg, name) is not None
