"""LoRA SFT throughput and peak memory: a Llama-3-8B-shaped model on one GPU, or Qwen3-30B-A3B
with adapters on every expert at expert parallel 2, packed sequences.

Trainer + MegatronStrategy + SFTModule(lora=...) on synthetic packed rows (several samples per
row, assistant-only loss on half of each sample), TE spec, bf16:

    torchrun --nproc-per-node 1 benchmarks/bench_lora_sft.py --shape llama-8b --seq 4096
    torchrun --nproc-per-node 2 benchmarks/bench_lora_sft.py --shape qwen3-30b-a3b --seq 4096 \
        --ep 2 --rank 8 --alpha 32 --recompute --gbs 8

The base is random (layout-invariant init), which costs the same as a pretrained one. Prints
one JSON line: tokens/s, MFU (counting the frozen base's forward + input-gradient matmuls:
LoRA training still runs backward through every layer), peak memory, trainable parameters.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
from bench_pretrain import PEAK_BF16_TFLOPS, SHAPES, flops_per_token

from lightning_mcore.model.flops import training_flops_per_token
from torch.utils.data import DataLoader, Dataset

from lightning_mcore import GPTConfig, MegatronStrategy, OptimizerSettings
from lightning_mcore.data.packing import build_row
from lightning_mcore.model.lora import LoRAConfig
from lightning_mcore.objectives.sft import SFTModule


class PackedRows(Dataset):
    """Rows of 4 samples of seq/4 tokens each, loss on the second half of every sample."""

    def __init__(self, n: int, seq: int, vocab: int) -> None:
        self.n, self.seq, self.vocab = n, seq, vocab

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        gen = torch.Generator().manual_seed(i)
        n = self.seq // 4
        samples = [(torch.randint(0, self.vocab, (n,), generator=gen).tolist(), [0] * (n // 2) + [1] * (n - n // 2))
                   for _ in range(4)]
        return build_row(samples, self.seq, pad_id=0)


def main() -> None:
    import lightning as L

    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama-8b", choices=sorted(SHAPES))
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--gbs", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--alpha", type=float, default=None, help="default: 2 x rank")
    ap.add_argument("--ep", type=int, default=1, help="expert parallel size (MoE shapes)")
    ap.add_argument("--full", action="store_true", help="full-parameter training instead of LoRA")
    ap.add_argument("--recompute", action="store_true", help="full activation recompute")
    args = ap.parse_args()

    extra = dict(recompute_granularity="full", recompute_num_layers=1) if args.recompute else {}
    cfg = GPTConfig(**SHAPES[args.shape], seq_length=args.seq, **extra)
    times: list[float] = []

    class Timer(L.Callback):
        def on_train_batch_start(self, *a):
            torch.cuda.synchronize()
            self.t = time.perf_counter()

        def on_train_batch_end(self, *a):
            torch.cuda.synchronize()
            times.append(time.perf_counter() - self.t)

    devices = int(os.environ.get("WORLD_SIZE", 1))
    strategy = MegatronStrategy(global_batch_size=args.gbs, micro_batch_size=1, expert_model_parallel_size=args.ep,
                                expert_tensor_parallel_size=1 if args.ep > 1 else None)
    trainer = L.Trainer(accelerator="gpu", devices=devices, strategy=strategy, precision="bf16-mixed",
                        max_steps=args.steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[Timer()])
    lora = None if args.full else LoRAConfig(target_modules="all-linear", rank=args.rank,
                                                 alpha=args.alpha or 2.0 * args.rank)
    module = SFTModule(cfg, OptimizerSettings(lr=1e-4, warmup_steps=2), lora=lora)
    data = DataLoader(PackedRows(args.gbs * args.steps, args.seq, cfg.vocab_size), batch_size=args.gbs)
    trainer.fit(module, data)

    steady = times[3:]
    step = sum(steady) / len(steady)
    tokens = args.gbs * args.seq / step / devices  # per GPU
    mfu = tokens * flops_per_token(cfg, args.seq) / (PEAK_BF16_TFLOPS * 1e12)
    # what a LoRA step runs: the frozen base's forward and input gradients, no weight gradients
    mfu_run = tokens * training_flops_per_token(cfg, args.seq, frozen_base=not args.full) / (PEAK_BF16_TFLOPS * 1e12)
    if int(os.environ.get("RANK", 0)) == 0:
        print("RESULT " + json.dumps({
            "shape": args.shape, "seq": args.seq, "gbs": args.gbs, "lora_rank": None if args.full else args.rank,
            "ep": args.ep, "devices": devices,
            "recompute": args.recompute, "device": torch.cuda.get_device_name(),
            "tokens_per_s_per_gpu": round(tokens), "step_s": round(step, 3),
            "mfu_full_model_flops": round(mfu, 3), "mfu_flops_run": round(mfu_run, 3),
            "peak_mem_gb": round(torch.cuda.max_memory_allocated() / 2**30, 1),
            # what nvidia-smi shows (less the CUDA context): the allocator's cache included
            "peak_reserved_gb": round(torch.cuda.max_memory_reserved() / 2**30, 1),
            "trainable_params": getattr(module, "lora_trainable_parameters", None),
        }), flush=True)


if __name__ == "__main__":
    main()
