"""benchmarks/run_issue50_gpu.sh, dry-run on CPU: every command parses with bench_pretrain.py's own
argument parser and runs the layout issue 50 asks of a 4-GPU machine: Qwen3-30B-A3B at half depth at
TP=2 + SP x EP=2 and PP=2 x EP=2, Llama-3-8B at TP=2 x PP=2, full fine-tuning on real text with every
step's loss, each layout dividing the 4 GPUs."""

from test_run_issue47_gpu import dry_run


def commands(stage: str, tmp_path) -> list:
    """The stage's bench_pretrain.py arguments, each command on all 4 GPUs (dry_run checks the count)."""
    found = dry_run(stage, 4, tmp_path, script="benchmarks/run_issue50_gpu.sh")
    assert found and {script for script, _ in found} == {"bench_pretrain.py"}, found
    return [args for _, args in found]


def test_layouts_are_issue_50s_at_half_size(tmp_path):
    moe = commands("moe30b", tmp_path)
    assert [(a.tp, a.pp, a.ep, a.no_sp) for a in moe] == [(2, 1, 2, False), (1, 2, 2, False)]
    for a in moe:
        assert (a.shape, a.layers, a.experts, a.recompute) == ("qwen3-30b-a3b", 24, "torch", "full")
    (dense,) = commands("dense8b", tmp_path)
    assert (dense.shape, dense.layers, dense.tp, dense.pp, dense.ep) == ("llama-8b", None, 2, 2, 1)
    for a in moe + [dense]:
        assert a.impl == "lightning" and a.losses and a.data == "/tmp/text" and a.seq == 4096
        assert a.gbs % (4 // (a.tp * a.pp)) == 0 and a.steps > a.warmup
