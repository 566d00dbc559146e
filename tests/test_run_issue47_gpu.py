"""benchmarks/run_issue47_gpu.sh, issue 47's GPU session script, dry-run on CPU: every command of every
stage parses with its script's own argument parser, on 2 GPUs and on 4, and in each pair stage both
sides run the same shape, depth, global batch, sequence length and data; issue47_summary.py picks the
sweep's fastest finished run and divides the pairs' throughputs."""

import os
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))  # the benchmark scripts import each other by name
import bench_lora_sft  # noqa: E402
import bench_pretrain  # noqa: E402
import bench_vlm_sft  # noqa: E402
import hf_fsdp2  # noqa: E402
import issue47_summary  # noqa: E402

STAGES = ["sweep30", "pair30", "sweep8b", "pair8b", "opg8b", "sweeplora8b", "pairlora8b", "sweeplora30", "pairlora30",
          "profile 30b", "profile 8b", "profile lora8b", "profile lora30"]
PARSERS = {"hf_fsdp2.py": hf_fsdp2.parse_args, "bench_pretrain.py": bench_pretrain.parse_args,
           "bench_lora_sft.py": bench_lora_sft.parse_args, "bench_vlm_sft.py": bench_vlm_sft.parse_args}


def dry_run(stage: str, gpus: int, tmp_path: Path, one_gpu: tuple = (),
            script: str = "benchmarks/run_issue47_gpu.sh") -> list[tuple[str, object]]:
    """The stage's commands of `script` as (script, parsed arguments); `one_gpu`: scripts run as one
    process."""
    listing = tmp_path / f"{stage.replace(' ', '_')}_{gpus}.txt"
    env = {**os.environ, "DRY_RUN": str(listing), "NGPU": str(gpus), "OUT": str(tmp_path)}
    done = subprocess.run(["bash", script, *stage.split()], cwd=ROOT, env=env,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    commands = []
    for line in listing.read_text().splitlines():
        n, script, *argv = line.split()
        assert int(n) == (1 if script in one_gpu and " hf " in f" {' '.join(argv)} " else gpus), line
        with mock.patch.dict(os.environ, {"WORLD_SIZE": n}):
            commands.append((script, PARSERS[script](argv)))  # an argparse error exits 2: the test fails
    return commands


@pytest.mark.parametrize("gpus", [2, 4])
def test_every_command_parses_and_pairs_match(gpus, tmp_path):
    for stage in STAGES:
        commands = dry_run(stage, gpus, tmp_path)
        assert commands, stage
        hf = [a for s, a in commands if s == "hf_fsdp2.py"]
        ours = [(s, a) for s, a in commands if s != "hf_fsdp2.py"]
        assert hf, stage
        for args in hf:
            assert args.precision == "mixed" and args.gbs == 8 and args.seq == 4096, stage
            assert (args.lora_rank is not None) == ("lora" in stage) == (args.data == "sft"), stage
        for script, args in ours:
            layers = args.layers or bench_pretrain.SHAPES[args.shape]["num_layers"]
            assert {(a.shape, a.layers or layers, a.gbs, a.seq) for a in hf} == {(args.shape, layers, args.gbs, args.seq)}
            if script == "bench_lora_sft.py":  # LoRA: same rank and scale, rows of one sample as HF's sft data
                assert args.samples_per_row == 1 and all(a.lora_rank == args.rank == 16 for a in hf)
                assert all(a.lora_alpha == args.alpha for a in hf)
            else:
                assert "lora" not in stage and args.impl == "lightning"
                assert (args.ep == gpus) == (args.shape == "qwen3-30b-a3b")


@pytest.mark.parametrize("gpus", [2, 4])
def test_vlm_stage_pairs_the_same_samples(gpus, tmp_path):
    """Ours data-parallel on every GPU (LoRA, TP=1), HF + peft compiled on one GPU, interleaved,
    with the same samples (text, image grid, sequence) and as many of them per step."""
    commands = dry_run("vlm", gpus, tmp_path, one_gpu=("bench_vlm_sft.py",))
    ours = [a for _, a in commands if a.what == "ours"]
    hf = [a for _, a in commands if a.what == "hf"]
    assert [a.what for _, a in commands] == ["ours", "hf"] * 2
    for args in ours:
        assert (args.dp, args.tp, args.full) == (gpus, 1, False)
    for args in hf:
        assert args.compile and args.micro_batch == 4
    assert len({(a.seq, a.text, tuple(a.grid), a.rank, a.gbs, a.steps) for a in ours + hf}) == 1


def test_summary_picks_the_fastest_run_and_divides_pairs():
    sweep = [{"impl": "hf-fsdp2", "mbs": 1, "tokens_per_s_per_gpu": 900,
              "hf": {"ac": False, "compile": True, "reshard_after_forward": True}},
             {"impl": "hf-fsdp2", "mbs": 4, "oom": True, "hf": {}},
             {"impl": "hf-fsdp2", "mbs": 2, "tokens_per_s_per_gpu": 1000,
              "hf": {"ac": True, "compile": True, "reshard_after_forward": False}}]
    assert issue47_summary.best_args(sweep) == "--mbs 2 --ac --compile --no-reshard"
    assert issue47_summary.best_args(sweep[1:2]) is None
    # checkpointing only where an uncheckpointed run did not fit, or fit crowded (137 GiB: session 30's slowest)
    plain = [{"impl": "hf-fsdp2", "mbs": 1, "peak_mem_gb": 60.0, "hf": {"ac": False}},
             {"impl": "hf-fsdp2", "mbs": 2, "oom": True, "hf": {"ac": False}},
             {"impl": "hf-fsdp2", "mbs": 2, "peak_mem_gb": 50.0, "hf": {"ac": True}}]
    assert issue47_summary.unfit(plain, [1, 2, 4]) == [2, 4]
    assert issue47_summary.unfit(plain[:1], [1, 2]) == [2]
    assert issue47_summary.unfit([{**plain[0], "mbs": 2}], [1, 2]) == []
    assert issue47_summary.unfit([{**plain[0], "mbs": 2, "peak_mem_gb": 137.0}], [1, 2]) == [1, 2]
    assert issue47_summary.unfit([], [1, 2]) == [1, 2]
    pairs = [{"label": "ours#1", "tokens_per_s_per_gpu": 6000}, {"label": "hf#1", "tokens_per_s_per_gpu": 1000},
             {"label": "ours#2", "tokens_per_s_per_gpu": 4000}, {"label": "hf#2", "tokens_per_s_per_gpu": 1000}]
    lines = issue47_summary.ratio_lines(pairs, "ours", "hf")
    assert "6.00x" in lines[0] and "4.00x" in lines[1]
    assert "geometric mean 4.899x" in lines[2]  # sqrt(6 x 4)


@pytest.mark.parametrize("gpus", [2, 4])
def test_lora30_stage_runs_the_seed_case_three_ways(gpus, tmp_path):
    """Ours only: all 48 layers of Qwen3-30B-A3B, LoRA r8 on every linear (experts too), EP over every GPU,
    the same rows each time; full, selective and no recompute, in that order."""
    commands = dry_run("lora30", gpus, tmp_path)
    assert [s for s, _ in commands] == ["bench_lora_sft.py"] * 3
    args = [a for _, a in commands]
    assert [(a.recompute, a.recompute_selective) for a in args] == [(True, False), (False, True), (False, False)]
    for a in args:
        assert (a.shape, a.layers, a.ep, a.rank, a.mbs, a.gbs, a.seq) == ("qwen3-30b-a3b", None, gpus, 8, 1, 8, 4096)
    (script, profiled), = dry_run("profile seed30", gpus, tmp_path)  # the first case, profiled
    assert script == "bench_lora_sft.py" and profiled.profile and profiled.recompute
    assert (profiled.shape, profiled.layers, profiled.ep, profiled.rank, profiled.mbs, profiled.gbs, profiled.seq,
            profiled.alpha, profiled.samples_per_row) == (a.shape, a.layers, a.ep, a.rank, a.mbs, a.gbs, a.seq,
                                                          a.alpha, a.samples_per_row)


@pytest.mark.parametrize("gpus", [2, 4])
def test_sweepours30_runs_ours_at_pair30s_shape(gpus, tmp_path):
    """Ours only, pair30's model and batch, at other micro batches and recompute choices; OURS30_EXTRA
    reaches pair30's side of ours."""
    commands = dry_run("sweepours30", gpus, tmp_path)
    assert [s for s, _ in commands] == ["bench_pretrain.py"] * 3
    args = [a for _, a in commands]
    assert [(a.mbs, a.recompute) for a in args] == [(min(4, 8 // gpus), "selective"), (min(4, 8 // gpus), "full"),
                                                    (1, None)]
    (_, pair), _ = dry_run("pair30", gpus, tmp_path)[:2]
    for a in args:
        assert (a.impl, a.shape, a.layers, a.ep, a.gbs, a.seq, a.experts) == \
            ("lightning", pair.shape, pair.layers, gpus, pair.gbs, pair.seq, "torch")
    (tmp_path / "extra").mkdir()
    with mock.patch.dict(os.environ, {"OURS30_EXTRA": "--mbs 1 --recompute full"}):
        (_, extra), _ = dry_run("pair30", gpus, tmp_path / "extra")[:2]
    assert (extra.mbs, extra.recompute) == (1, "full")


@pytest.mark.parametrize("gpus", [2, 4])
def test_lora30mbs_runs_the_seed_case_at_a_larger_micro_batch(gpus, tmp_path):
    """lora30's model, adapters and rows with full recompute at micro batch 4, then 2, where each rank's rows
    allow it."""
    (_, seed), *_ = dry_run("lora30", gpus, tmp_path)
    commands = dry_run("lora30mbs", gpus, tmp_path)
    assert [s for s, _ in commands] == ["bench_lora_sft.py"] * 2
    args = [a for _, a in commands]
    assert [(a.mbs, a.recompute, a.recompute_selective) for a in args] == [(min(4, 8 // gpus), True, False),
                                                                           (2, True, False)]
    for a in args:
        assert (a.shape, a.layers, a.ep, a.rank, a.alpha, a.gbs, a.seq, a.samples_per_row, a.experts) == \
            (seed.shape, seed.layers, seed.ep, seed.rank, seed.alpha, seed.gbs, seed.seq, seed.samples_per_row,
             seed.experts)


@pytest.mark.parametrize("gpus", [2, 4])
def test_profile_vlm_profiles_the_vlm_pair(gpus, tmp_path):
    """The vlm stage's first pair, each side with --profile into its own folder."""
    pair = dry_run("vlm", gpus, tmp_path, one_gpu=("bench_vlm_sft.py",))[:2]
    profiled = dry_run("profile vlm", gpus, tmp_path, one_gpu=("bench_vlm_sft.py",))
    assert [a.what for _, a in profiled] == [a.what for _, a in pair] == ["ours", "hf"]
    for (_, a), (_, b) in zip(profiled, pair):
        assert a.profile.endswith(f"_profile_vlm/{a.what}")
        assert {**vars(a), "profile": None} == vars(b)


def test_pair_stage_switches(tmp_path):
    """ROUNDS sets a pair stage's interleaved rounds, TP8B=0 leaves pair8b's TP=2 side out and EAGER8B=0 sweep8b's
    eager run; profile 8b profiles ours data-parallel, pair8b's side that stays."""
    full = dry_run("pair8b", 2, tmp_path)
    assert [(s, getattr(a, "tp", None)) for s, a in full] == [("bench_pretrain.py", 2), ("bench_pretrain.py", 1),
                                                              ("hf_fsdp2.py", None)] * 2
    sweep = dry_run("sweep8b", 2, tmp_path)
    (tmp_path / "cut").mkdir()
    with mock.patch.dict(os.environ, {"ROUNDS": "1", "TP8B": "0", "EAGER8B": "0"}):
        cut = dry_run("pair8b", 2, tmp_path / "cut")
        assert [s for s, _ in dry_run("pair30", 2, tmp_path / "cut")] == ["bench_pretrain.py", "hf_fsdp2.py"]
        assert [vars(a) for _, a in dry_run("sweep8b", 2, tmp_path / "cut")] == [vars(a) for _, a in sweep[:-1]]
    assert [vars(a) for _, a in cut] == [vars(a) for _, a in full[1:3]]
    assert not sweep[-1][1].compile
    (_, ours), _ = dry_run("profile 8b", 2, tmp_path)
    assert ours.profile and {**vars(ours), "profile": False, "steps": 0, "warmup": 0} == \
        {**vars(cut[0][1]), "profile": False, "steps": 0, "warmup": 0}


def test_opg8b_differs_from_pair8b_by_the_overlapped_gather_only(tmp_path):
    """Ours without, then with --overlap-param-gather, both listing their losses, else pair8b's ours; then HF."""
    (_, ours), (_, hf) = dry_run("pair8b", 2, tmp_path)[1:3]
    commands = dry_run("opg8b", 2, tmp_path)
    assert [s for s, _ in commands] == ["bench_pretrain.py", "bench_pretrain.py", "hf_fsdp2.py"]
    (_, plain), (_, opg), (_, hf2) = commands
    assert plain.losses and opg.losses and not plain.overlap_param_gather and opg.overlap_param_gather
    assert {**vars(opg), "overlap_param_gather": False} == vars(plain) == {**vars(ours), "losses": True}
    assert vars(hf2) == vars(hf)
    with pytest.raises(SystemExit):
        bench_pretrain.parse_args(["--impl", "raw", "--overlap-param-gather"])

