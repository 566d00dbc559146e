"""What turning a quantized LoRA base back into bf16 costs on one GPU (lora/quantized_base.py):
milliseconds per dequantization of one layer's weights, for each codec (fp8, nf4, mxfp4), as the
library runs it (`dequantized`, eager, a few rows at a time) and as one fused kernel would
(torch.compile of the codec's dequantize over the whole tensor), beside a bf16 GEMM of the same
weight over one 4096-token micro batch (experts: its 8-of-128 routed rows, balanced).

A training step dequantizes each adapted weight once per forward call and once more in backward
(plus once for recompute), so steps x layers x 3 of these per micro batch is the dequantization
time a run pays.

    python benchmarks/dequant_speed.py [--tokens 4096] [--repeats 20]

Prints one `RESULT {...}` line per weight and codec.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from lightning_mcore.lora.quantized_base import CODECS, dequantized

# [E, out, in] (E = 1: a dense linear); what one layer of each shape holds
WEIGHTS = {
    "qwen3-30b-a3b experts fc1": (128, 1536, 2048),
    "qwen3-30b-a3b experts fc2": (128, 2048, 768),
    "llama-8b mlp fc1": (1, 28672, 4096),
    "llama-8b mlp fc2": (1, 4096, 14336),
}
TOP_K = 8  # Qwen3-30B-A3B's experts per token


def timed(fn, repeats: int) -> float:
    """Milliseconds per call (median of `repeats`, after two warm-up calls)."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    dev = torch.device("cuda")
    for name, shape in WEIGHTS.items():
        weight = torch.randn(shape, device=dev, dtype=torch.bfloat16) * 0.02
        experts, out_f, in_f = shape
        rows = args.tokens * TOP_K // experts if experts > 1 else args.tokens  # balanced routing: rows per expert
        x = torch.randn(rows, in_f, device=dev, dtype=torch.bfloat16)
        gemm_ms = timed(lambda: torch.matmul(x, weight[0].t()) if experts == 1 else
                        torch.bmm(x.expand(experts, -1, -1), weight.transpose(1, 2)), args.repeats)
        for codec in CODECS.values():
            codes, scales = codec.quantize(weight, None)
            fused = torch.compile(codec.dequantize, dynamic=False)
            check = (fused(codes, scales, torch.bfloat16) == dequantized(codec, codes, scales, torch.bfloat16)).all()
            eager_ms = timed(lambda: dequantized(codec, codes, scales, torch.bfloat16), args.repeats)
            fused_ms = timed(lambda: fused(codes, scales, torch.bfloat16), args.repeats)
            elements = weight.numel()
            print("RESULT " + json.dumps({
                "weight": name, "shape": list(shape), "codec": codec.name, "device": torch.cuda.get_device_name(),
                "eager_ms": round(eager_ms, 3), "compiled_ms": round(fused_ms, 3), "compiled_equal": bool(check),
                "bf16_gemm_ms": round(gemm_ms, 3), "gemm_tokens": args.tokens,
                "eager_gb_per_s_bf16_out": round(elements * 2 / eager_ms / 1e6, 1),
                "code_mb": round(codes.numel() * codes.element_size() / 2**20, 1),
            }), flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
