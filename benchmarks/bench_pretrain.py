"""One pretraining throughput run (one process per GPU, under torchrun): lightning-mcore, a raw
mcore loop, or HF transformers, on the same model shape and the same batches.

    torchrun --nproc-per-node 1 benchmarks/bench_pretrain.py --impl raw
    torchrun --nproc-per-node 2 benchmarks/bench_pretrain.py --impl lightning --tp 2
    torchrun --nproc-per-node 1 benchmarks/bench_pretrain.py --impl hf-compile

raw and lightning share the TransformerConfig (lightning_mcore.model.config), mcore's GPTModel
with the Transformer Engine spec, mcore DDP + distributed optimizer with overlapped grad
reduce, and the schedule from get_forward_backward_func; raw has no Lightning in the loop.
benchmarks/compare.py runs the named workloads (workloads.py) and prints ratios. Prints one `RESULT {json}`
line (rank 0): tokens/s/GPU, MFU, peak memory, mean step time (and per-step losses on request).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import gc
import io
import json
import os
import pstats
import time
from typing import Optional

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from lightning_mcore import GPTConfig
from lightning_mcore.strategy.parallel import ParallelConfig

PEAK_BF16_TFLOPS = 989.4  # H100 SXM / H200 dense bf16

_LLAMA = dict(vocab_size=128256, rotary_base=500000.0)
SHAPES = {
    "llama-1.2b": dict(num_layers=16, hidden_size=2048, ffn_hidden_size=8192, num_attention_heads=32,
                       num_query_groups=8, **_LLAMA),
    "llama-3b": dict(num_layers=28, hidden_size=3072, ffn_hidden_size=8192, num_attention_heads=24,
                     num_query_groups=8, **_LLAMA),
    "llama-8b": dict(num_layers=32, hidden_size=4096, ffn_hidden_size=14336, num_attention_heads=32,
                     num_query_groups=8, **_LLAMA),
    # Qwen3-30B-A3B's layer (64 of its 128 experts) at 12 layers: 4.0B parameters, 0.9B active
    "qwen3-moe-small": dict(num_layers=12, hidden_size=2048, ffn_hidden_size=6144, num_attention_heads=32,
                            num_query_groups=4, kv_channels=128, qk_layernorm=True, vocab_size=151936,
                            rotary_base=1000000.0, norm_epsilon=1e-6, num_moe_experts=64,
                            moe_router_topk=8, moe_ffn_hidden_size=768, moe_grouped_gemm=True,
                            moe_token_dispatcher_type="alltoall", moe_router_pre_softmax=False),
    # Qwen3-30B-A3B itself: 48 layers, 128 experts top-8 (30.5B parameters, 3.3B active)
    "qwen3-30b-a3b": dict(num_layers=48, hidden_size=2048, ffn_hidden_size=6144, num_attention_heads=32,
                          num_query_groups=4, kv_channels=128, qk_layernorm=True, vocab_size=151936,
                          rotary_base=1000000.0, norm_epsilon=1e-6, num_moe_experts=128,
                          moe_router_topk=8, moe_ffn_hidden_size=768, moe_grouped_gemm=True,
                          moe_token_dispatcher_type="alltoall", moe_router_pre_softmax=False),
    # A Qwen3.5-shaped hybrid at 12 layers: 3 Gated DeltaNet layers to 1 gated softmax attention
    "qwen3.5-hybrid": dict(num_layers=12, hidden_size=2048, ffn_hidden_size=6144, num_attention_heads=16,
                           num_query_groups=4, kv_channels=128, qk_layernorm=True, zero_centered_norm=True,
                           attention_output_gate=True, rotary_percent=0.25, vocab_size=151936,
                           rotary_base=10000000.0, norm_epsilon=1e-6,
                           linear_attention=dict(num_key_heads=16, num_value_heads=16, key_head_dim=128,
                                                 value_head_dim=128),
                           layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 3),
    # GPT-OSS-20B's layer (32 experts top-4, biases, sinks, clamped SwiGLU, windows of 128
    # alternating with full layers, YaRN) at 4 layers: 3.5B parameters
    "gpt-oss-20b-layers": dict(num_layers=4, hidden_size=2880, ffn_hidden_size=2880, num_attention_heads=64,
                               num_query_groups=8, kv_channels=64, vocab_size=201088, rotary_base=150000.0,
                               rope_scaling={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                                             "beta_slow": 1.0, "truncate": False,
                                             "original_max_position_embeddings": 4096},
                               activation="quick_gelu", glu_linear_offset=1.0, activation_clamp=7.0,
                               add_bias_linear=True, attention_sinks=True, sliding_window=128,
                               layer_types=["sliding_attention", "full_attention"] * 2, num_moe_experts=32,
                               moe_router_topk=4, moe_ffn_hidden_size=2880, moe_grouped_gemm=True,
                               moe_token_dispatcher_type="alltoall", moe_router_pre_softmax=False),
    # GLM-4.5-Air's layers (one dense, then 128 experts top-8 + a shared expert, sigmoid router
    # with its bias, q/k/v biases, RoPE on half of each head) at 3 layers: 4.6B parameters
    "glm4.5-air-layers": dict(num_layers=3, hidden_size=4096, ffn_hidden_size=10944, num_attention_heads=96,
                              num_query_groups=8, kv_channels=128, vocab_size=151552, rotary_base=1000000.0,
                              add_qkv_bias=True, rotary_percent=0.5, norm_epsilon=1e-5, num_moe_experts=128,
                              moe_router_topk=8, moe_ffn_hidden_size=1408, moe_shared_expert_intermediate_size=1408,
                              moe_layer_freq=[0, 1, 1], moe_router_score_function="sigmoid",
                              moe_router_enable_expert_bias=True, moe_router_topk_scaling_factor=1.0,
                              moe_router_dtype="fp32", moe_grouped_gemm=True, moe_token_dispatcher_type="alltoall",
                              moe_router_pre_softmax=False),
}


def flops_per_token(cfg: GPTConfig, seq: int) -> float:
    """The benchmark's own count (Megatron's convention: 3 x forward matmuls, full s x s
    attention, LM head, MoE top-k experts + router); written out here independently of
    lightning_mcore.model.flops, which the MegatronThroughput callback uses."""
    h, q = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim
    kv = (cfg.num_query_groups or cfg.num_attention_heads) * cfg.head_dim
    dense = 3 * h * cfg.ffn_hidden_size
    moe = (cfg.moe_router_topk * 3 * h * (cfg.moe_ffn_hidden_size or cfg.ffn_hidden_size)
           + 3 * h * (cfg.moe_shared_expert_intermediate_size or 0) + h * (cfg.num_moe_experts or 0))
    mlps = [moe if cfg.is_moe_layer(i) else dense for i in range(cfg.num_layers)]
    attention = h * (q * (2 if cfg.attention_output_gate else 1) + 2 * kv) + q * h + 2 * seq * q
    layers = [attention + mlp for mlp in mlps]
    if cfg.linear_attention is not None:  # projections, and per value head the state's update and readout
        la = cfg.linear_attention
        lk, lv = la.num_key_heads * la.key_head_dim, la.num_value_heads * la.value_head_dim
        linear = h * (2 * lk + 2 * lv + 2 * la.num_value_heads) + lv * h + \
            4 * la.num_value_heads * la.key_head_dim * la.value_head_dim
        layers = [(linear if cfg.is_linear_attention_layer(i) else attention) + mlps[i] for i in range(cfg.num_layers)]
    return 3.0 * 2 * (sum(layers) + h * cfg.vocab_size)


class RandomTokens(Dataset):
    def __init__(self, n: int, seq: int, vocab: int) -> None:
        self.n, self.seq, self.vocab = n, seq, vocab

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        row = torch.randint(0, self.vocab, (self.seq + 1,), generator=torch.Generator().manual_seed(i))
        return {"tokens": row[:-1], "labels": row[1:], "loss_mask": torch.ones(self.seq),
                "position_ids": torch.arange(self.seq)}


class StepTimer:
    """Wall time of each optimizer step, CUDA-synchronised, plus the host side of the same
    window: the main thread's CPU time and Python's garbage-collector pauses. Optionally
    profiles steps 10-12 with torch.profiler (`profile`) or cProfile (`pyprofile`).
    `free_running`: synchronised only at the ends of the timed window (steps warmup..last), so
    that the host runs ahead of the GPU between steps as in a run without a timer; then only
    the window's time (`window_s`) means anything, not the single steps'."""

    def __init__(self, profile: bool = False, pyprofile: bool = False, manual_gc: int = 0) -> None:
        self.times: list[float] = []
        self.host: list[float] = []
        self.gc: list[float] = []
        self.losses: list[float] = []
        self._t = self._h = 0.0
        self.profile, self.pyprofile = profile, pyprofile
        # manual_gc N (Megatron-LM's --manual-gc): Python's collector off, what exists before the
        # first step frozen out of it, one full collection every N steps, inside the timed step
        self.manual_gc = manual_gc
        self._prof = None
        self._gc_t0, self._gc_total = 0.0, 0.0
        self.gc_pauses: list[tuple[int, float]] = []  # (step index, seconds) of each collection
        self.full_gc_ms: Optional[float] = None  # one full collection after the last step (measure_gc_at)
        self.measure_gc_at: Optional[int] = None
        self.device_used = 0  # most bytes in use on the device at a step's end (all of it, not only torch's)
        self.free_running, self.warmup = False, 0
        self._window_t0, self.window_s = 0.0, None
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_t0 = time.perf_counter()
        else:
            pause = time.perf_counter() - self._gc_t0
            self._gc_total += pause
            self.gc_pauses.append((len(self.times), pause))

    def start(self) -> None:
        if not self.free_running or len(self.times) == self.warmup:
            torch.cuda.synchronize()
        if self.manual_gc and not self.times and gc.isenabled():
            gc.collect()
            gc.freeze()
            gc.disable()
        if len(self.times) == 10 and (self.profile or self.pyprofile):
            if self.profile:
                self._prof = torch.profiler.profile(
                    activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA])
                self._prof.__enter__()
            else:
                self._prof = cProfile.Profile()
                self._prof.enable()
        self._gc_start = self._gc_total
        self._h = time.thread_time()
        self._t = time.perf_counter()
        if len(self.times) == self.warmup:
            self._window_t0 = self._t

    def stop(self) -> None:
        if self.manual_gc and (len(self.times) + 1) % self.manual_gc == 0:
            gc.collect()
        last = len(self.times) + 1 == self.measure_gc_at
        if not self.free_running or last:
            torch.cuda.synchronize()
        self.times.append(time.perf_counter() - self._t)
        if last:
            self.window_s = time.perf_counter() - self._window_t0
        self.host.append(time.thread_time() - self._h)
        self.gc.append(self._gc_total - self._gc_start)
        free, total = torch.cuda.mem_get_info()
        self.device_used = max(self.device_used, total - free)
        if len(self.times) == self.measure_gc_at:  # what a full collection costs now (lightning: frozen)
            t = time.perf_counter()
            gc.collect()
            self.full_gc_ms = round(1e3 * (time.perf_counter() - t), 1)
        if self._prof is not None and len(self.times) == 13:
            self._report_profile()
            self._prof = None

    def _report_profile(self) -> None:
        """Rank 0 prints the tables; with BENCH_PROFILE_DIR set, every rank writes its own
        (rank{N}.txt), so that the ranks of one step can be compared (EP, TP)."""
        rank = int(os.environ.get("RANK", 0))
        out_dir = os.environ.get("BENCH_PROFILE_DIR")
        if isinstance(self._prof, cProfile.Profile):
            self._prof.disable()
            buf = io.StringIO()
            stats = pstats.Stats(self._prof, stream=buf)
            stats.sort_stats("tottime").print_stats(30)
            stats.sort_stats("cumulative").print_stats(45)
            text = buf.getvalue()
        else:
            self._prof.__exit__(None, None, None)
            text = profile_tables(self._prof)
        if out_dir:
            os.makedirs(out_dir, exist_ok=True)
            with open(os.path.join(out_dir, f"rank{rank}.txt"), "w") as f:
                f.write(f"steps 10-12, step s {self.times[10:13]}\n{text}")
        elif rank == 0:
            print(text, flush=True)

    def host_summary(self, warmup: int) -> dict:
        """This rank's mean main-thread CPU ms and GC ms per timed step."""
        n = max(1, len(self.times) - warmup)
        return {"host_ms": round(1e3 * sum(self.host[warmup:]) / n, 1),
                "gc_ms": round(1e3 * sum(self.gc[warmup:]) / n, 2),
                "gc_max_ms": round(1e3 * max((p for i, p in self.gc_pauses if warmup <= i < len(self.times)),
                                            default=0.0), 1),
                "full_gc_ms": self.full_gc_ms}


class StepProfile:
    """torch.profiler over the 3 steps from step `first` (0-based; their times count in the run's
    result: profile in a run of its own), written as profile_tables to DIR/<name>.txt."""

    def __init__(self, out_dir: str, name: str, first: int) -> None:
        self.out_dir, self.name, self.first, self.prof = out_dir, name, first, None

    def start(self, step: int) -> None:
        """Before step `step` (0-based)."""
        if step == self.first:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.prof = torch.profiler.profile(activities=activities)
            self.prof.__enter__()

    def end(self, times: list) -> None:
        """After a step; `times`: the step times so far."""
        if self.prof is not None and len(times) == self.first + 3:
            self.prof.__exit__(None, None, None)
            os.makedirs(self.out_dir, exist_ok=True)
            with open(os.path.join(self.out_dir, f"{self.name}.txt"), "w") as f:
                f.write(f"steps {self.first + 1}-{self.first + 3}, step s {times[-3:]}\n" + profile_tables(self.prof))
            self.prof = None


def profile_tables(prof, steps: int = 3) -> str:
    """A finished torch.profiler run as text: the ops by host time, then by device time, then how
    long the GPU sat idle between kernels and its largest gaps (what the host made it wait for)."""
    ka = prof.key_averages()
    kernels = [(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
               if e.device_type == torch.autograd.DeviceType.CUDA]
    gaps = idle_gaps(kernels)
    return (ka.table(sort_by="self_cpu_time_total", row_limit=25) + "\n"
            + ka.table(sort_by="self_device_time_total", row_limit=40)
            + f"\nGPU idle over the {steps} steps: {gaps['idle_us'] / 1e3:.1f} of {gaps['span_us'] / 1e3:.1f} ms; "
              "largest gaps (µs, kernel before -> kernel after):\n"
            + "\n".join(f"  {g['us']:>9} {g['after'][:70]} -> {g['before'][:70]}" for g in gaps["largest"]))


def idle_gaps(kernels: list[tuple[str, float, float]], top: int = 8) -> dict:
    """Where the GPU waits: `kernels` (name, start, end) in µs, from any streams. Busy time is the
    union of the intervals; each gap between them is named by the kernels on either side (the
    one that ended last, the one that starts next). Returns span, busy and idle µs and the
    `top` largest gaps, largest first."""
    busy, gaps, end, last = 0.0, [], None, None
    for name, start, stop in sorted(kernels, key=lambda k: k[1]):
        if end is None or start > end:
            if end is not None:
                gaps.append((start - end, last, name))
            busy += stop - start
            end, last = stop, name
        elif stop > end:
            busy += stop - end
            end, last = stop, name
    span = end - min(k[1] for k in kernels) if kernels else 0.0
    gaps.sort(key=lambda g: -g[0])
    return {"span_us": span, "busy_us": busy, "idle_us": span - busy,
            "largest": [{"us": round(g, 1), "after": a, "before": b} for g, a, b in gaps[:top]]}


def pin_cpus() -> list[int]:
    """Give this rank its own block of the machine's CPUs: its threads and data workers inherit
    it, so the scheduler cannot move a rank's main thread onto a core another rank keeps busy."""
    cpus = sorted(os.sched_getaffinity(0))
    rank, ranks = int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    per = len(cpus) // ranks
    mine = cpus[rank * per:(rank + 1) * per]
    os.sched_setaffinity(0, mine)
    return mine


def run_raw(cfg: GPTConfig, parallel: ParallelConfig, args, loader) -> StepTimer:
    from megatron.core import parallel_state
    from megatron.core.distributed import (DistributedDataParallel, DistributedDataParallelConfig,
                                           finalize_model_grads)
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from lightning_mcore.model.build import build_chunks
    from lightning_mcore.model.config import to_transformer_config
    from lightning_mcore.model.init import init_layout_invariant
    from lightning_mcore.strategy.cuda_graphs import graph_safe_rng
    from lightning_mcore.strategy.parallel import context_parallel_slice

    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    # Lightning binds the process group to the device (eager NCCL init; subgroups split from it)
    dist.init_process_group("nccl", device_id=device if args.nccl_device_id else None)
    parallel_state.initialize_model_parallel(**parallel.sizes())
    model_parallel_cuda_manual_seed(1234, **graph_safe_rng(cfg, use_te=True))
    tf = to_transformer_config(cfg, parallel, torch.bfloat16, on_cpu=False, use_te=True)
    # --init-device-context: build as Lightning's configure_model() does, inside torch.device(cuda)
    with device if args.init_device_context else contextlib.nullcontext():
        chunks = [c.cuda() for c in build_chunks(cfg, tf, use_te=True, fuse_wgrad=not args.no_wgrad_fusion)]
    init_layout_invariant(chunks, cfg, seed=1234)  # the same initial weights as (b): same routing, same losses
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=True,
                                               use_distributed_optimizer=True, check_for_nan_in_grad=False)
    chunks = [DistributedDataParallel(config=tf, ddp_config=ddp_config, module=c, disable_bucketing=i > 0)
              for i, c in enumerate(chunks)]
    tf.no_sync_func = [c.no_sync for c in chunks] if len(chunks) > 1 else chunks[0].no_sync
    tf.grad_sync_func = [c.start_grad_sync for c in chunks] if len(chunks) > 1 else chunks[0].start_grad_sync
    tf.finalize_model_grads_func = finalize_model_grads
    opt = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=args.lr, weight_decay=0.01, adam_beta2=0.95, clip_grad=1.0,
                        bf16=True, params_dtype=torch.bfloat16, use_distributed_optimizer=True,
                        use_precision_aware_optimizer=not args.no_precision_aware,
                        store_param_remainders=False),  # as lightning-mcore sets it (strategy/optimizer.py)
        chunks)
    fb = get_forward_backward_func()
    cp = parallel.context_parallel_size
    # each data-parallel rank its own rows, in the order Lightning's DistributedSampler gives them
    dp, dp_rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    if dp > 1:
        loader = DataLoader(loader.dataset, batch_size=loader.batch_size, num_workers=2, pin_memory=True,
                            sampler=DistributedSampler(loader.dataset, dp, dp_rank, shuffle=False))

    def forward_step(it, m):
        b = next(it)
        out = m(input_ids=b["tokens"], position_ids=b["position_ids"], attention_mask=None,
                labels=b["labels"])

        def loss_fn(token_losses):
            mask = b["loss_mask"].reshape(-1).float()
            total = (token_losses.float().reshape(-1) * mask).sum()
            return total, mask.sum().int(), {"loss": torch.stack([total.detach(), mask.sum()])}

        return out, loss_fn

    timer = StepTimer(args.profile, args.pyprofile, args.manual_gc)
    timer.measure_gc_at, timer.free_running, timer.warmup = args.steps, args.free_running, args.warmup
    for step, batch in enumerate(loader):
        if step == args.steps:
            break
        timer.start()
        batch = {k: v.cuda(non_blocking=True) for k, v in batch.items()}
        micro = [{k: v[i:i + args.mbs] for k, v in batch.items()}
                 for i in range(0, batch["tokens"].shape[0], args.mbs)]
        if cp > 1:
            cp_rank = parallel_state.get_context_parallel_rank()
            micro = [context_parallel_slice(mb, cp, cp_rank) for mb in micro]
        for c in chunks:
            c.zero_grad_buffer()
        opt.zero_grad()
        outputs = fb(forward_step_func=forward_step,
                     data_iterator=[iter(micro) for _ in chunks] if len(chunks) > 1 else iter(micro),
                     model=chunks, num_microbatches=len(micro),
                     seq_length=args.seq, micro_batch_size=args.mbs)  # mcore divides seq by cp itself
        if args.sync_before_update:  # the host idle until backward ends, as before lightning's check
            torch.cuda.synchronize()
        opt.step()
        timer.stop()
        if args.losses and parallel_state.is_pipeline_last_stage(ignore_virtual=True):
            total = torch.stack([o["loss"] for o in outputs]).sum(0)
            dist.all_reduce(total, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
            timer.losses.append(float(total[0] / total[1]))
    return timer


def run_lightning(cfg: GPTConfig, parallel: ParallelConfig, args, loader) -> StepTimer:
    """lightning-mcore with its defaults on GPU (distributed optimizer, overlapped grad reduce)
    and the MegatronThroughput callback, whose logged MFU is reported next to ours."""
    import lightning as L

    from lightning.pytorch.strategies import DDPStrategy

    from lightning_mcore import MegatronStrategy, MegatronThroughput, OptimizerSettings, PretrainModule

    timer = StepTimer(args.profile, args.pyprofile, args.manual_gc)
    timer.measure_gc_at, timer.free_running, timer.warmup = args.steps, args.free_running, args.warmup
    logged: dict = {}

    class Timing(L.Callback):
        def on_train_batch_start(self, *a):
            timer.start()

        def on_train_batch_end(self, trainer, *a):
            timer.stop()
            if args.losses:
                timer.losses.append(float(trainer.callback_metrics["train/loss"]))

        def on_train_end(self, trainer, *a):
            logged.update({k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("perf/")})

    class NoInitDevice(MegatronStrategy):
        """--no-init-device-context: configure_model() without Lightning's torch.device(cuda)."""

        @contextlib.contextmanager
        def tensor_init_context(self, empty_init=None):
            yield

    base = NoInitDevice if args.no_init_device_context else MegatronStrategy

    class BoundNccl(base):
        """--nccl-device-id: torch.distributed bound to the device, as Lightning's DDPStrategy starts
        it (MegatronStrategy does not: every mcore group would open its NCCL communicator at once)."""

        def setup_distributed(self) -> None:
            DDPStrategy.setup_distributed(self)

    strategy = (BoundNccl if args.nccl_device_id else base)(
        **parallel.sizes(), sequence_parallel=parallel.sequence_parallel,
        global_batch_size=args.gbs, micro_batch_size=args.mbs, overlap_param_gather=args.overlap_param_gather,
    )
    # the callback measures every `window` steps: the last of its windows ends with the last
    # step and lies inside the timed steps (all of them when the window divides the steps)
    window = next((w for w in range(args.steps - args.warmup, 1, -1) if args.steps % w == 0), args.steps)
    trainer = L.Trainer(accelerator="gpu", devices=int(os.environ.get("WORLD_SIZE", 1)),
                        strategy=strategy, precision="bf16-mixed", max_steps=args.steps,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0,
                        callbacks=[Timing(), MegatronThroughput(window_size=window)])
    optim = OptimizerSettings(lr=args.lr, min_lr=args.lr / 10, weight_decay=0.01, clip_grad=1.0,
                              warmup_steps=args.lr_warmup, decay_style="cosine" if args.lr_warmup else "constant",
                              precision_aware=False if args.no_precision_aware else None,
                              on_nonfinite="stop_after_update" if args.check_after_update else "stop")
    trainer.fit(PretrainModule(cfg, optim), loader)
    timer.callback = logged
    assert strategy.parallel.use_distributed_optimizer and strategy.parallel.overlap_grad_reduce
    assert {part.config.use_precision_aware_optimizer for part in trainer.optimizers[0].parts} == {
        not args.no_precision_aware}
    return timer


def parse_args(argv=None) -> argparse.Namespace:
    """The command line, checked (also what run_issue47_gpu.sh's dry run parses)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--impl", choices=["raw", "lightning", "hf-eager", "hf-compile"], required=True)
    ap.add_argument("--shape", default="llama-1.2b", choices=sorted(SHAPES))
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--vpp", type=int, default=None)
    ap.add_argument("--cp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--no-sp", action="store_true", help="TP without sequence parallelism")
    ap.add_argument("--fp8", choices=["delayed", "current"], default=None)
    ap.add_argument("--fp8-amax", default=None, metavar="LEN:ALGO",
                    help="delayed scaling's amax history instead of mcore's 1:most_recent, e.g. 1024:max (NeMo's)")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--mbs", type=int, default=1)
    ap.add_argument("--gbs", type=int, default=8, help="global batch (sequences per step)")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=10, help="untimed first steps")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--lr-warmup", type=int, default=0, help="LR warmup steps, then cosine (lightning)")
    ap.add_argument("--data", default="random", help="'random' or a real_text.py token directory")
    ap.add_argument("--losses", action="store_true", help="report every step's loss")
    ap.add_argument("--recompute", choices=["full", "selective"], default=None)
    ap.add_argument("--recompute-block", type=int, default=None, metavar="N",
                    help="with --recompute full: recompute only the first N layers (mcore's block method)")
    ap.add_argument("--profile", action="store_true", help="print torch.profiler tables of steps 10-12")
    ap.add_argument("--pyprofile", action="store_true", help="print cProfile tables of steps 10-12 (rank 0)")
    ap.add_argument("--nccl-device-id", action="store_true",
                    help="raw only: init_process_group(device_id=...), as Lightning's DDP strategies do")
    ap.add_argument("--init-device-context", action="store_true",
                    help="raw only: build the model inside torch.device(cuda), as Lightning's configure_model does")
    ap.add_argument("--no-init-device-context", action="store_true",
                    help="lightning only: build the model outside Lightning's torch.device(cuda) context")
    ap.add_argument("--free-running", action="store_true",
                    help="synchronise only at the timed window's ends (the host runs ahead between steps, "
                         "as without a timer); step_s = window time / steps")
    ap.add_argument("--sync-before-update", action="store_true",
                    help="raw only: the host waits for the backward pass before launching the optimizer "
                         "step (an upper bound on what lightning-mcore's NaN/inf check costs)")
    ap.add_argument("--check-after-update", action="store_true",
                    help="lightning only: on_nonfinite='stop_after_update' (the NaN/inf check reads the "
                         "loss and gradient norm while the update runs, not before it)")
    ap.add_argument("--pin-cpus", action="store_true",
                    help="each rank on its own block of CPUs (threads and data workers included)")
    ap.add_argument("--moe-capacity", type=float, default=None, metavar="F",
                    help="MoE: fixed expert capacity factor F with padding (no per-layer host sync)")
    ap.add_argument("--manual-gc", type=int, default=0, metavar="N",
                    help="Python's garbage collector off after a freeze, one collection every N steps")
    ap.add_argument("--layers", type=int, default=None, help="override the shape's num_layers")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=JSON",
                    help="a TransformerConfig field for raw and lightning alike (GPTConfig.extra), "
                         "e.g. moe_permute_fusion=true; repeatable")
    ap.add_argument("--cuda-graphs", default=None, metavar="PARTS",
                    help="GPTConfig.cuda_graphs: comma-separated parts (attn,moe_router,...) or 'layer' (whole)")
    ap.add_argument("--experts", default="te", choices=["te", "torch"],
                    help="GPTConfig.moe_grouped_gemm_backend: TE's GroupedLinear or torch's grouped_mm")
    ap.add_argument("--hf-dtype", default="amp", choices=["amp", "bf16", "fp32"],
                    help="hf-eager/hf-compile: precision (hf_baseline.py: amp = fp32 weights + bf16 autocast)")
    ap.add_argument("--hf-experts", default=None, choices=["grouped_mm", "batched_mm", "eager"],
                    help="hf-eager/hf-compile, MoE shapes: transformers' experts_implementation (grouped_mm)")
    ap.add_argument("--hf-attn", default=None, help="hf-eager/hf-compile: attn_implementation (hf_baseline.ATTN)")
    ap.add_argument("--compile-mode", default="default", choices=["default", "max-autotune-no-cudagraphs"],
                    help="hf-compile: torch.compile mode")
    ap.add_argument("--no-precision-aware", action="store_true",
                    help="raw and lightning: mcore keeps its own fp32 master copies (not TE's FusedAdam)")
    ap.add_argument("--no-wgrad-fusion", action="store_true",
                    help="raw only: TE layers return bf16 weight grads that DDP adds to main_grad")
    ap.add_argument("--overlap-param-gather", action="store_true",
                    help="lightning only: the distributed optimizer's parameter all-gather overlapped with the next "
                         "forward (MegatronStrategy(overlap_param_gather=True)) instead of ending each step")
    args = ap.parse_args(argv)
    if args.overlap_param_gather and args.impl != "lightning":
        ap.error("--overlap-param-gather applies to --impl lightning only")
    if args.no_wgrad_fusion and args.impl != "raw":
        ap.error("--no-wgrad-fusion applies to --impl raw only (lightning-mcore always fuses with TE)")
    if args.init_device_context and args.impl != "raw":
        ap.error("--init-device-context applies to --impl raw only (lightning builds inside it already)")
    if args.no_init_device_context and args.impl != "lightning":
        ap.error("--no-init-device-context applies to --impl lightning only")
    if args.sync_before_update and args.impl != "raw":
        ap.error("--sync-before-update applies to --impl raw only")
    if args.check_after_update and args.impl != "lightning":
        ap.error("--check-after-update applies to --impl lightning only")
    if args.free_running and args.impl.startswith("hf"):
        ap.error("--free-running applies to --impl raw and lightning")
    if args.fp8_amax and args.fp8 != "delayed":
        ap.error("--fp8-amax needs --fp8 delayed")
    if args.recompute_block is not None and args.recompute != "full":
        ap.error("--recompute-block needs --recompute full")
    return args


def main() -> None:
    args = parse_args()
    pinned = pin_cpus() if args.pin_cpus else None
    world = int(os.environ.get("WORLD_SIZE", 1))
    shape = dict(SHAPES[args.shape])
    if args.layers:
        shape["num_layers"] = args.layers
    if args.data != "random":
        from pathlib import Path

        from real_text import TokenWindows

        data = TokenWindows(Path(args.data, "tokens.npy"), args.seq)
        meta = json.loads(Path(args.data, "meta.json").read_text())
        shape["vocab_size"] = meta.get("vocab_trained", meta["vocab_size"])
    extra = {}
    if args.fp8_amax:
        length, algo = args.fp8_amax.split(":")
        extra = {"fp8_amax_history_len": int(length), "fp8_amax_compute_algo": algo}
    if args.moe_capacity is not None:
        extra.update(moe_expert_capacity_factor=args.moe_capacity, moe_pad_expert_input_to_capacity=True)
    for item in args.set:
        field, value = item.split("=", 1)
        extra[field] = json.loads(value)
    graphs = None if args.cuda_graphs is None else [] if args.cuda_graphs == "layer" else args.cuda_graphs.split(",")
    cfg = GPTConfig(**shape, seq_length=args.seq, transformer_impl="transformer_engine", fp8=args.fp8,
                    cuda_graphs=graphs, moe_grouped_gemm_backend=args.experts,
                    recompute_granularity=args.recompute, extra=extra,
                    **({} if args.recompute_block is None else
                       dict(recompute_method="block", recompute_num_layers=args.recompute_block)))
    parallel = ParallelConfig(
        tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp,
        virtual_pipeline_model_parallel_size=args.vpp, context_parallel_size=args.cp,
        expert_model_parallel_size=args.ep, expert_tensor_parallel_size=1 if args.ep > 1 else None,
        sequence_parallel=args.tp > 1 and not args.no_sp, use_distributed_optimizer=True,
        overlap_grad_reduce=True)
    dp = world // (args.tp * args.pp * args.cp)
    if args.data == "random":
        data = RandomTokens(args.gbs * (args.steps + 2), args.seq, cfg.vocab_size)
    loader = DataLoader(data, batch_size=args.gbs // dp, num_workers=2, pin_memory=True)
    if args.impl.startswith("hf"):
        from hf_baseline import run_hf

        timer = run_hf(shape, args, loader, compile=args.impl == "hf-compile")
    else:
        timer = (run_raw if args.impl == "raw" else run_lightning)(cfg, parallel, args, loader)

    host = timer.host_summary(args.warmup)
    if dist.is_initialized() and dist.get_world_size() > 1:
        per_rank = [None] * dist.get_world_size()
        dist.all_gather_object(per_rank, host)
    else:
        per_rank = [host]
    if int(os.environ.get("RANK", 0)) == 0:
        timed = timer.times[args.warmup:]
        step = timer.window_s / len(timed) if args.free_running else sum(timed) / len(timed)
        tokens_per_gpu = args.gbs * args.seq / step / world
        mfu = tokens_per_gpu * flops_per_token(cfg, args.seq) / (PEAK_BF16_TFLOPS * 1e12)
        result = {
            "impl": args.impl, "shape": args.shape, "gpus": world, "tp": args.tp, "pp": args.pp,
            "vpp": args.vpp, "cp": args.cp, "ep": args.ep, "sp": parallel.sequence_parallel,
            "fp8": args.fp8, "fp8_amax": args.fp8_amax,
            "recompute": args.recompute, "recompute_block": args.recompute_block,
            "moe_capacity": args.moe_capacity, "pinned_cpus_rank0": pinned, "layers": cfg.num_layers,
            "set": args.set, "cuda_graphs": args.cuda_graphs, "manual_gc": args.manual_gc, "experts": args.experts,
            "nccl_device_id": args.nccl_device_id, "overlap_param_gather": args.overlap_param_gather,
            "init_device_context": args.init_device_context or (args.impl == "lightning"
                                                                and not args.no_init_device_context),
            "seq": args.seq, "mbs": args.mbs, "gbs": args.gbs, "data": args.data,
            "timed_steps": len(timed), "step_s": round(step, 4),
            "tokens_per_s_per_gpu": round(tokens_per_gpu), "mfu": round(mfu, 4),
            "peak_mem_gb": round(torch.cuda.max_memory_allocated() / 2**30, 1),
            "alloc_retries": torch.cuda.memory_stats().get("num_alloc_retries", 0),
            # what the caching allocator held at most, and the most the device had in use at a
            # step's end (the allocator's segments plus CUDA context, NCCL and library workspaces)
            "peak_reserved_gb": round(torch.cuda.max_memory_reserved() / 2**30, 1),
            "device_used_gb": round(timer.device_used / 2**30, 1),
            # one step's time means nothing when free-running (the host runs ahead of the GPU)
            "step_s_spread": None if args.free_running else [round(min(timed), 4), round(max(timed), 4)],
            "free_running": args.free_running, "sync_before_update": args.sync_before_update,
            "check_after_update": args.check_after_update,
            "ranks": per_rank,  # main-thread CPU ms and GC-pause ms per timed step, per rank
            "wgrad_fusion": None if args.impl.startswith("hf") else not args.no_wgrad_fusion,
            "precision_aware": None if args.impl.startswith("hf") else not args.no_precision_aware,
            "device": torch.cuda.get_device_name(), "torch": torch.__version__,
        }
        if getattr(timer, "callback", None):
            result["callback"] = timer.callback
        if getattr(timer, "hf", None):  # hf_baseline's settings (precision, experts, attention, dynamo graphs)
            result["hf"] = timer.hf
        if timer.losses:
            result["losses"] = [round(x, 4) for x in timer.losses]
        print("RESULT " + json.dumps(result), flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
