"""The other runnable examples of the README and the guides, verbatim from README.md and docs/, in
a fresh directory with a copy of configs/: the Python example at the README's top, the SFT and DPO
commands, the reward, KTO and distillation commands, the GRPO commands, verify, the one-file
family and the vision-language commands. (The quickstart, the LoRA fine-tune and the multi-node
commands have tests of their own.) Each run must train: its
logged loss falls (DPO: below log 2, where every pair starts)."""

import csv
import json
import math
import re
import subprocess
import sys

import pytest
from readme import README, ROOT, clean_env, code_blocks, commands, run, section, user_dir, warnings_in


def logged(directory, key: str) -> list[float]:
    (metrics,) = directory.rglob("metrics.csv")
    return [float(row[key]) for row in csv.DictReader(open(metrics)) if row.get(key)]


@pytest.mark.parametrize("page, title, name", [("sft.md", "Supervised fine-tuning", "sft"),
                                               ("preference.md", "Preference training (DPO, IPO)", "dpo")])
def test_readme_fit_command_trains(page, title, name, tmp_path):
    (argv,) = commands(section(title, page))
    work = user_dir(tmp_path)
    run(argv, work)
    assert (work / "runs" / name / "checkpoints" / "last.ckpt" / "common.pt").is_file()
    losses = logged(work / "runs" / name, "train/loss")
    assert len(losses) >= 3 and losses[-1] < losses[0], losses
    if name == "dpo":
        assert abs(losses[0] - math.log(2)) < 0.05 and losses[-1] < math.log(2), losses


OBJECTIVES = {"reward": "train/accuracy", "kto": "train/kl", "distill": "train/divergence"}


@pytest.mark.parametrize("name", sorted(OBJECTIVES))
def test_readme_objective_commands_train(name, tmp_path):
    """The reward, KTO and distillation commands: each trains and its loss falls; the reward
    model ends ranking the bundled pairs right, the student's KL to its teacher falls by half."""
    (argv,) = [a for a in commands(section("Reward models, KTO, distillation", "reward-kto-distill.md")) if f"configs/{name}.yaml" in a]
    work = user_dir(tmp_path)
    run(argv, work)
    assert (work / "runs" / name / "checkpoints" / "last.ckpt" / "common.pt").is_file()
    losses = logged(work / "runs" / name, "train/loss")
    assert len(losses) >= 3 and losses[-1] < losses[0], losses
    metric = logged(work / "runs" / name, OBJECTIVES[name])
    assert len(metric) >= 3, metric
    if name == "reward":
        assert metric[-1] > 0.9, metric
    elif name == "distill":
        assert metric[-1] < 0.5 * metric[0], metric
    else:
        assert all(math.isfinite(m) and m >= 0 for m in metric), metric  # z0 is clamped at 0


def test_readme_grpo_command_runs(tmp_path):
    """The GRPO command: rollouts are generated, scored and trained on every step, and the
    metrics the README lists are logged."""
    (argv,) = [a for a in commands(section("GRPO, and generation with a KV cache", "grpo.md")) if "configs/grpo.yaml" in a]
    work = user_dir(tmp_path)
    run(argv, work)
    assert (work / "runs" / "grpo" / "checkpoints" / "last.ckpt" / "common.pt").is_file()
    for key in ("train/loss", "train/reward", "train/kl", "train/clip_fraction",
                "train/completion_length", "train/rollout_tokens_per_s"):
        values = logged(work / "runs" / "grpo", key)
        assert len(values) >= 10 and all(math.isfinite(v) for v in values), (key, values)
    assert min(logged(work / "runs" / "grpo", "train/completion_length")) > 0
    # it learns what the tiny base can: answering with a number (docs/grpo.md)
    numbers = logged(work / "runs" / "grpo", "train/rewards/lightning_mcore.rewards.contains_number")
    assert len(numbers) == 60 and sum(numbers[-10:]) / 10 > sum(numbers[:10]) / 10 + 0.2, numbers


def test_readme_moe_grpo_command_runs(tmp_path):
    """The MoE GRPO command (EP=2, routing replay, GSPO, DAPO's overlong penalty and dynamic
    sampling): under replay the training forward's log-probs are the rollout's (fp32), no routing
    mismatch is counted, and the overlong penalty and dynamic sampling log their numbers."""
    (argv,) = [a for a in commands(section("GRPO, and generation with a KV cache", "grpo.md")) if "configs/grpo_moe.yaml" in a]
    work = user_dir(tmp_path)
    run(argv, work)
    runs = work / "runs" / "grpo_moe"
    assert (runs / "checkpoints" / "last.ckpt" / "common.pt").is_file()
    diffs = logged(runs, "train/rollout_logp_diff")
    assert len(diffs) == 4 and max(diffs) < 1e-5, diffs
    assert not logged(runs, "train/routing_mismatch")  # nothing to count under replay
    assert all(-1.0 <= p <= 0.0 for p in logged(runs, "train/rewards/overlong"))
    assert all(1 <= r <= 2 for r in logged(runs, "train/dynamic_sampling_rounds"))


def test_readme_python_example_trains(tmp_path):
    """The first code block, saved as a script (the default launcher re-runs it per rank), plus
    one line that reports rank 0's last loss."""
    intro = README[: README.index("\n## ")]
    (code,) = code_blocks(intro, "python")
    script = user_dir(tmp_path) / "example.py"
    script.write_text(code + 'if trainer.global_rank == 0:\n    print("LOSS", float(trainer.callback_metrics["loss"]))\n')
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=clean_env(tmp_path),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    (loss,) = [float(x) for x in re.findall(r"^LOSS (\S+)$", proc.stdout, re.M)]
    assert loss < 3.0  # from ~6.2 (log 512) at the start
    # The console as the CLI's: our summary of the whole model (by hand: untied embedding and
    # output layer, per layer QKV of 4 heads + 2 groups x 32, proj, SwiGLU fc1, fc2, two norms),
    # steps of max_steps, no Lightning default that misreads this run, no warning.
    h, f, v, qkv = 128, 352, 512, 128 + 2 * 2 * 32
    total = 2 * v * h + 2 * (h * qkv + h * h + 2 * h * f + f * h + 2 * h) + h
    console = proc.stdout + proc.stderr
    assert f"vocab 512: {total:,} parameters, {total:,} trainable" in console, console[-3000:]
    assert "step: 80/80" in console or "step=80/80" in console, console[-3000:]
    assert not re.search(r"Total FLOPs|v_num|Epoch \d+/-2", console), console[-3000:]
    assert warnings_in(console) == [], warnings_in(console)
    assert "configure_callbacks` will override" not in console  # quiet.py: ours replace the defaults


def test_readme_verify_command_passes(tmp_path):
    """`lightning-mcore verify` on the bundled model at TP=2+SP, as docs/hf-families.md shows it."""
    (argv,) = [a for a in commands(section("Check your own model: verify", "hf-families.md")) if a[1] == "verify"]
    proc = run(argv, user_dir(tmp_path))
    (line,) = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith('{"verify"')]
    assert line["verify"] == "pass" and line["top1_agree"] == line["positions"] > 0, line


def test_readme_family_file_is_the_real_one():
    """The one-file family docs/hf-families.md shows is the file the package registers."""
    from lightning_mcore import models

    shown = [b for b in code_blocks(section("Adding a family", "hf-families.md"), "python") if "ARCHITECTURE" in b]
    assert shown == [(ROOT / "lightning_mcore" / "models" / "seed_oss.py").read_text()]
    assert models.ARCHITECTURES["SeedOssForCausalLM"].model_type == "seed_oss"


def test_readme_vision_language_commands(tmp_path):
    """The vision-language fit and export commands: the loss falls, and the export is a
    transformers Qwen2.5-VL directory with the trained vision encoder and the processor files."""
    from safetensors import safe_open

    fit, export = commands(section("Vision-language models (Qwen2.5-VL, Qwen3-VL, Qwen3.5)", "vision-language.md"))
    work = user_dir(tmp_path)
    run(fit, work)
    losses = logged(work / "runs" / "qwen2_5_vl_sft", "train/loss")
    assert len(losses) >= 3 and losses[-1] < losses[0], losses
    run(export, work)
    out = work / "runs" / "qwen2_5_vl_sft" / "hf"
    assert (out / "preprocessor_config.json").is_file() and (out / "tokenizer.json").is_file()
    source = work / "configs" / "sample_data" / "tiny-qwen2_5-vl"
    with safe_open(out / "model.safetensors", "pt") as new, safe_open(source / "model.safetensors", "pt") as old:
        assert set(new.keys()) == set(old.keys())
        name = "visual.patch_embed.proj.weight"
        assert not new.get_tensor(name).equal(old.get_tensor(name))  # trained, not the source's
