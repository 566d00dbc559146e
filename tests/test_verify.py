"""`lightning-mcore verify` (issue 18, acceptance 5): passes on a tiny model of every family in
tests/hf_models.py at TP=2 (+ sequence parallel), names the layer of a perturbed weight, and
refuses mistakes before any rank starts. The CLI runs in this process; its ranks are forked.
"""

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers as tf
from safetensors.torch import load_file, save_file

from hf_models import COMMON, FAMILIES, bf16_tolerance, hf_logits, make_hf_model
from lightning_mcore.cli import main
from lightning_mcore.verify import TEXTS, build_prompts, relative_diff

ROOT = Path(__file__).parents[1]
FORK = ["--start_method", "fork"]


def verify(capsys, *args) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of `lightning-mcore verify ARGS` run in this process."""
    code = 0
    try:
        main(["verify", *map(str, args)])
    except SystemExit as exit_:
        code = exit_.code
    out, err = capsys.readouterr()
    return code, out, err


def result(out: str) -> dict:
    lines = [line for line in out.splitlines() if line.startswith("{")]
    assert len(lines) == 1, out
    return json.loads(lines[0])


def refused(capsys, *args) -> str:
    code, out, err = verify(capsys, *args)
    assert code == 2, (out, err)
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1 and errors[0].startswith("lightning-mcore verify: error: "), err
    assert "{" not in out, out  # nothing ran
    return errors[0]


@pytest.mark.distributed
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_verify_passes_on_every_family_at_tp2(family, tmp_path, capsys):
    make_hf_model(family, tmp_path / family)
    # experts with biases (GPT-OSS) are computed at expert-TP 1 only (mcore's rule)
    etp = ("--expert_tensor_parallel_size", 1) if family == "gpt_oss" else ()
    code, out, err = verify(capsys, "--model", tmp_path / family, "--tensor_model_parallel_size", 2,
                            "--sequence_parallel", *etp, *FORK)
    assert code == 0, (out, err)
    found = result(out)
    assert found["verify"] == "pass" and "PASS" in out
    assert found["logit_diff"] <= 1e-4 and found["top1_agree"] == found["positions"] == 3 * 32
    # every layer's output, gathered from the sequence-parallel ranks, equals transformers'
    assert list(found["layer_diffs"]) == [f"model.layers.{i}" for i in range(COMMON["num_hidden_layers"])]
    assert all(d <= 1e-4 for d in found["layer_diffs"].values()), found["layer_diffs"]


@pytest.mark.distributed
def test_verify_fails_naming_the_layer_of_a_perturbed_weight(tmp_path, capsys):
    """Layer 2 of 4 sits on the second pipeline stage: its output travels to rank 0."""
    original, perturbed = tmp_path / "original", tmp_path / "perturbed"
    make_hf_model("llama", original)
    shutil.copytree(original, perturbed)
    weights = load_file(original / "model.safetensors")
    name = "model.layers.2.self_attn.o_proj.weight"
    noise = torch.randn(weights[name].shape, generator=torch.Generator().manual_seed(0))
    weights[name] = weights[name] + 0.05 * noise
    save_file(weights, perturbed / "model.safetensors", metadata={"format": "pt"})

    code, out, err = verify(capsys, "--model", perturbed, "--reference", original,
                            "--pipeline_model_parallel_size", 2, *FORK)
    assert code == 1, (out, err)
    found = result(out)
    assert found["verify"] == "fail" and found["first_divergent"] == "model.layers.2"
    assert "first divergence  model.layers.2" in out and "FAIL" in out
    diffs = found["layer_diffs"]
    assert diffs["model.layers.0"] <= 1e-6 and diffs["model.layers.1"] <= 1e-6 < diffs["model.layers.2"]
    # the difference reported is the one transformers itself sees between the two checkpoints
    tokens = torch.randint(0, COMMON["vocab_size"], (3, 32), generator=torch.Generator().manual_seed(0))
    hf = [hf_logits(tf.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32), tokens)
          for d in (perturbed, original)]
    assert found["max_logit_diff"] == pytest.approx(float((hf[0] - hf[1]).abs().max()), abs=1e-5)
    assert found["top1_agree"] == int((hf[0].argmax(-1) == hf[1].argmax(-1)).sum()) < 96


@pytest.mark.distributed
def test_verify_tokenizes_text_prompts_of_different_lengths(tmp_path, capsys):
    """Prompts padded to a common length that sequence parallelism can split: only their own
    tokens are compared, and the padding changes none of them."""
    source = tmp_path / "llama"
    torch.manual_seed(0)
    tf.LlamaForCausalLM(tf.LlamaConfig(**{**COMMON, "vocab_size": 512})).save_pretrained(source)
    for f in (ROOT / "configs" / "sample_data" / "tokenizer").iterdir():
        shutil.copy(f, source / f.name)
    texts = ["Once upon a time", "a longer prompt, with more words than the first one"]
    code, out, err = verify(capsys, "--model", source, "--tensor_model_parallel_size", 2,
                            "--sequence_parallel", "--prompts", *texts, *FORK)
    assert code == 0, (out, err)
    tokenizer = tf.AutoTokenizer.from_pretrained(source)
    lengths = [len(tokenizer(t)["input_ids"]) for t in texts]
    assert lengths[0] != lengths[1] and max(lengths) % 2  # padding is needed
    found = result(out)
    assert found["positions"] == sum(lengths) and found["verify"] == "pass", found


def test_verify_refuses_a_directory_without_config_json(tmp_path, capsys):
    line = refused(capsys, "--model", tmp_path)
    assert f"--model={tmp_path}" in line and "config.json" in line


def test_verify_refuses_an_unsupported_architecture(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({**COMMON, "architectures": ["GPT2LMHeadModel"],
                                                      "model_type": "gpt2"}))
    line = refused(capsys, "--model", tmp_path)
    assert "GPT2LMHeadModel" in line and "not supported" in line


def test_verify_refuses_a_layout_before_starting_ranks(tmp_path, capsys):
    make_hf_model("llama", tmp_path)
    line = refused(capsys, "--model", tmp_path, "--tensor_model_parallel_size", 3, *FORK)
    assert "--tensor_model_parallel_size=3" in line and "num_attention_heads (4)" in line
    line = refused(capsys, "--model", tmp_path, "--expert_model_parallel_size", 2, *FORK)
    assert "--expert_model_parallel_size=2" in line and "MoE" in line


def test_verify_refuses_text_prompts_without_a_tokenizer(tmp_path, capsys):
    make_hf_model("llama", tmp_path)
    line = refused(capsys, "--model", tmp_path, "--prompts", "hello", *FORK)
    assert "--prompts" in line and "tokenizer" in line


def test_verify_refuses_a_reference_of_another_vocab(tmp_path, capsys):
    make_hf_model("llama", tmp_path / "a")
    tf.LlamaConfig(**{**COMMON, "vocab_size": 300}).save_pretrained(tmp_path / "b")
    line = refused(capsys, "--model", tmp_path / "a", "--reference", tmp_path / "b", *FORK)
    assert "vocab_size=300" in line and "--reference" in line


def test_differences_are_relative_to_each_positions_scale():
    """A position whose hidden state carries an outlier of 1000 does not hide a difference of
    0.5 at another position of scale 2; below scale 1 a difference counts as it is."""
    ref = torch.tensor([[1000.0, 0.0], [2.0, 0.0], [0.1, 0.2]])
    assert relative_diff(ref + torch.tensor([[1.0, 0.0], [0.0, 0.5], [0.0, 0.0]]), ref) == 0.25
    small = torch.tensor([[0.0, 0.0], [0.0, 0.0], [0.03, 0.0]])
    assert relative_diff(ref + small, ref) == pytest.approx(0.03)
    assert relative_diff(ref + torch.tensor([[float("nan"), 0.0], [0.0] * 2, [0.0] * 2]), ref) == float("inf")


def test_default_prompts_are_the_texts_when_there_is_a_tokenizer_and_fit_the_model(tmp_path):
    tokenizer = ROOT / "configs" / "sample_data" / "tokenizer"
    prompts = build_prompts(None, [str(tmp_path), str(tokenizer)], vocab=512, seq_length=41, multiple=2)
    expected = [tf.AutoTokenizer.from_pretrained(tokenizer)(t)["input_ids"][:40] for t in TEXTS]
    assert prompts.lengths == [len(e) for e in expected] and str(tokenizer) in prompts.source
    assert [row[:n].tolist() for row, n in zip(prompts.tokens, prompts.lengths)] == expected
    without = build_prompts(None, [str(tmp_path)], vocab=200, seq_length=256, multiple=1)
    assert without.tokens.shape == (3, 32) and int(without.tokens.max()) < 200


@pytest.mark.gpu
@pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is None, reason="needs Transformer Engine")
@pytest.mark.parametrize("precision", ["bf16-mixed", "32-true"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_verify_with_transformer_engine_on_gpu(family, precision, tmp_path):
    """Transformer Engine layers (TP=2 + SP on 2 GPUs, else one) against transformers in fp32 on
    CPU, within the precision's default tolerance (32-true: the TF32 one, though conftest turns
    TF32 off) or, in bf16, 1.5x transformers' own bf16 model's error where that is the larger."""
    hf = make_hf_model(family, tmp_path / family)
    two = torch.cuda.device_count() >= 2
    layout = ["--tensor_model_parallel_size", "2", "--sequence_parallel"] if two else []
    if precision == "bf16-mixed":  # verify's 0.1, or wider where transformers' own bf16 is off more
        tokens = torch.randint(0, hf.config.vocab_size, (3, 32), generator=torch.Generator().manual_seed(0))
        layout += ["--tolerance", str(bf16_tolerance(hf, tokens))]
    run = subprocess.run([sys.executable, "-m", "lightning_mcore.cli", "verify", "--model", str(tmp_path / family),
                          "--accelerator", "gpu", "--precision", precision, *layout],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    found = result(run.stdout)
    assert found["verify"] == "pass" and "Transformer Engine layers" in found["layout"], found
    print(f"{family} {precision}: logits {found['logit_diff']:.2e}, last layer "
          f"{list(found['layer_diffs'].values())[-1]:.2e}, top-1 {found['top1_agree']}/{found['positions']}")
