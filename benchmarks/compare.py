"""Issue 9's benchmark cases in one run: each implementation of a case on the same shape and
batches (bench_pretrain.py under torchrun), then a table with tokens/s/GPU, MFU, peak memory
and the ratios against the raw mcore loop and HF transformers.

    python benchmarks/compare.py --cases 1b fp8 --out results.jsonl
    python benchmarks/compare.py --cases all

Interleaved pairs over two calls, summarised together (geometric mean and 95% interval):

    python benchmarks/compare.py --cases moe-ep2-late --repeat 3 --out a.jsonl
    python benchmarks/compare.py --cases moe-ep2-late --repeat 2 --first-repeat 4 --reference a.jsonl --out b.jsonl

Cases needing more GPUs than the machine has are skipped with a note.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from pairs import pair_lines

HERE = Path(__file__).parent

# the MoE cases' model and batches: a small Qwen3-MoE at EP=2, micro batch 1 x 4 per rank
_MOE = "--shape qwen3-moe-small --ep 2 --mbs 1 --gbs 8 --steps 16 --warmup 6"

# issue 20's one-GPU MoE runs: the moe shape's first 6 layers, EP=1, global batch 8
_MOE1 = "--shape qwen3-moe-small --layers 6 --gbs 8 --steps 14 --warmup 6"
_FUSED = "--set moe_permute_fusion=true --set moe_router_fusion=true"
# issue 20's EP=2 settings: the moe case's shape and global batch, micro batch 4 (one per rank and
# step), the fusions and torch's experts (at EP=2 only the expert GEMMs change)
_MOE2_RUN = f"--shape qwen3-moe-small --ep 2 --mbs 4 --gbs 8 {_FUSED} --experts torch"
_MOE2 = f"{_MOE2_RUN} --steps 16 --warmup 6"
# 4 of Qwen3-30B-A3B's layers on one GPU, micro batch 4, the fusions and torch's experts
_MOE30B = f"--shape qwen3-30b-a3b --layers 4 --gbs 8 --mbs 4 {_FUSED} --experts torch"
# raw mcore, raw held until backward ends (--sync-before-update), lightning: (impl, label, flag)
_WAIT_ROWS = (("raw", "raw-mbs4-fused-torch", ""), ("raw", "raw-wait-mbs4-fused-torch", " --sync-before-update"),
              ("lightning", "lightning-mbs4-fused-torch", ""))
# and lightning with on_nonfinite="stop_after_update" (its check read while the update runs)
_LATE_ROWS = (*_WAIT_ROWS, ("lightning", "lightning-late-mbs4-fused-torch", " --check-after-update"))
_GRAPHS = "--cuda-graphs attn,moe_router,moe_preprocess"

# case -> [(gpus, label, bench_pretrain.py arguments)]
CASES = {
    "1b": [  # 1.2B Llama shape, seq 4096, 1 GPU
        (1, "raw", "--impl raw --mbs 4"),
        (1, "lightning", "--impl lightning --mbs 4"),
        (1, "raw-nofuse", "--impl raw --mbs 4 --no-wgrad-fusion"),
        (1, "hf-eager", "--impl hf-eager --mbs 1"),
        (1, "hf-compile", "--impl hf-compile --mbs 1"),
    ],
    "1b-gbs32": [  # the 1b case with 8 microbatches per step: the optimizer step amortised
        (1, "raw", "--impl raw --mbs 4 --gbs 32 --steps 16 --warmup 6"),
        (1, "lightning", "--impl lightning --mbs 4 --gbs 32 --steps 16 --warmup 6"),
    ],
    # 3B shape: bf16 vs FP8 (delayed, current), micro batch 1 (2 does not fit in 80 GB with fp32 Adam state),
    # 200 steps on real text (vocab 32768):
    # speed and the loss curve from the same runs
    "fp8": [
        (1, label, "--impl lightning --shape llama-3b --mbs 1 --gbs 4 --steps 200 --warmup 20 "
                   f"--lr 3e-4 --lr-warmup 20 --losses --data {{text}}{flag}")
        for label, flag in (("bf16", ""), ("fp8-delayed", " --fp8 delayed"), ("fp8-current", " --fp8 current"),
                            # delayed scaling with NeMo's amax history (1024 steps, max) instead of mcore's 1
                            ("fp8-delayed-h1024", " --fp8 delayed --fp8-amax 1024:max"))
    ],
    # FP8 speed at micro batch 2, where the GPU rather than the host sets the pace; all three fit
    # in 80 GB when the first 12 of the 28 layers recompute their forward (mcore's block method)
    "fp8-speed": [
        (1, label, f"--impl lightning --shape llama-3b --mbs 2 --gbs 8 --steps 14 --warmup 6 --recompute full "
                   f"--recompute-block 12 --data {{text}}{flag}")
        for label, flag in (("bf16", ""), ("fp8-delayed", " --fp8 delayed"), ("fp8-current", " --fp8 current"))
    ],
    "fp8-speed-mbs4": [  # micro batch 4, every layer recomputed: the GPU-bound end
        (1, label, f"--impl lightning --shape llama-3b --mbs 4 --gbs 8 --steps 12 --warmup 5 --recompute full "
                   f"--data {{text}}{flag}")
        for label, flag in (("bf16", ""), ("fp8-delayed", " --fp8 delayed"), ("fp8-current", " --fp8 current"))
    ],
    "fp8-profile": [  # where the time goes: torch.profiler tables of steps 10-12 (in the .log)
        (1, label, f"--impl lightning --shape llama-3b --mbs 1 --gbs 4 --steps 13 --warmup 10 --profile "
                   f"--data {{text}}{flag}")
        for label, flag in (("bf16", ""), ("fp8-delayed", " --fp8 delayed"), ("fp8-current", " --fp8 current"))
    ],
    "8b-tp2": [  # Llama-3-8B shape, TP=2 + SP, 2 GPUs
        (2, "raw", "--impl raw --shape llama-8b --tp 2 --mbs 1 --gbs 8 --steps 14 --warmup 6"),
        (2, "lightning", "--impl lightning --shape llama-8b --tp 2 --mbs 1 --gbs 8 --steps 14 --warmup 6"),
    ],
    "tp2-pyprofile": [  # host-side Python time per function (cProfile, rank 0, steps 10-12), 1.2B TP=2+SP
        (2, "raw", "--impl raw --tp 2 --mbs 1 --gbs 8 --steps 13 --warmup 10 --pyprofile"),
        (2, "lightning", "--impl lightning --tp 2 --mbs 1 --gbs 8 --steps 13 --warmup 10 --pyprofile"),
    ],
    "dp4": [  # data-parallel scaling: 1 GPU vs DP=4 at the same per-GPU batch
        (1, "lightning-1gpu", "--impl lightning --mbs 4 --gbs 8"),
        (4, "lightning-dp4", "--impl lightning --mbs 4 --gbs 32"),
        (4, "raw-dp4", "--impl raw --mbs 4 --gbs 32"),
    ],
    "pp2-vpp": [  # 3B shape, PP=2 with 2 virtual stages per rank, 2 GPUs
        (2, "raw", "--impl raw --shape llama-3b --pp 2 --vpp 2 --mbs 1 --gbs 16 --steps 20 --warmup 8"),
        (2, "lightning", "--impl lightning --shape llama-3b --pp 2 --vpp 2 --mbs 1 --gbs 16 --steps 20 --warmup 8"),
    ],
    "cp2": [  # 1.2B shape, CP=2 at seq 16k, 2 GPUs
        (2, "raw", "--impl raw --cp 2 --seq 16384 --mbs 1 --gbs 4 --steps 16 --warmup 6 --losses"),
        (2, "lightning", "--impl lightning --cp 2 --seq 16384 --mbs 1 --gbs 4 --steps 16 --warmup 6 --losses"),
    ],
    "moe": [  # small Qwen3-MoE, EP=2, grouped GEMM, alltoall dispatcher, 2 GPUs
        (2, "raw", f"--impl raw {_MOE}"),
        (2, "lightning", f"--impl lightning {_MOE}"),
    ],
    "moe-devid": [  # the raw loop with Lightning's process-group init (device_id bound) against without
        (2, "raw", f"--impl raw {_MOE}"),
        (2, "raw-devid", f"--impl raw {_MOE} --nccl-device-id"),
    ],
    # bisect: Lightning builds the model inside torch.device(cuda) (Strategy.tensor_init_context),
    # the raw loop outside it; each loop the other way round
    "moe-initdev": [
        (2, "raw", f"--impl raw {_MOE}"),
        (2, "lightning", f"--impl lightning {_MOE}"),
        (2, "raw-initdev", f"--impl raw {_MOE} --init-device-context"),
        (2, "lightning-noinitdev", f"--impl lightning {_MOE} --no-init-device-context"),
    ],
    "moe-pinned": [  # the moe case with each rank's process pinned to its own half of the CPUs
        (2, "raw", f"--impl raw {_MOE} --pin-cpus"),
        (2, "lightning", f"--impl lightning {_MOE} --pin-cpus"),
    ],
    # a fixed expert capacity with padding: static shapes, no per-layer device-to-host sync
    "moe-capacity": [
        (2, "raw", f"--impl raw {_MOE} --moe-capacity 1.0"),
        (2, "lightning", f"--impl lightning {_MOE} --moe-capacity 1.0"),
    ],
    "moe-profile": [  # torch.profiler tables of steps 10-12 on every rank (profiles/moe-profile_LABEL/)
        (2, "raw", "--impl raw --shape qwen3-moe-small --ep 2 --mbs 1 --gbs 8 --steps 13 --warmup 10 --profile"),
        (2, "lightning", "--impl lightning --shape qwen3-moe-small --ep 2 --mbs 1 --gbs 8 --steps 13 --warmup 10 "
                         "--profile"),
    ],
    # issue 20 on one GPU: the 1b case's levers (CUDA graphs of whole layers) and where its time goes
    "1b-levers": [
        (1, "lightning", "--impl lightning --mbs 4"),
        (1, "lightning-graphs", "--impl lightning --mbs 4 --cuda-graphs layer"),
        (1, "raw-graphs", "--impl raw --mbs 4 --cuda-graphs layer"),
    ],
    "1b-profile": [(1, "lightning", "--impl lightning --mbs 4 --steps 13 --warmup 10 --profile")],
    # the moe shape's first 6 layers on one GPU (EP=1; 2.6B parameters): micro batch, mcore's
    # permute and router fusions, CUDA graphs of what dropless MoE can capture
    "moe-1gpu": [
        (1, "raw-mbs1", f"--impl raw {_MOE1} --mbs 1"),
        (1, "raw-mbs4", f"--impl raw {_MOE1} --mbs 4"),
        (1, "raw-mbs4-fused", f"--impl raw {_MOE1} --mbs 4 {_FUSED}"),
        (1, "raw-mbs4-fused-graphs", f"--impl raw {_MOE1} --mbs 4 {_FUSED} {_GRAPHS}"),
        (1, "lightning-mbs4-fused-graphs", f"--impl lightning {_MOE1} --mbs 4 {_FUSED} {_GRAPHS}"),
        (1, "raw-mbs2-fused-graphs", f"--impl raw {_MOE1} --mbs 2 {_FUSED} {_GRAPHS}"),
    ],
    # HF transformers at its best on the 1b shape (hf_baseline.py: loss in the model, mask-free causal
    # SDPA, dynamic=False): micro batch 1/2/4, eager and compiled, fp32 master weights + bf16 autocast
    # (amp, precision-matched with mcore) and pure bf16 (compiled)
    "hf-sweep": [
        (1, f"hf-{kind}-mbs{mbs}", f"--impl hf-{kind} --mbs {mbs}")
        for kind in ("eager", "compile") for mbs in (1, 2, 4)
    ] + [(1, f"hf-compile-mbs{mbs}-bf16", f"--impl hf-compile --mbs {mbs} --hf-dtype bf16") for mbs in (2, 4)],
    # HF's own Qwen3-MoE (grouped_mm experts, no aux loss) on moe-1gpu's shape and batches; in amp
    # the experts run in fp32 (grouped_mm is not autocast; compiled, through transformers' fallback
    # op, whose backward inductor cannot compile in transformers 5.17/5.18, fixed by 5.23: then
    # RESULT hf.unique_graphs > 1), so pure bf16 runs too
    "moe-1gpu-hf": [
        (1, f"hf-{kind}-mbs{mbs}{tag}", f"--impl hf-{kind} {_MOE1} --mbs {mbs}{flag}")
        for tag, flag in (("", ""), ("-bf16", " --hf-dtype bf16"))
        for kind in ("eager", "compile") for mbs in (1, 2, 4)
    ],
    # the next GPU session's MoE levers, each against moe-1gpu's raw-mbs4: the graphs with TE's RNG
    # tracker, Megatron-LM's manual garbage collection, and lightning against raw with both
    "moe-1gpu-next": [
        (1, "raw-mbs4", f"--impl raw {_MOE1} --mbs 4"),
        (1, "raw-mbs4-graphs", f"--impl raw {_MOE1} --mbs 4 {_GRAPHS}"),
        (1, "raw-mbs4-gc", f"--impl raw {_MOE1} --mbs 4 --manual-gc 10"),
        (1, "raw-mbs4-graphs-gc", f"--impl raw {_MOE1} --mbs 4 {_GRAPHS} --manual-gc 10"),
        (1, "lightning-mbs4-graphs-gc", f"--impl lightning {_MOE1} --mbs 4 {_GRAPHS} --manual-gc 10"),
    ],
    # torch's grouped GEMM with the counts on the GPU (model/torch_experts.py), needing permute
    # fusion to stay off the host, against TE's on the same settings, then with manual GC
    "moe-1gpu-torch": [
        (1, "raw-mbs4-fused", f"--impl raw {_MOE1} --mbs 4 {_FUSED}"),
        (1, "raw-mbs4-fused-torch", f"--impl raw {_MOE1} --mbs 4 {_FUSED} --experts torch"),
        (1, "lightning-mbs4-fused-torch", f"--impl lightning {_MOE1} --mbs 4 {_FUSED} --experts torch"),
        (1, "raw-mbs4-fused-torch-gc", f"--impl raw {_MOE1} --mbs 4 {_FUSED} --experts torch --manual-gc 10"),
        (1, "raw-mbs2-fused-torch-gc", f"--impl raw {_MOE1} --mbs 2 {_FUSED} --experts torch --manual-gc 10"),
    ],
    # Qwen3-30B-A3B's own layer shape (128 experts, top-8), 4 layers on one GPU, TE's and torch's experts
    "moe30b-1gpu": [
        (1, f"raw-mbs{mbs}-fused{tag}", f"--impl raw --shape qwen3-30b-a3b --layers 4 --gbs 8 --steps 14 "
                                         f"--warmup 6 --mbs {mbs} {_FUSED}{flag}")
        for mbs, tag, flag in ((2, "", ""), (2, "-torch", " --experts torch"), (4, "-torch", " --experts torch"))
    ] + [(1, "lightning-mbs4-fused-torch", f"--impl lightning {_MOE30B} --steps 14 --warmup 6")],
    # CUDA graphs of attention and router (TE's RNG tracker) on top of torch's experts
    "moe-1gpu-torch-graphs": [
        (1, f"{impl}-mbs4-fused-torch-graphs", f"--impl {impl} {_MOE1} --mbs 4 {_FUSED} --experts torch "
                                               f"--cuda-graphs attn,moe_router")
        for impl in ("raw", "lightning")
    ],
    "moe-1gpu-torch-profile": [  # where lightning's step differs from raw's (profiles/moe-1gpu-torch-profile_LABEL/)
        (1, f"{impl}-mbs4-fused-torch{tag}", f"--impl {impl} {_MOE1} --mbs 4 {_FUSED} --experts torch --steps 13 "
                                             f"--warmup 10 {flag}")
        for tag, flag in (("", "--profile"), ("-py", "--pyprofile")) for impl in ("raw", "lightning")
    ],
    # TE's FusedAdam holding the master weights (OptimizerSettings.precision_aware, the GPU default)
    # against mcore's own fp32 copies, raw and lightning; "-pairs" for interleaved repeats
    "moe-1gpu-precision-aware": [
        (1, f"{impl}-mbs4-fused-torch{tag}", f"--impl {impl} {_MOE1} --mbs 4 {_FUSED} --experts torch{flag}")
        for tag, flag in (("-copies", " --no-precision-aware"), ("", "")) for impl in ("raw", "lightning")
    ],
    "moe-1gpu-precision-aware-pairs": [
        (1, f"{impl}-mbs4-fused-torch", f"--impl {impl} {_MOE1} --mbs 4 {_FUSED} --experts torch")
        for impl in ("raw", "lightning")
    ],
    "1b-precision-aware": [
        (1, f"lightning-mbs4{tag}", f"--impl lightning --mbs 4{flag}")
        for tag, flag in (("-copies", " --no-precision-aware"), ("", ""))
    ],
    "moe30b-1gpu-precision-aware": [
        (1, f"{impl}-mbs4-fused-torch", f"--impl {impl} {_MOE30B} --steps 14 --warmup 6")
        for impl in ("raw", "lightning")
    ],
    # lightning's allocator retries at the 30B shape (raw has none at the same peak): where its
    # memory goes, with the model built inside torch.device(cuda) (Lightning's way) and outside;
    # lightning as measured then, its process group bound to the device (before session 10's fix)
    "moe30b-1gpu-memory": [
        (1, f"{impl}-mbs4-fused-torch{tag}", f"--impl {impl} {_MOE30B} --steps 14 --warmup 6{flag}")
        for impl, tag, flag in (("raw", "", ""), ("lightning", "", " --nccl-device-id"),
                                ("lightning", "-noinitdev", " --nccl-device-id --no-init-device-context"))
    ],
    # the same, bisecting the process-group start: bound to the device (device_id, Lightning's
    # DDPStrategy), every mcore group opens its NCCL communicator at once; unbound (the raw loop,
    # and MegatronStrategy since session 10) each opens at its first collective
    "moe30b-1gpu-nccl": [
        (1, f"{impl}-mbs4-fused-torch{tag}", f"--impl {impl} {_MOE30B} --steps 14 --warmup 6{flag}")
        for impl, tag, flag in (("raw", "", ""), ("raw", "-devid", " --nccl-device-id"),
                                ("lightning", "-devid", " --nccl-device-id"), ("lightning", "", ""))
    ],
    "moe30b-1gpu-profile": [  # where lightning's step differs from raw's at the 30B shape (profiles/..._LABEL/)
        (1, f"{impl}-mbs4-fused-torch{tag}", f"--impl {impl} {_MOE30B} --steps 13 --warmup 10 {flag}")
        for tag, flag in (("", "--profile"), ("-py", "--pyprofile")) for impl in ("raw", "lightning")
    ],
    # session 11: lightning's step waits for the GPU once (the update's check), and the timer only
    # at the window's ends (--free-running), so the host runs ahead between steps as in a real run
    "moe30b-1gpu-free": [
        (1, f"{impl}-mbs4-fused-torch", f"--impl {impl} {_MOE30B} --steps 14 --warmup 7 --free-running")
        for impl in ("raw", "lightning")
    ],
    "moe-1gpu-free": [
        (1, f"{impl}-mbs4-fused-torch", f"--impl {impl} --shape qwen3-moe-small --layers 6 --gbs 8 --steps 14 "
                                        f"--warmup 7 --mbs 4 {_FUSED} --experts torch --free-running")
        for impl in ("raw", "lightning")
    ],
    "moe-ep2-free": [  # _MOE2 with 8 timed steps: the throughput callback's window (8) divides the 16
        (2, f"{impl}-mbs4-fused-torch", f"--impl {impl} {_MOE2_RUN} --steps 16 --warmup 8 --free-running")
        for impl in ("raw", "lightning")
    ],
    # what the wait before the update costs: raw mcore with the host held until backward ends
    "moe-ep2-wait": [(2, label, f"--impl {impl} {_MOE2}{flag}") for impl, label, flag in _WAIT_ROWS],
    "moe30b-1gpu-wait": [(1, label, f"--impl {impl} {_MOE30B} --steps 14 --warmup 6{flag}")
                         for impl, label, flag in _WAIT_ROWS],
    # session 12: the same with lightning's check read while the update runs
    "moe30b-1gpu-late": [(1, label, f"--impl {impl} {_MOE30B} --steps 14 --warmup 6{flag}")
                         for impl, label, flag in _LATE_ROWS],
    "moe-ep2-late": [(2, label, f"--impl {impl} {_MOE2}{flag}") for impl, label, flag in _LATE_ROWS],
    # torch.profiler over steps 10-12 (profiles/<case>_<label>/rank0.txt): the GPU's idle gaps of
    # raw, lightning and lightning with stop_after_update
    "moe30b-1gpu-late-profile": [(1, label, f"--impl {impl} {_MOE30B} --steps 13 --warmup 10 --profile{flag}")
                                 for impl, label, flag in _LATE_ROWS if "wait" not in label],
    # torch.profiler over steps 10-12 on both ranks (profiles/<case>_<label>/rank{0,1}.txt): kernel
    # tables and the GPU's idle gaps, named by the kernels on either side
    "moe-ep2-profile": [
        (2, f"{impl}-mbs4-fused-torch", f"--impl {impl} {_MOE2_RUN} --steps 13 --warmup 10 --profile")
        for impl in ("raw", "lightning")
    ],
    "moe-ep2-pairs": [(2, f"{impl}-mbs4-fused-torch", f"--impl {impl} {_MOE2}") for impl in ("raw", "lightning")],
    "moe30b-ep2": [  # 8 layers of Qwen3-30B-A3B at EP=2 (64 experts per GPU), micro batch 4
        (2, f"{impl}-mbs4-fused-torch", f"--impl {impl} --shape qwen3-30b-a3b --layers 8 --ep 2 --gbs 8 "
                                        f"--steps 14 --warmup 6 --mbs 4 {_FUSED} --experts torch")
        for impl in ("raw", "lightning")
    ],
    "moe-1gpu-profile": [
        (1, "raw-mbs4-fused-graphs", f"--impl raw {_MOE1} --mbs 4 {_FUSED} {_GRAPHS} --steps 13 --warmup 10 --profile"),
    ],
}


def run(gpus: int, args: str, log, alloc_conf: str, profile_dir: Path) -> dict | None:
    cmd = ["torchrun", "--standalone", f"--nproc-per-node={gpus}", str(HERE / "bench_pretrain.py"), *args.split()]
    env = {**os.environ, "CUDA_DEVICE_MAX_CONNECTIONS": "1", "PYTHONPATH": f"{HERE}:{os.environ.get('PYTHONPATH', '')}",
           "PYTORCH_CUDA_ALLOC_CONF": alloc_conf, "BENCH_PROFILE_DIR": str(profile_dir)}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    log.write(f"$ {' '.join(cmd)}\n{proc.stdout}\n{proc.stderr}\n")
    log.flush()
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    print(f"  failed (rc {proc.returncode}): {proc.stderr.strip().splitlines()[-1:] }", flush=True)
    return None


def summarize(case: str, results: dict) -> None:
    print(f"\n== {case}")
    print(f"{'run':16} {'tok/s/GPU':>10} {'MFU':>7} {'callback MFU':>13} {'mem GiB':>8} {'device GiB':>11} "
          f"{'retries':>8} {'host ms/step per rank':>22} {'gc ms':>6} {'final loss':>10}")
    for label, r in results.items():
        cb = r.get("callback", {}).get("perf/mfu")
        loss = r["losses"][-1] if r.get("losses") else None
        ranks = r.get("ranks", [])
        host = "/".join(f"{x['host_ms']:.0f}" for x in ranks)
        gc_ms = max((x["gc_ms"] for x in ranks), default=0)
        print(f"{label:16} {r['tokens_per_s_per_gpu']:>10} {100 * r['mfu']:>6.1f}% "
              f"{(f'{cb:.1f}%' if cb is not None else '-'):>13} {r['peak_mem_gb']:>8} "
              f"{r.get('device_used_gb', '-'):>11} {r.get('alloc_retries', '-'):>8} {host:>22} {gc_ms:>6} "
              f"{(f'{loss:.4f}' if loss is not None else '-'):>10}")
    tok = {k: r["tokens_per_s_per_gpu"] for k, r in results.items()}
    pairs = [("lightning", "raw"), ("raw", "raw-nofuse"), ("lightning", "hf-compile"), ("lightning", "hf-eager"),
             ("raw-devid", "raw"), ("raw-initdev", "raw"), ("lightning-noinitdev", "lightning"),
             ("lightning-noinitdev", "raw"), ("lightning", "raw-initdev"),
             ("fp8-delayed", "bf16"), ("fp8-current", "bf16"), ("fp8-delayed-h1024", "bf16"),
             ("lightning-dp4", "lightning-1gpu"), ("raw-dp4", "lightning-1gpu"),
             ("lightning-mbs4-fused-torch", "raw-wait-mbs4-fused-torch"),
             ("raw-wait-mbs4-fused-torch", "raw-mbs4-fused-torch"),
             ("lightning-late-mbs4-fused-torch", "raw-mbs4-fused-torch"),
             ("lightning-late-mbs4-fused-torch", "lightning-mbs4-fused-torch")]
    # any "lightning-X" against its "raw-X"
    pairs = list(dict.fromkeys(pairs + [(k.partition("#")[0], "raw-" + k.partition("#")[0][len("lightning-"):])
                                        for k in tok if k.startswith("lightning-")]))
    repeats = sorted({k.partition("#")[2] for k in tok})
    for suffix in repeats:
        for a, b in pairs:
            a_, b_ = (f"{a}#{suffix}", f"{b}#{suffix}") if suffix else (a, b)
            if a_ in tok and b_ in tok:
                print(f"  {a_} / {b_}: {tok[a_] / tok[b_]:.3f}x")
    if len(repeats) > 1:  # interleaved pairs: each pair's geometric mean and interval (pairs.py)
        for a, b in pairs:
            for line in pair_lines(a, b, results):
                print(line)
    for a in ("fp8-delayed", "fp8-current", "fp8-delayed-h1024"):
        if a in results and "bf16" in results and results[a].get("losses"):
            tail = lambda r: sum(r["losses"][-20:]) / 20  # noqa: E731  mean of the last 20 steps
            rel = tail(results[a]) / tail(results["bf16"]) - 1
            print(f"  {a} loss (mean of last 20 steps) vs bf16: {100 * rel:+.2f}%")
    if "raw" in results and "lightning" in results and results["raw"].get("losses") and results["lightning"].get("losses"):
        diff = max(abs(x - y) for x, y in zip(results["raw"]["losses"], results["lightning"]["losses"]))
        print(f"  raw vs lightning losses, largest difference over the steps: {diff:.2e}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", nargs="+", default=["all"], choices=["all", *CASES])
    ap.add_argument("--out", default=os.environ.get("OUT", ".") + "/bench_results.jsonl")
    ap.add_argument("--only", nargs="*", default=None, help="run only these labels of the cases")
    ap.add_argument("--text", default=".bench_data/text",
                    help="real_text.py output (built if missing: stdlib + torch sources, 2000 files)")
    ap.add_argument("--reference", default=None,
                    help="a previous --out .jsonl: its runs of the same cases join the tables (e.g. the bf16 curve)")
    ap.add_argument("--repeat", type=int, default=1, help="run each case's list this many times, interleaved")
    ap.add_argument("--first-repeat", type=int, default=1,
                    help="number the repeats from this one (labels #N), to go on from an earlier call whose "
                         "--out is given as --reference: its pairs and these are summarised together")
    ap.add_argument("--alloc-conf", default="expandable_segments:True", help="PYTORCH_CUDA_ALLOC_CONF for every run")
    args = ap.parse_args()
    cases = list(CASES) if "all" in args.cases else args.cases
    gpus = torch.cuda.device_count()
    needs_text = {"fp8", "fp8-profile", "fp8-speed", "fp8-speed-mbs4"} & set(cases)
    if needs_text and not Path(args.text, "tokens.npy").exists():
        subprocess.run([sys.executable, str(HERE / "real_text.py"), "--out", args.text, "--packages", "torch",
                        "--max-files", "2000"], check=True)
    out = open(args.out, "a")
    log = open(Path(args.out).with_suffix(".log"), "a")
    reference = [json.loads(line) for line in open(args.reference)] if args.reference else []
    for case in cases:
        results = {r["label"]: r for r in reference if r.get("case") == case}
        for i, (need, label, bench_args) in enumerate(CASES[case] * args.repeat):
            repeat = i // len(CASES[case]) + args.first_repeat
            if repeat > 1:
                label = f"{label}#{repeat}"
            if args.only and label.split("#")[0] not in args.only:
                continue
            if need > gpus:
                print(f"{case}/{label}: skipped, needs {need} GPUs (have {gpus})", flush=True)
                continue
            print(f"{case}/{label} ...", flush=True)
            r = run(need, bench_args.format(text=args.text), log, args.alloc_conf,
                    Path(args.out).parent / "profiles" / f"{case}_{label.replace('#', '-')}")
            if r is not None:
                r.update(case=case, label=label, alloc_conf=args.alloc_conf)
                out.write(json.dumps(r) + "\n")
                out.flush()
                results[label] = r
        summarize(case, results)


if __name__ == "__main__":
    main()
