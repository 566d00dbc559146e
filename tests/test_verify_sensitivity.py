"""`lightning-mcore verify` catches what it exists to catch (issue 43, items 8 and 9, and its exit
codes).

A checkpoint with one corrupted weight (two rows swapped, one entry scaled) in attention, MLP,
experts, router, norms, embeddings or the output layer, checked against its original, fails and
names the layer the weight belongs to; the exact checkpoints pass. A Mixtral with an odd expert
width (transformers' grouped_mm crashed on it) verifies; a reference that fails has its own exit
code; mistakes in the command or files end with exit code 2 before any rank starts. One rank per
run (forked), so each verify takes a second or two.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import transformers as tf
from safetensors.torch import load_file, save_file

from hf_models import COMMON, make_hf_model
from lightning_mcore.verify import build_prompts, relative_diff
from test_verify import FORK, refused, result, verify

LAST = f"model.layers.{COMMON['num_hidden_layers'] - 1}"
AFTER_LAST = f"after {LAST} (the final norm or the output layer)"
REFERENCE_FAILED = 4


def prompt_token(directory: Path) -> int:
    """A token id verify's default prompts contain (the model has no tokenizer)."""
    return int(build_prompts(None, [str(directory)], COMMON["vocab_size"], 256, 1).tokens[0, 0])


def corrupt(original: Path, target: Path, name: str, how: str) -> None:
    """A copy of `original` with one tensor changed: `swap` exchanges rows 3 and 17, `scale:F`
    multiplies one entry by F (in row 5, or a prompt token's row of the embeddings)."""
    shutil.copytree(original, target)
    weights = load_file(original / "model.safetensors")
    tensor = weights[name].clone()
    if how == "swap":
        tensor[[3, 17]] = tensor[[17, 3]]
    else:
        row = prompt_token(original) if name == "model.embed_tokens.weight" else 5 % len(tensor)
        index = (row, 7) if tensor.dim() == 2 else (row,)
        tensor[index] *= float(how.split(":")[1])
    assert not torch.equal(tensor, weights[name])
    weights[name] = tensor
    save_file(weights, target / "model.safetensors", metadata={"format": "pt"})


# (family, tensor, corruption, the layer verify must name)
CORRUPTIONS = [
    # the case: DeepSeek-V3, two rows of one q_b_proj swapped
    ("deepseek_v3", "model.layers.1.self_attn.q_b_proj.weight", "swap", "model.layers.1"),
    ("deepseek_v3", "model.layers.1.self_attn.kv_a_layernorm.weight", "scale:1.01", "model.layers.1"),
    ("deepseek_v3", "model.layers.2.mlp.experts.1.down_proj.weight", "scale:2", "model.layers.2"),
    ("deepseek_v3", "model.layers.3.mlp.shared_experts.up_proj.weight", "swap", "model.layers.3"),
    ("deepseek_v3", "model.layers.0.mlp.gate_proj.weight", "scale:2", "model.layers.0"),
    ("llama", "model.layers.1.self_attn.q_proj.weight", "swap", "model.layers.1"),
    ("llama", "model.layers.2.mlp.down_proj.weight", "scale:2", "model.layers.2"),
    ("llama", "model.layers.3.post_attention_layernorm.weight", "scale:1.01", "model.layers.3"),
    ("llama", "model.embed_tokens.weight", "scale:2", "model.layers.0"),
    ("llama", "model.norm.weight", "scale:1.01", AFTER_LAST),
    ("llama", "lm_head.weight", "scale:2", AFTER_LAST),
    ("mixtral", "model.layers.0.self_attn.v_proj.weight", "swap", "model.layers.0"),
    ("mixtral", "model.layers.2.block_sparse_moe.experts.1.w2.weight", "scale:2", "model.layers.2"),
    ("mixtral", "model.layers.1.block_sparse_moe.gate.weight", "scale:1.1", "model.layers.1"),
    ("qwen3_moe", "model.layers.1.self_attn.k_norm.weight", "scale:1.01", "model.layers.1"),
    ("qwen3_moe", "model.layers.2.mlp.experts.3.gate_proj.weight", "swap", "model.layers.2"),
    ("qwen2_moe", "model.layers.1.mlp.shared_expert.down_proj.weight", "scale:2", "model.layers.1"),
    ("gemma3", "model.layers.2.post_feedforward_layernorm.weight", "scale:1.01", "model.layers.2"),
    ("gemma3", "model.layers.1.self_attn.o_proj.weight", "swap", "model.layers.1"),
    ("qwen3_5", "model.layers.0.linear_attn.in_proj_qkv.weight", "swap", "model.layers.0"),
    ("qwen3_5", "model.layers.2.linear_attn.A_log", "scale:1.5", "model.layers.2"),
    ("qwen3_5", "model.layers.1.self_attn.q_proj.weight", "swap", "model.layers.1"),  # a query and a gate row
    ("qwen3_next", "model.layers.0.linear_attn.in_proj_qkvz.weight", "swap", "model.layers.0"),
    ("qwen3_next", "model.layers.2.linear_attn.conv1d.weight", "scale:2", "model.layers.2"),
    ("qwen3_next", "model.layers.3.mlp.experts.1.down_proj.weight", "scale:2", "model.layers.3"),
    ("glm4_moe", "model.layers.1.self_attn.k_proj.bias", "scale:2", "model.layers.1"),
    ("glm4_moe", "model.layers.2.mlp.gate.e_score_correction_bias", "scale:3", "model.layers.2"),
    ("gpt_oss", "model.layers.1.self_attn.sinks", "scale:3", "model.layers.1"),
    ("gpt_oss", "model.layers.2.self_attn.o_proj.bias", "scale:3", "model.layers.2"),
    # (the tiny model's router biases pick the same experts for every prompt token, so a
    # corrupted expert 1 or its bias changes nothing that transformers computes either)
    ("gpt_oss", "model.layers.1.mlp.router.weight", "scale:3", "model.layers.1"),
    ("minimax_m2", "model.layers.1.self_attn.q_norm.weight", "scale:1.5", "model.layers.1"),
]
FAMILIES = sorted({family for family, *_ in CORRUPTIONS})


@pytest.fixture(scope="module")
def originals(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("originals")
    for family in FAMILIES:
        make_hf_model(family, root / family)
    return {family: root / family for family in FAMILIES}


@pytest.mark.parametrize("family", FAMILIES)
def test_exact_checkpoints_pass(family, originals, capsys):
    code, out, err = verify(capsys, "--model", originals[family], *FORK)
    assert code == 0, (out, err)
    found = result(out)
    assert found["verify"] == "pass" and found["first_divergent"] is None
    assert found["logit_diff"] <= found["tolerance"]
    assert all(found["layer_diffs"][k] <= t for k, t in found["layer_tolerances"].items()), found


@pytest.mark.parametrize("family,name,how,layer", CORRUPTIONS,
                         ids=[f"{f}-{n.removeprefix('model.')}-{h}" for f, n, h, _ in CORRUPTIONS])
def test_one_corrupted_weight_fails_naming_its_layer(family, name, how, layer, originals, tmp_path, capsys):
    corrupt(originals[family], tmp_path / "corrupted", name, how)
    code, out, err = verify(capsys, "--model", tmp_path / "corrupted", "--reference", originals[family], *FORK)
    assert code == 1, (out, err)
    found = result(out)
    assert found["verify"] == "fail" and found["first_divergent"] == layer, found
    # the layers before it are within their tolerances
    names = list(found["layer_diffs"])
    before = names[: names.index(layer)] if layer in names else names
    assert all(found["layer_diffs"][k] <= found["layer_tolerances"][k] for k in before), found


def test_the_corruption_is_what_transformers_sees(originals, tmp_path, capsys):
    """The difference verify reports for the issue's case is the one between transformers' own
    models of the two checkpoints, and it is below the old fixed tolerance 1e-3."""
    original = originals["deepseek_v3"]
    corrupt(original, tmp_path / "corrupted", "model.layers.1.self_attn.q_b_proj.weight", "swap")
    code, out, err = verify(capsys, "--model", tmp_path / "corrupted", "--reference", original, *FORK)
    assert code == 1, (out, err)
    found = result(out)
    tokens = build_prompts(None, [str(original)], COMMON["vocab_size"], 256, 1).tokens
    logits = []
    for directory in (tmp_path / "corrupted", original):
        model = tf.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
        with torch.no_grad():
            logits.append(model(input_ids=tokens).logits)
    theirs = relative_diff(logits[0].flatten(0, 1), logits[1].flatten(0, 1))
    assert found["logit_diff"] == pytest.approx(theirs, rel=1e-3, abs=1e-6)
    assert theirs < 1e-3


def test_bf16_on_cpu_passes_when_exact_and_fails_on_a_wrong_row(originals, tmp_path, capsys):
    """bf16 stays meaningful: the exact Gemma 3 (whose own bf16 model is 0.096 off its fp32 one)
    passes; an embedding row of a prompt token swapped with another fails."""
    code, out, err = verify(capsys, "--model", originals["gemma3"], "--precision", "bf16-mixed", *FORK)
    assert code == 0, (out, err)
    original = originals["llama"]
    shutil.copytree(original, tmp_path / "swapped")
    weights = load_file(original / "model.safetensors")
    table, token = weights["model.embed_tokens.weight"].clone(), prompt_token(original)
    other = (token + 1) % COMMON["vocab_size"]
    table[[token, other]] = table[[other, token]]
    weights["model.embed_tokens.weight"] = table
    save_file(weights, tmp_path / "swapped" / "model.safetensors", metadata={"format": "pt"})
    code, out, err = verify(capsys, "--model", tmp_path / "swapped", "--reference", original,
                            "--precision", "bf16-mixed", *FORK)
    assert code == 1 and result(out)["first_divergent"] == "model.layers.0", (out, err)


def test_a_mixtral_of_odd_expert_width_verifies(tmp_path, capsys):
    """transformers' grouped_mm refuses rows of 97 floats (strides not a multiple of 16 bytes):
    verify runs the reference's experts eagerly."""
    make_hf_model("mixtral", tmp_path, intermediate_size=97)
    code, out, err = verify(capsys, "--model", tmp_path, *FORK)
    assert code == 0, (out, err)
    assert result(out)["verify"] == "pass"


def test_a_failing_reference_has_its_own_exit_code(tmp_path, capsys, monkeypatch):
    """transformers raising inside the reference is not a mismatch: exit 4 and one `error:` line
    that names the directory and transformers' message."""
    make_hf_model("mixtral", tmp_path)

    def crash(self, *args, **kwargs):
        raise RuntimeError("strides should be multiple of 16 bytes")

    monkeypatch.setattr(tf.MixtralForCausalLM, "forward", crash)
    code, out, err = verify(capsys, "--model", tmp_path, *FORK)
    assert code == REFERENCE_FAILED, (out, err)
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1 and errors[0].startswith("lightning-mcore verify: error: "), err
    assert f"--reference={tmp_path}" in errors[0] and "strides should be multiple of 16 bytes" in errors[0]
    assert "Traceback" not in err and '{"verify"' not in out


# ---------------------------------------------------------------------- exit codes
@pytest.mark.parametrize("value", ["0", "-1"])
def test_a_tolerance_that_passes_nothing_is_refused(value, originals, capsys):
    line = refused(capsys, "--model", originals["llama"], "--tolerance", value, *FORK)
    assert f"--tolerance={float(value):g}" in line


def test_a_reference_without_weights_is_refused_before_any_rank(originals, tmp_path, capsys):
    (tmp_path / "ref").mkdir()
    shutil.copy(originals["llama"] / "config.json", tmp_path / "ref")
    line = refused(capsys, "--model", originals["llama"], "--reference", tmp_path / "ref", *FORK)
    assert f"--reference={tmp_path / 'ref'}" in line and "model.safetensors" in line


@pytest.mark.parametrize("option", ["--model", "--reference"])
def test_a_truncated_weights_file_is_refused_before_any_rank(option, originals, tmp_path, capsys):
    damaged = tmp_path / "damaged"
    shutil.copytree(originals["llama"], damaged)
    data = (damaged / "model.safetensors").read_bytes()
    (damaged / "model.safetensors").write_bytes(data[: len(data) // 2])
    other = ["--reference", originals["llama"]] if option == "--model" else ["--model", originals["llama"]]
    line = refused(capsys, option, damaged, *other, *FORK)
    assert f"{option}={damaged}" in line and str(damaged / "model.safetensors") in line


def test_a_model_without_weights_is_refused_before_any_rank(originals, tmp_path, capsys):
    shutil.copy(originals["llama"] / "config.json", tmp_path)
    line = refused(capsys, "--model", tmp_path, *FORK)
    assert f"--model={tmp_path}" in line and "model.safetensors" in line


def test_a_reference_of_another_shape_is_refused_before_any_rank(originals, tmp_path, capsys):
    make_hf_model("llama", tmp_path, hidden_size=32)
    line = refused(capsys, "--model", originals["llama"], "--reference", tmp_path, *FORK)
    assert "hidden_size=32" in line and "--reference" in line
