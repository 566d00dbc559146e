"""All-reduce / all-gather bus bandwidth between the GPUs of this host (explains TP scaling).

    torchrun --standalone --nproc-per-node 2 benchmarks/nccl_bandwidth.py
"""

import os
import time

import torch
import torch.distributed as dist


def main() -> None:
    rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl")
    n = dist.get_world_size()
    for mb in (16, 256):
        x = torch.ones(mb * 2**20 // 2, dtype=torch.bfloat16, device="cuda")
        for op in ("all_reduce", "all_gather"):
            out = torch.empty(x.numel() * n, dtype=x.dtype, device="cuda")
            fn = (lambda: dist.all_reduce(x)) if op == "all_reduce" else (
                lambda: dist.all_gather_into_tensor(out, x))
            for _ in range(5):
                fn()
            torch.cuda.synchronize()
            t = time.perf_counter()
            iters = 20
            for _ in range(iters):
                fn()
            torch.cuda.synchronize()
            dt = (time.perf_counter() - t) / iters
            factor = 2 * (n - 1) / n if op == "all_reduce" else (n - 1)
            busbw = x.numel() * 2 * factor / dt / 1e9
            if rank == 0:
                print(f"{op:10s} {mb:4d} MiB  {dt * 1e3:7.2f} ms  bus bandwidth {busbw:6.1f} GB/s", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
