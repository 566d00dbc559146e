"""Issue 47's JSON lines (run_issue47_gpu.sh: each a RESULT line with its "label"): the baseline
sweep's fastest settings, as hf_fsdp2.py arguments, and the interleaved pairs' ratios, ours per GPU
over HF + FSDP2's.

    python benchmarks/issue47_summary.py best s26_sweep30.jsonl --fallback "--mbs 2 --ac --compile"
    python benchmarks/issue47_summary.py unfit s31_sweep8b.jsonl --mbs 1,2,4
    python benchmarks/issue47_summary.py ratios s26_pair30.jsonl --ours ours-ep2 --hf hf
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from pairs import pair_lines


def read(path: str) -> list[dict]:
    """The file's results; none when it does not exist (a stage that did not run)."""
    p = Path(path)
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()] if p.exists() else []


def best_args(results: list[dict]) -> str | None:
    """hf_fsdp2.py's arguments for its fastest finished run (micro batch, checkpointing,
    compilation, resharding); None without one."""
    done = [r for r in results if r.get("impl") == "hf-fsdp2" and not r.get("oom")]
    if not done:
        return None
    best = max(done, key=lambda r: r["tokens_per_s_per_gpu"])
    hf = best["hf"]
    flags = [f"--mbs {best['mbs']}", "--ac" if hf["ac"] else "", "--compile" if hf["compile"] else "",
             "" if hf["reshard_after_forward"] else "--no-reshard"]
    return " ".join(f for f in flags if f)


# A run that peaked above this (of an H200's 139 GiB) pays for it: the allocator frees and retries (session 30's
# sweeplora30 at micro batch 4 without checkpointing: 137.0 GiB, half the speed of micro batch 2).
CROWDED_GIB = 128


def unfit(results: list[dict], mbs: list[int]) -> list[int]:
    """The micro batches of `mbs` above the largest that an uncheckpointed run finished in room:
    where activation checkpointing may buy a larger micro batch (at one that fits without it, it only
    adds a forward)."""
    fit = [r["mbs"] for r in results if r.get("impl") == "hf-fsdp2" and not r.get("oom")
           and not r["hf"]["ac"] and (r.get("peak_mem_gb") or 0) <= CROWDED_GIB]
    return [m for m in mbs if m > max(fit, default=0)]


def ratio_lines(results: list[dict], ours: str, hf: str) -> list[str]:
    """Each pair's tokens/s per GPU (labels `ours#k` and `hf#k`), its ratio, and over 2 or more
    pairs their geometric mean with its 95% interval (pairs.py)."""
    by_label = {r["label"]: r for r in results if "label" in r and not r.get("oom")}
    lines = []
    for label, r in by_label.items():
        name, _, k = label.partition("#")
        other = by_label.get(f"{hf}#{k}" if k else hf)
        if name == ours and other is not None:
            a, b = r["tokens_per_s_per_gpu"], other["tokens_per_s_per_gpu"]
            lines.append(f"  {label}: {a} / {hf}: {b} tokens/s/GPU = {a / b:.2f}x "
                         f"(peak GiB {r.get('peak_mem_gb')} / {other.get('peak_mem_gb')})")
    return lines + pair_lines(ours, hf, by_label)


def main() -> None:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="what", required=True)
    best = sub.add_parser("best", help="print the sweep's fastest hf_fsdp2.py settings")
    best.add_argument("file")
    best.add_argument("--fallback", default="", help="printed when the file holds no finished run")
    over = sub.add_parser("unfit", help="print the micro batches (comma-separated) that did not fit uncheckpointed")
    over.add_argument("file")
    over.add_argument("--mbs", required=True, help="the micro batches swept, e.g. 1,2,4")
    ratios = sub.add_parser("ratios", help="print ours over HF + FSDP2, per pair")
    ratios.add_argument("file")
    ratios.add_argument("--ours", required=True, help="our runs' label (before #k)")
    ratios.add_argument("--hf", default="hf", help="the baseline's label (before #k)")
    args = ap.parse_args()
    if args.what == "best":
        print(best_args(read(args.file)) or args.fallback)
    elif args.what == "unfit":
        print(",".join(map(str, unfit(read(args.file), [int(m) for m in args.mbs.split(",")]))))
    else:
        print("\n".join(ratio_lines(read(args.file), args.ours, args.hf)) or "  no complete pair")


if __name__ == "__main__":
    main()
