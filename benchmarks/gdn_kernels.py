"""Gated DeltaNet kernels on one GPU: flash-linear-attention's chunked Triton kernel against
mcore's torch form (the reference, in float32), at a Qwen3.5 layer's shape. Prints one
`RESULT {json}` line: versions, whether fla's forward and backward ran (or their error), their
relative differences to the reference (output and q/k/v/g/beta gradients), and the fwd+bwd
time of each (bf16 inputs).

    python benchmarks/gdn_kernels.py [--seq 4096] [--heads 32] [--dim 128]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from megatron.core.ssm.gated_delta_net.common import torch_chunk_gated_delta_rule


def inputs(seq: int, heads: int, dim: int, dtype):
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k = (torch.nn.functional.normalize(torch.randn(1, seq, heads, dim, device="cuda", generator=gen), dim=-1)
            for _ in range(2))
    v = torch.randn(1, seq, heads, dim, device="cuda", generator=gen)
    g = -torch.nn.functional.softplus(torch.randn(1, seq, heads, device="cuda", generator=gen))
    beta = torch.rand(1, seq, heads, device="cuda", generator=gen)
    return [t.to(dtype if t.dim() == 4 else torch.float32).requires_grad_() for t in (q, k, v, g, beta)]


def run(kernel, tensors, dtype):
    out, _ = kernel(*tensors[:3], g=tensors[3], beta=tensors[4].to(dtype))
    grad = torch.randn_like(out.float(), generator=torch.Generator(device="cuda").manual_seed(1))
    out.float().backward(grad)
    return out.float(), [t.grad.float() for t in tensors]


def rel(a, b) -> float:
    return float((a - b).norm() / b.norm())


def timed(kernel, seq, heads, dim, dtype, repeat=10) -> float:
    for i in range(repeat + 3):
        if i == 3:
            torch.cuda.synchronize()
            start = time.perf_counter()
        run(kernel, inputs(seq, heads, dim, dtype), dtype)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeat * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--dim", type=int, default=128)
    args = ap.parse_args()
    import triton

    result = {"torch": torch.__version__, "triton": triton.__version__,
              "device": torch.cuda.get_device_name(), **vars(args)}
    ref_out, ref_grads = run(torch_chunk_gated_delta_rule, inputs(args.seq, args.heads, args.dim, torch.float32),
                             torch.float32)
    result["torch_ms_bf16"] = timed(torch_chunk_gated_delta_rule, args.seq, args.heads, args.dim, torch.bfloat16)
    try:
        import fla
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule

        result["fla"] = fla.__version__
        out, grads = run(chunk_gated_delta_rule, inputs(args.seq, args.heads, args.dim, torch.bfloat16),
                         torch.bfloat16)
        result["fla_rel_out"] = rel(out, ref_out)
        result["fla_rel_grads"] = {n: rel(a, b) for n, a, b in zip("qkvgb", grads, ref_grads)}
        # bf16 rounding of mcore's own torch form, for scale
        out16, grads16 = run(torch_chunk_gated_delta_rule, inputs(args.seq, args.heads, args.dim, torch.bfloat16),
                             torch.bfloat16)
        result["torch_bf16_rel_out"] = rel(out16, ref_out)
        result["torch_bf16_rel_grads"] = {n: rel(a, b) for n, a, b in zip("qkvgb", grads16, ref_grads)}
        result["fla_ms_bf16"] = timed(chunk_gated_delta_rule, args.seq, args.heads, args.dim, torch.bfloat16)
    except Exception as e:  # fla refuses its backward on Hopper with Triton < 3.7.1
        result["fla_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
