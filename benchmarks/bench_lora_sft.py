"""SFT throughput and peak memory (LoRA or full fine-tuning): a Llama-3-8B-shaped model, or
Qwen3-30B-A3B with adapters on every expert at expert parallel 2; long sequences through
context parallelism; the deepest model of a shape that fits (--layers).

Trainer + MegatronStrategy + SFTModule(lora=...) on synthetic packed rows (--samples-per-row
samples per row, assistant-only loss on the second half of each sample), TE spec, bf16:

    torchrun --nproc-per-node 1 benchmarks/bench_lora_sft.py --shape llama-8b --seq 4096
    torchrun --nproc-per-node 2 benchmarks/bench_lora_sft.py --shape qwen3-30b-a3b --seq 4096 \
        --ep 2 --rank 8 --alpha 32 --recompute --gbs 8
    # full fine-tuning of one 65536-token sequence per row, split over 2 GPUs (CP=2, DP=1)
    torchrun --nproc-per-node 2 benchmarks/bench_lora_sft.py --shape llama-8b --seq 65536 --cp 2 \
        --samples-per-row 1 --full --recompute --gbs 2 --steps 6
    # a 24-layer Llama-8B-wide model, full fine-tuning on 1 GPU with Adam's state in CPU memory
    torchrun --nproc-per-node 1 benchmarks/bench_lora_sft.py --shape llama-8b --layers 24 --full \
        --optimizer-offload 1.0 --recompute

The base is random (layout-invariant init), which costs the same as a pretrained one. Each
data-parallel rank loads gbs / dp rows a step (dp = WORLD_SIZE / cp). Prints
one JSON line, `RESULT {...}` (rank 0): tokens/s per GPU, MFU, peak GPU memory, the host's peak
resident memory (optimizer offload), parameters. MFU counts attention over the whole row of
--seq tokens, as Megatron does (`mfu_flops_run`: what a LoRA step runs, the frozen base's
forward and input gradients); `mfu_sample_attention` counts it over each sample, which is what
packed attention runs (the same with one sample per row). A run that runs out of GPU memory prints
`RESULT {"oom": true, ...}` with its settings instead of a traceback, so that a sweep goes on:
exit status 0 on one GPU; with several ranks 1, so that torchrun stops the ranks still waiting
in a collective for the one that failed (each rank that ran out prints its own line).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path
from typing import Optional

import lightning as L
import torch
from bench_pretrain import PEAK_BF16_TFLOPS, SHAPES, StepProfile, flops_per_token
from torch.utils.data import DataLoader, Dataset

from lightning_mcore import GPTConfig, MegatronStrategy, OptimizerSettings
from lightning_mcore.callbacks.memory_plan import MemoryPlanReport, planned_total
from lightning_mcore.data.packing import build_row
from lightning_mcore.lora.config import LoRAConfig
from lightning_mcore.model.flops import training_flops_per_token
from lightning_mcore.objectives.sft import SFTModule
from lightning_mcore.plan.parameters import PlanError

UNTIMED_STEPS = 3  # model build, first allocations, TE autotuning


class PackedRows(Dataset):
    """Rows of k samples of seq // k tokens each, loss on the second half of every sample."""

    def __init__(self, n: int, seq: int, vocab: int, samples_per_row: int = 4) -> None:
        self.n, self.seq, self.vocab, self.k = n, seq, vocab, samples_per_row

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        gen = torch.Generator().manual_seed(i)
        n = self.seq // self.k
        samples = [(torch.randint(0, self.vocab, (n,), generator=gen).tolist(), [0] * (n // 2) + [1] * (n - n // 2))
                   for _ in range(self.k)]
        return build_row(samples, self.seq, pad_id=0)


def model_parameters(cfg: GPTConfig, tp: int = 1) -> int:
    """All parameters of the model (every rank's together), from its config: embedding, LM head
    (unless tied), per layer attention, MLP or MoE (router, routed and shared experts) and norms."""
    h, d = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * d, (cfg.num_query_groups or cfg.num_attention_heads) * d
    attention = h * (q + 2 * kv) + q * h + (q + 2 * kv if cfg.add_qkv_bias else 0) + (2 * d if cfg.qk_layernorm else 0)
    dense = 3 * h * cfg.ffn_hidden_size
    moe = 0
    if cfg.num_moe_experts:
        moe = (h * cfg.num_moe_experts + cfg.num_moe_experts * 3 * h * (cfg.moe_ffn_hidden_size or cfg.ffn_hidden_size)
               + 3 * h * (cfg.moe_shared_expert_intermediate_size or 0) + (h if cfg.moe_shared_expert_gate else 0))
    norms = 2 * h * (2 if cfg.post_norms else 1)
    layers = sum(attention + norms + (moe if cfg.is_moe_layer(i) else dense) for i in range(cfg.num_layers))
    vocab = cfg.padded_vocab_size(tp) * h
    return layers + vocab * (1 if cfg.tie_word_embeddings else 2) + h  # + final norm


def is_out_of_memory(error: BaseException) -> bool:
    """The caching allocator's OutOfMemoryError, or a library's CUDA allocation that failed
    (cuBLAS workspace, pinned host memory for the offloaded optimizer) as a RuntimeError."""
    if isinstance(error, torch.cuda.OutOfMemoryError):
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and ("out of memory" in text.lower() or "ALLOC_FAILED" in text)


def host_peak_rss_gb() -> float:
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 1)  # KiB on Linux


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama-8b", choices=sorted(SHAPES))
    ap.add_argument("--layers", type=int, default=None, help="override the shape's num_layers")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--samples-per-row", type=int, default=4, metavar="K",
                    help="samples of seq // K tokens per row (1: one sequence of --seq tokens)")
    ap.add_argument("--steps", type=int, default=12, help=f"optimizer steps, the first {UNTIMED_STEPS} not timed")
    ap.add_argument("--gbs", type=int, default=4, help="global batch (rows per step)")
    ap.add_argument("--mbs", type=int, default=1, help="micro batch (rows per forward)")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-4, help="peak learning rate (2 warmup steps, then cosine to 0 at --steps)")
    ap.add_argument("--alpha", type=float, default=None, help="default: 2 x rank")
    ap.add_argument("--ep", type=int, default=1, help="expert parallel size (MoE shapes)")
    ap.add_argument("--experts", default="auto", choices=["auto", "te", "torch"],
                    help="MoE shapes: GPTConfig.moe_grouped_gemm_backend (auto: torch's, which runs the "
                         "experts and their adapters as grouped GEMMs, unless the rank is no multiple of 8)")
    ap.add_argument("--cp", type=int, default=1, help="context parallel size (data parallel: WORLD_SIZE / cp)")
    ap.add_argument("--full", action="store_true", help="full-parameter training instead of LoRA")
    recompute = ap.add_mutually_exclusive_group()
    recompute.add_argument("--recompute", action="store_true", help="full activation recompute (every layer)")
    recompute.add_argument("--recompute-selective", action="store_true",
                           help="selective recompute of --recompute-modules (mcore's default: core_attn)")
    ap.add_argument("--recompute-modules", default=None, metavar="M,M",
                    help="with --recompute-selective, e.g. core_attn,mlp,layernorm")
    ap.add_argument("--optimizer-offload", type=float, default=0.0, metavar="FRACTION",
                    help="share of Adam's state (and update) in CPU memory; 0: off")
    ap.add_argument("--base-precision", default="bf16", choices=["bf16", "fp8", "nf4", "mxfp4"],
                    help="LoRAConfig.base_precision: how the frozen base that LoRA adapts is held")
    ap.add_argument("--base-gemm", default="bf16", choices=["bf16", "fp8"],
                    help="LoRAConfig.base_gemm: an fp8 base dequantized into bf16 GEMMs, or multiplied by FP8 GEMMs")
    ap.add_argument("--impl", default="auto", choices=["auto", "local"],
                    help="GPTConfig.transformer_impl (local: mcore's own linears, SDPA attention; what an fp8, "
                         "nf4 or mxfp4 base needs)")
    ap.add_argument("--memory-cap-gib", type=float, default=None, metavar="GIB",
                    help="cap torch's allocator at this much memory per GPU (an 80 GB H100 on an H200: 79; "
                         "torch.cuda.set_per_process_memory_fraction, which leaves the CUDA context and NCCL out)")
    ap.add_argument("--data", default="random", help="'random' (packed synthetic rows) or a real_text.py token directory")
    ap.add_argument("--losses", action="store_true", help="print each step's loss (a STEP line) and list them in RESULT")
    ap.add_argument("--memory-snapshot", default=None, metavar="PATH",
                    help="record torch's allocator history over steps 2-4 and write its snapshot to PATH "
                         "(open it at pytorch.org/memory_viz)")
    ap.add_argument("--profile", default=None, metavar="DIR",
                    help="torch.profiler over the first 3 timed steps; each rank writes DIR/rank{N}.txt (ops by host "
                         "and device time, the GPU's idle gaps); those steps' times count in RESULT, so profile in a run "
                         "of its own")
    ap.add_argument("--time-limit", type=float, default=None, metavar="S",
                    help="stop after the step that ends past S seconds of training (RESULT counts the steps done)")
    args = ap.parse_args(argv)
    if args.steps <= UNTIMED_STEPS:
        ap.error(f"--steps must be more than the {UNTIMED_STEPS} untimed steps")
    if args.samples_per_row < 1 or args.seq // args.samples_per_row < 2:
        ap.error("--samples-per-row must be >= 1 and leave samples of at least 2 tokens")
    if args.cp > 1 and args.seq % (2 * args.cp):
        ap.error(f"--seq must be divisible by 2 x --cp ({2 * args.cp}) for load-balanced context parallelism")
    if args.recompute_modules and not args.recompute_selective:
        ap.error("--recompute-modules needs --recompute-selective")
    if not 0 <= args.optimizer_offload <= 1:
        ap.error("--optimizer-offload is a fraction in [0, 1]")
    if args.layers is not None and args.layers < 1:
        ap.error("--layers must be >= 1")
    if args.base_precision != "bf16" and (args.full or args.impl != "local"):
        ap.error("--base-precision fp8/nf4/mxfp4 is LoRA over mcore's local layers: drop --full, add --impl local")
    if args.base_gemm == "fp8" and args.base_precision != "fp8":
        ap.error("--base-gemm fp8 multiplies an FP8 base's codes: add --base-precision fp8")
    return args


def model_config(args) -> GPTConfig:
    shape = dict(SHAPES[args.shape])
    if args.layers is not None:
        shape["num_layers"] = args.layers
    recompute = {}
    if args.recompute:
        recompute = dict(recompute_granularity="full", recompute_num_layers=1)
    elif args.recompute_selective:
        modules = args.recompute_modules.split(",") if args.recompute_modules else None
        recompute = dict(recompute_granularity="selective", recompute_modules=modules)
    experts = dict(moe_grouped_gemm_backend=args.experts) if shape.get("num_moe_experts") else {}
    return GPTConfig(**shape, seq_length=args.seq, transformer_impl=args.impl, **recompute, **experts)


def optimizer_settings(args) -> OptimizerSettings:
    offload = dict(cpu_offload=True, offload_fraction=args.optimizer_offload) if args.optimizer_offload else {}
    return OptimizerSettings(lr=args.lr, warmup_steps=2, **offload)


def settings(args, cfg: GPTConfig, devices: int) -> dict:
    """What a RESULT line says about the run, measured or not."""
    return {
        "shape": args.shape, "layers": cfg.num_layers, "params": model_parameters(cfg),
        "seq": args.seq, "samples_per_row": args.samples_per_row, "gbs": args.gbs, "mbs": args.mbs,
        "lora_rank": None if args.full else args.rank, "lr": args.lr, "ep": args.ep, "cp": args.cp,
        "dp": devices // args.cp, "devices": devices,
        "recompute": "full" if args.recompute else "selective" if args.recompute_selective else None,
        "recompute_modules": args.recompute_modules, "optimizer_offload": args.optimizer_offload,
        "experts": args.experts if cfg.num_moe_experts else None, "base_precision": args.base_precision,
        "base_gemm": args.base_gemm, "impl": args.impl, "memory_cap_gib": args.memory_cap_gib, "data": args.data,
    }


def device_name() -> str:
    """This rank's GPU; asked once Lightning has set the device (before, every rank would make
    a CUDA context on GPU 0)."""
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


class Bench(L.Callback):
    """Times each step (and, with --losses, prints its loss as a `STEP {...}` line on rank 0, so a
    run cut short still leaves its curve). On running out of GPU memory, prints one
    `RESULT {"oom": true, ...}` line (`settings` and what was reached) and ends the process
    before Lightning's teardown, whose collectives would wait for the other ranks."""

    def __init__(self, settings: dict, devices: int, rank: int, losses: bool = False,
                 time_limit: Optional[float] = None, snapshot: Optional[str] = None,
                 profile: Optional[str] = None) -> None:
        self.settings, self.devices, self.rank = settings, devices, rank
        self.times: list[float] = []
        self.losses: Optional[list[float]] = [] if losses else None
        self.time_limit = time_limit
        self.snapshot = snapshot if rank == 0 else None
        self.setup_peak_gb: Optional[float] = None
        self.profile = StepProfile(profile, f"rank{rank}", UNTIMED_STEPS) if profile else None

    def on_train_start(self, *a):
        """The peak of building and loading (a quantized base is built in bf16 first) is kept apart:
        peak_mem_gb is then training's own."""
        if torch.cuda.is_available():
            self.setup_peak_gb = round(torch.cuda.max_memory_allocated() / 2**30, 1)
            torch.cuda.reset_peak_memory_stats()

    def on_train_batch_start(self, *a):
        if self.snapshot and len(self.times) == 1:  # steps 2-4: past the first step's one-time allocations
            torch.cuda.memory._record_memory_history(max_entries=200_000)
        if self.profile:
            self.profile.start(len(self.times))
        torch.cuda.synchronize()
        self.t = time.perf_counter()

    def on_train_batch_end(self, trainer, *a):
        torch.cuda.synchronize()
        self.times.append(time.perf_counter() - self.t)
        if self.losses is not None:
            self.losses.append(round(float(trainer.callback_metrics["loss"]), 4))
            if self.rank == 0:
                norm = getattr(trainer.optimizers[0], "last_grad_norm", None)
                allocated = torch.cuda.memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0
                print("STEP " + json.dumps({"step": len(self.times), "loss": self.losses[-1],
                                            "grad_norm": None if norm is None else round(float(norm), 5),
                                            "s": round(self.times[-1], 3),
                                            "allocated_gib": round(allocated, 2)}), flush=True)
        if self.profile:
            self.profile.end(self.times)
        if self.snapshot and len(self.times) == 4:
            torch.cuda.memory._dump_snapshot(self.snapshot)
            torch.cuda.memory._record_memory_history(enabled=None)
        if self.time_limit is not None and len(self.times) > UNTIMED_STEPS:  # at least one timed step
            # decided together: a rank that stopped alone would hang the others in a collective
            trainer.should_stop = trainer.strategy.reduce_boolean_decision(sum(self.times) > self.time_limit, all=False)

    def on_exception(self, trainer, module, error):
        if not is_out_of_memory(error):
            return
        print("RESULT " + json.dumps({
            "oom": True, **self.settings, "device": device_name(), "rank": self.rank, "steps_done": len(self.times),
            "peak_mem_gb": round(torch.cuda.max_memory_allocated() / 2**30, 1) if torch.cuda.is_available() else None,
            "host_peak_rss_gb": host_peak_rss_gb(), "error": (str(error).splitlines() or [""])[0][:300],
        }), flush=True)
        sys.stderr.flush()
        os._exit(0 if self.devices == 1 else 1)


class RealTextRows(Dataset):
    """real_text.TokenWindows' windows as SFT rows: one sample per row, loss on every token."""

    def __init__(self, directory: str, seq: int) -> None:
        from real_text import TokenWindows  # benchmarks/ is the script's directory, only --data needs it

        self.windows = TokenWindows(Path(directory, "tokens.npy"), seq)

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, i: int):
        row = self.windows[i]
        return {**row, "segment_ids": torch.ones_like(row["tokens"])}


def lora_b_rms(module) -> Optional[float]:
    """The root mean square of this rank's LoRA B matrices: 0 until training moves them (they start at zero)."""
    bs = [p.detach().float() for name, p in module.named_parameters() if name.endswith("lora_B")]
    if not bs:
        return None
    return float(torch.sqrt(sum(b.square().sum() for b in bs) / sum(b.numel() for b in bs)))


def planned_gib(trainer, module) -> Optional[float]:
    """lightning-mcore plan's per-GPU total for this run (pipeline stage 0), beside the measured peak."""
    try:
        return round(planned_total(trainer, module) / 2**30, 1)
    except PlanError:
        return None


def main() -> None:
    args = parse_args()
    cfg = model_config(args)
    devices = int(os.environ.get("WORLD_SIZE", 1))
    rank = int(os.environ.get("RANK", 0))
    if args.memory_cap_gib:
        local = int(os.environ.get("LOCAL_RANK", 0))
        total = torch.cuda.get_device_properties(local).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.memory_cap_gib * 2**30 / total), local)
    bench = Bench(settings(args, cfg, devices), devices, rank, args.losses, args.time_limit, args.memory_snapshot,
                  args.profile)
    # the distributed optimizer (the GPU default, said here because optimizer offload needs it)
    strategy = MegatronStrategy(global_batch_size=args.gbs, micro_batch_size=args.mbs, expert_model_parallel_size=args.ep,
                                expert_tensor_parallel_size=1 if args.ep > 1 else None,
                                context_parallel_size=args.cp, use_distributed_optimizer=True)
    trainer = L.Trainer(accelerator="gpu", devices=devices, strategy=strategy, precision="bf16-mixed",
                        max_steps=args.steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[bench, MemoryPlanReport()])
    lora = None if args.full else LoRAConfig(target_modules="all-linear", rank=args.rank,
                                                 alpha=args.alpha or 2.0 * args.rank,
                                                 base_precision=args.base_precision, base_gemm=args.base_gemm)
    module = SFTModule(cfg, optimizer_settings(args), lora=lora)
    rows = (PackedRows(args.gbs * args.steps, args.seq, cfg.vocab_size, args.samples_per_row)
            if args.data == "random" else RealTextRows(args.data, args.seq))
    data = DataLoader(rows, batch_size=args.gbs // (devices // args.cp), shuffle=False)
    trainer.fit(module, data)

    steady = bench.times[UNTIMED_STEPS:]
    step = sum(steady) / len(steady)
    tokens = args.gbs * args.seq / step / devices  # per GPU: each of the cp ranks holds seq / cp of a row
    peak = PEAK_BF16_TFLOPS * 1e12
    sample = args.seq // args.samples_per_row
    run_flops = training_flops_per_token(cfg, args.seq, frozen_base=not args.full)
    if rank == 0:
        print("RESULT " + json.dumps({
            "oom": False, **bench.settings, "device": device_name(),
            "tokens_per_s_per_gpu": round(tokens), "step_s": round(step, 3),
            "mfu_full_model_flops": round(tokens * flops_per_token(cfg, args.seq) / peak, 3),
            "mfu_sample_attention": round(tokens * flops_per_token(cfg, sample) / peak, 3),
            "mfu_flops_run": round(tokens * run_flops / peak, 3),
            "peak_mem_gb": round(torch.cuda.max_memory_allocated() / 2**30, 1),  # training's (Bench.on_train_start)
            "setup_peak_gb": bench.setup_peak_gb,
            # what nvidia-smi shows (less the CUDA context): the allocator's cache included
            "peak_reserved_gb": round(torch.cuda.max_memory_reserved() / 2**30, 1),
            "host_peak_rss_gb": host_peak_rss_gb(),
            "trainable_params": getattr(module, "lora_trainable_parameters", None),
            "plan_gib": planned_gib(trainer, module), "steps_done": len(bench.times),
            "lora_B_rms": lora_b_rms(module),
            **({"losses": bench.losses} if bench.losses is not None else {}),
        }), flush=True)


if __name__ == "__main__":
    main()
