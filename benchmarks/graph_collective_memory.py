"""What each captured decode graph holds at TP>1: N graphs, each a GEMM whose output goes
through an all-reduce and an all-gather (a row-parallel layer and the logits' gather), captured
into one pool as decode_graphs.py does; prints the allocator's reserved bytes and the device's
used bytes per graph. Run: torchrun --nproc-per-node 2 benchmarks/graph_collective_memory.py [N]"""

import json
import os
import sys

import torch
import torch.distributed as dist

n = int(sys.argv[1]) if len(sys.argv) > 1 else 100
rank = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(rank)
dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
x = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16)
w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
out = torch.empty(128, 4096, device="cuda", dtype=torch.bfloat16)


def step():
    y = x @ w  # 0.5 MiB
    dist.all_reduce(y)
    gathered = torch.empty(2 * 64, 4096, device="cuda", dtype=torch.bfloat16)
    dist.all_gather_into_tensor(gathered, y)
    out.copy_(gathered)


side = torch.cuda.Stream()
side.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(side):
    step()
torch.cuda.current_stream().wait_stream(side)
torch.cuda.synchronize()
pool, graphs = torch.cuda.graph_pool_handle(), []


def used():
    free, total = torch.cuda.mem_get_info()
    return total - free


before = (torch.cuda.memory_reserved(), used())
for _ in range(n):
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, pool=pool, capture_error_mode="thread_local"):
        step()
    graphs.append(g)
torch.cuda.synchronize()
after = (torch.cuda.memory_reserved(), used())
if rank == 0:
    print("RESULT " + json.dumps({
        "graphs": n, "avoid_record_streams": os.environ.get("TORCH_NCCL_AVOID_RECORD_STREAMS"),
        "graph_mixing": os.environ.get("NCCL_GRAPH_MIXING_SUPPORT"),
        "reserved_mib_per_graph": (after[0] - before[0]) / n / 2**20,
        "device_used_mib_per_graph": (after[1] - before[1]) / n / 2**20,
        "collective_bytes_mib_per_graph": (64 * 4096 * 2 + 128 * 4096 * 2) / 2**20}), flush=True)
del graphs
dist.destroy_process_group()
