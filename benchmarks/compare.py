"""The named workloads that run bench_pretrain.py (benchmarks/workloads.py, the rows of the table at
the top of RESULTS.md): each implementation on the same shape and batches (under torchrun), then a
table with tokens/s/GPU, MFU, peak memory and the workload's ratio.

    python benchmarks/compare.py --cases dense-1b-raw --out results.jsonl
    python benchmarks/compare.py --cases all

Interleaved pairs over two calls, summarised together (geometric mean and 95% interval):

    python benchmarks/compare.py --cases moe-ep2 --repeat 3 --out a.jsonl
    python benchmarks/compare.py --cases moe-ep2 --repeat 2 --first-repeat 4 --reference a.jsonl --out b.jsonl

Workloads needing more GPUs than the machine has are skipped with a note. The one-off cases of
issues 9 and 20 that the dated notes of RESULTS.md name (fp8, profiles, bisects) are in
`git show e394ace:benchmarks/compare.py`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
from pathlib import Path

import torch
from pairs import pair_lines
from workloads import BY_NAME, WORKLOADS

HERE = Path(__file__).parent

# workload -> [(gpus, label, bench_pretrain.py arguments)]
CASES = {w.name: [(r.gpus, r.label, r.args) for r in w.runs] for w in WORKLOADS if w.runs}


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
    workload = BY_NAME[case]
    a, b = workload.ours.reading.where["label"], workload.baseline.reading.where["label"]
    repeats = sorted({k.partition("#")[2] for k in results})
    for suffix in repeats:
        a_, b_ = (f"{a}#{suffix}", f"{b}#{suffix}") if suffix else (a, b)
        if a_ in results and b_ in results:
            print(f"  {a_} / {b_}: {results[a_]['tokens_per_s_per_gpu'] / results[b_]['tokens_per_s_per_gpu']:.3f}x")
    if len(repeats) > 1:  # interleaved pairs: their geometric mean and interval (pairs.py)
        for line in pair_lines(a, b, results):
            print(line)
    if a in results and b in results and results[a].get("losses") and results[b].get("losses"):
        diff = max(abs(x - y) for x, y in zip(results[a]["losses"], results[b]["losses"]))
        print(f"  {a} vs {b} losses, largest difference over the steps: {diff:.2e}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", nargs="+", default=["all"], choices=["all", *CASES])
    ap.add_argument("--out", default=os.environ.get("OUT", ".") + "/bench_results.jsonl")
    ap.add_argument("--only", nargs="*", default=None, help="run only these labels of the cases")
    ap.add_argument("--reference", default=None,
                    help="a previous --out .jsonl: its runs of the same cases join the tables")
    ap.add_argument("--repeat", type=int, default=1, help="run each case's list this many times, interleaved")
    ap.add_argument("--first-repeat", type=int, default=1,
                    help="number the repeats from this one (labels #N), to go on from an earlier call whose "
                         "--out is given as --reference: its pairs and these are summarised together")
    ap.add_argument("--alloc-conf", default="expandable_segments:True", help="PYTORCH_CUDA_ALLOC_CONF for every run")
    args = ap.parse_args()
    cases = list(CASES) if "all" in args.cases else args.cases
    gpus = torch.cuda.device_count()
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
            r = run(need, bench_args, log, args.alloc_conf,
                    Path(args.out).parent / "profiles" / f"{case}_{label.replace('#', '-')}")
            if r is not None:
                r.update(case=case, label=label, alloc_conf=args.alloc_conf)
                out.write(json.dumps(r) + "\n")
                out.flush()
                results[label] = r
        summarize(case, results)


if __name__ == "__main__":
    main()
