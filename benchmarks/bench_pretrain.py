"""Pretraining throughput: lightning-mcore (Trainer + MegatronStrategy) vs a raw mcore loop.

Both sides use the same TransformerConfig (built by lightning_mcore.model.config), the same
Transformer Engine layer spec, mcore DDP + distributed optimizer with overlapped grad reduce,
the same synthetic token batches from a CPU DataLoader, and the same step count. Launch with
torchrun (one process per GPU):

    torchrun --nproc-per-node 1 benchmarks/bench_pretrain.py --impl raw
    torchrun --nproc-per-node 2 benchmarks/bench_pretrain.py --impl lightning --tp 2

Prints one JSON line (rank 0): tokens/s/GPU, MFU, peak memory, mean step time.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

from lightning_mcore import GPTConfig
from lightning_mcore.strategy.parallel import ParallelConfig

PEAK_BF16_TFLOPS = 989.0  # H100/H200 SXM dense bf16

SHAPES = {
    "llama-1.2b": dict(num_layers=16, hidden_size=2048, ffn_hidden_size=8192, num_attention_heads=32,
                       num_query_groups=8, vocab_size=128256, rotary_base=500000.0),
    "llama-3b": dict(num_layers=28, hidden_size=3072, ffn_hidden_size=8192, num_attention_heads=24,
                     num_query_groups=8, vocab_size=128256, rotary_base=500000.0),
    "llama-8b": dict(num_layers=32, hidden_size=4096, ffn_hidden_size=14336, num_attention_heads=32,
                     num_query_groups=8, vocab_size=128256, rotary_base=500000.0),
}


def flops_per_token(cfg: GPTConfig, seq: int) -> float:
    """Training FLOPs per token (forward + backward = 3 x forward), Megatron's convention:
    all matmuls incl. the LM head, attention scores over the full s x s matrix (not halved)."""
    h, q = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim
    kv = (cfg.num_query_groups or cfg.num_attention_heads) * cfg.head_dim
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * cfg.ffn_hidden_size  # qkv, proj, SwiGLU
    attention = 2 * seq * q  # QK^T and AV
    forward = 2 * (cfg.num_layers * (per_layer + attention) + h * cfg.vocab_size)
    return 3.0 * forward


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
    """Wall time of each optimizer step, CUDA-synchronised; optionally profiles steps 10-12."""

    def __init__(self, profile: bool = False) -> None:
        self.times: list[float] = []
        self._t = 0.0
        self.profile = profile
        self._prof = None

    def start(self) -> None:
        torch.cuda.synchronize()
        if self.profile and len(self.times) == 10:
            self._prof = torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA])
            self._prof.__enter__()
        self._t = time.perf_counter()

    def stop(self) -> None:
        torch.cuda.synchronize()
        self.times.append(time.perf_counter() - self._t)
        if self._prof is not None and len(self.times) == 13:
            self._prof.__exit__(None, None, None)
            if int(os.environ.get("RANK", 0)) == 0:
                ka = self._prof.key_averages()
                print(ka.table(sort_by="self_cpu_time_total", row_limit=12), flush=True)
                print(ka.table(sort_by="self_device_time_total", row_limit=8), flush=True)
            self._prof = None


def run_raw(cfg: GPTConfig, parallel: ParallelConfig, args, loader) -> StepTimer:
    from megatron.core import parallel_state
    from megatron.core.distributed import (DistributedDataParallel, DistributedDataParallelConfig,
                                           finalize_model_grads)
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from lightning_mcore.model.config import to_transformer_config

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=parallel.tensor_model_parallel_size)
    model_parallel_cuda_manual_seed(1234)
    tf = to_transformer_config(cfg, parallel, torch.bfloat16, on_cpu=False, use_te=True)
    model = GPTModel(
        config=tf, transformer_layer_spec=get_gpt_layer_with_transformer_engine_spec(),
        vocab_size=cfg.padded_vocab_size(parallel.tensor_model_parallel_size),
        max_sequence_length=cfg.seq_length, pre_process=True, post_process=True,
        parallel_output=True, share_embeddings_and_output_weights=cfg.tie_word_embeddings,
        position_embedding_type="rope", rotary_base=int(cfg.rotary_base),
    ).cuda()
    ddp = DistributedDataParallel(
        config=tf, module=model,
        ddp_config=DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=True, use_distributed_optimizer=True,
            check_for_nan_in_grad=False),
    )
    tf.no_sync_func, tf.grad_sync_func = ddp.no_sync, ddp.start_grad_sync
    tf.finalize_model_grads_func = finalize_model_grads
    opt = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-4, weight_decay=0.01, adam_beta2=0.95, clip_grad=1.0,
                        bf16=True, params_dtype=torch.bfloat16, use_distributed_optimizer=True),
        [ddp])
    fb = get_forward_backward_func()

    def forward_step(it, m):
        b = next(it)
        out = m(input_ids=b["tokens"], position_ids=b["position_ids"], attention_mask=None,
                labels=b["labels"])

        def loss_fn(token_losses):
            mask = b["loss_mask"].reshape(-1).float()
            total = (token_losses.float().reshape(-1) * mask).sum()
            return total, mask.sum().int(), {"loss": torch.stack([total.detach(), mask.sum()])}

        return out, loss_fn

    timer = StepTimer(args.profile)
    steps = 0
    for batch in loader:
        if steps == args.steps:
            break
        timer.start()
        batch = {k: v.cuda(non_blocking=True) for k, v in batch.items()}
        micro = [{k: v[i:i + args.mbs] for k, v in batch.items()}
                 for i in range(0, batch["tokens"].shape[0], args.mbs)]
        ddp.zero_grad_buffer()
        opt.zero_grad()
        fb(forward_step_func=forward_step, data_iterator=iter(micro), model=[ddp],
           num_microbatches=len(micro), seq_length=cfg.seq_length, micro_batch_size=args.mbs)
        opt.step()
        timer.stop()
        steps += 1
    return timer


def run_lightning(cfg: GPTConfig, parallel: ParallelConfig, args, loader) -> StepTimer:
    import lightning as L

    from lightning_mcore import MegatronStrategy, OptimizerSettings, PretrainModule

    timer = StepTimer(args.profile)

    class Timing(L.Callback):
        def on_train_batch_start(self, *a):
            timer.start()

        def on_train_batch_end(self, *a):
            timer.stop()

    strategy = MegatronStrategy(
        tensor_model_parallel_size=parallel.tensor_model_parallel_size,
        sequence_parallel=parallel.sequence_parallel,
        use_distributed_optimizer=True, overlap_grad_reduce=True,
        global_batch_size=args.gbs, micro_batch_size=args.mbs,
    )
    trainer = L.Trainer(accelerator="gpu", devices=int(os.environ.get("WORLD_SIZE", 1)),
                        strategy=strategy, precision="bf16-mixed", max_steps=args.steps,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[Timing()], num_sanity_val_steps=0)
    module = PretrainModule(cfg, OptimizerSettings(lr=1e-4, weight_decay=0.01, clip_grad=1.0))
    trainer.fit(module, loader)
    return timer


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--impl", choices=["raw", "lightning"], required=True)
    ap.add_argument("--shape", default="llama-1.2b", choices=sorted(SHAPES))
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--mbs", type=int, default=1)
    ap.add_argument("--gbs", type=int, default=8, help="global batch (sequences per step)")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--no-sp", action="store_true", help="TP without sequence parallelism")
    ap.add_argument("--profile", action="store_true", help="print torch.profiler tables of steps 10-12")
    args = ap.parse_args()

    world = int(os.environ.get("WORLD_SIZE", 1))
    cfg = GPTConfig(**SHAPES[args.shape], seq_length=args.seq, transformer_impl="transformer_engine")
    parallel = ParallelConfig(tensor_model_parallel_size=args.tp, sequence_parallel=args.tp > 1 and not args.no_sp,
                              use_distributed_optimizer=True, overlap_grad_reduce=True)
    dp = world // args.tp
    loader = DataLoader(RandomTokens(args.gbs * (args.steps + 2), args.seq, cfg.vocab_size),
                        batch_size=args.gbs // dp, num_workers=2, pin_memory=True)
    timer = (run_raw if args.impl == "raw" else run_lightning)(cfg, parallel, args, loader)

    if int(os.environ.get("RANK", 0)) == 0:
        timed = timer.times[args.warmup:]
        step = sum(timed) / len(timed)
        tokens_per_gpu = args.gbs * args.seq / step / world
        mfu = tokens_per_gpu * flops_per_token(cfg, args.seq) / (PEAK_BF16_TFLOPS * 1e12)
        print("RESULT " + json.dumps({
            "impl": args.impl, "shape": args.shape, "gpus": world, "tp": args.tp, "seq": args.seq,
            "sp": parallel.sequence_parallel, "mbs": args.mbs, "gbs": args.gbs, "timed_steps": len(timed), "step_s": round(step, 4),
            "tokens_per_s_per_gpu": round(tokens_per_gpu), "mfu": round(mfu, 4),
            "peak_mem_gb": round(torch.cuda.max_memory_allocated() / 2**30, 1),
            "device": torch.cuda.get_device_name(), "torch": torch.__version__,
        }), flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
