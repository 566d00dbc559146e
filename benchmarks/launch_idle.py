"""Host time of one optimizer update launched onto an idle GPU against one launched behind queued
work (one GPU, Transformer Engine's FusedAdam as mcore's precision-aware optimizer drives it).

Why: under the profiler, FusedAdam's step took 35 ms of host time a step in lightning-mcore's
default mode, which launches the update after waiting for the GPU, and 18-21 ms where the update
is queued while the GPU is still busy (raw mcore, `stop_after_update`); RESULTS.md session 12.
The same Python runs in both, so this measures the launch itself: `idle` synchronises before the
step, `busy` queues `--busy-ms` of GPU sleep first; `adds` launches one tiny kernel per tensor
instead, the launch alone. Each row is one JSON line.

    python benchmarks/launch_idle.py [--params 600] [--numel 262144] [--repeat 30] [--profile]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def build(n: int, numel: int):
    from transformer_engine.pytorch.optimizers import FusedAdam

    params = [torch.nn.Parameter(torch.randn(numel, device="cuda", dtype=torch.bfloat16)) for _ in range(n)]
    for p in params:
        p.decoupled_grad = torch.randn(numel, device="cuda", dtype=torch.float32)
    optimizer = FusedAdam(params, lr=1e-4, master_weights=True, use_decoupled_grad=True,
                          master_weight_dtype=torch.float32)
    optimizer.step()  # state created here, not timed
    torch.cuda.synchronize()
    return optimizer


def sleep_cycles(ms: float) -> int:
    """GPU clock cycles for about `ms` of torch.cuda._sleep, measured here."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    end.synchronize()
    return int(10_000_000 * ms / start.elapsed_time(end))


def host_ms(step, busy_cycles: int) -> float:
    torch.cuda.synchronize()
    if busy_cycles:
        torch.cuda._sleep(busy_cycles)  # the GPU still runs this while the host launches
    t = time.perf_counter()
    step()
    elapsed = (time.perf_counter() - t) * 1e3
    torch.cuda.synchronize()
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--params", type=int, default=600)
    parser.add_argument("--numel", type=int, default=262144)
    parser.add_argument("--repeat", type=int, default=30)
    parser.add_argument("--busy-ms", type=float, default=200.0)
    parser.add_argument("--profile", action="store_true", help="also time both under torch.profiler")
    args = parser.parse_args()

    optimizer = build(args.params, args.numel)
    small = [torch.zeros(16, device="cuda") for _ in range(args.params)]

    def adds() -> None:  # one tiny kernel per tensor: the launch alone
        for t in small:
            t.add_(1.0)

    steps = {"adam": optimizer.step, "adds": adds}
    cycles = sleep_cycles(args.busy_ms)
    times: dict[str, list[float]] = {}

    def measure(suffix: str, repeat: int) -> None:
        for _ in range(repeat):  # interleaved
            for what, step in steps.items():
                for mode, busy in (("idle", 0), ("busy", cycles)):
                    times.setdefault(f"{what}_{mode}{suffix}", []).append(host_ms(step, busy))

    measure("", args.repeat)
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]):
            measure("_profiled", min(args.repeat, 10))
    for mode, values in times.items():
        print(json.dumps({
            "mode": mode, "params": args.params, "numel": args.numel, "busy_ms": args.busy_ms,
            "host_ms_median": round(statistics.median(values), 3),
            "host_ms_min": round(min(values), 3), "host_ms_max": round(max(values), 3),
            "n": len(values), "torch": torch.__version__, "device": torch.cuda.get_device_name(),
        }), flush=True)


if __name__ == "__main__":
    main()
