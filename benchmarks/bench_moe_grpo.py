"""MoE GRPO on GPU (issue 46): a Qwen3-30B-A3B-shaped model cut to a few layers (random bf16
weights, saved as an HF checkpoint), GRPO with LoRA at EP=2 (or `--ep 1`: DP=2, each GPU holding
every expert), with and without routing replay; and the same rollout shape through transformers'
`generate` on one GPU.

    python benchmarks/bench_moe_grpo.py make --out /tmp/moe --layers 8
    python benchmarks/bench_moe_grpo.py grpo --model /tmp/moe --replay off      # 2 GPUs (Lightning's launcher)
    python benchmarks/bench_moe_grpo.py grpo --model /tmp/moe --replay r3
    CUDA_VISIBLE_DEVICES=0 python benchmarks/bench_moe_grpo.py hf --model /tmp/moe --impl hf-static --rows 64

Prompts are random token ids of --prompt-length; no stop token, so every completion has
--new tokens on both sides. `grpo` prints one `RESULT {json}` line per optimizer step (rank 0):
the rollout's seconds and tokens/s (this rank's completions over the generation's wall time:
under EP every rank generates all ranks' prompts), the log-prob passes' seconds (the reference
with adapters off), the training step's, peak memory, and the train/rollout mismatch metrics.
`hf` prints one per timed generate call set. `--tiny` runs the same code on CPU with a small
shape, to try the script without a GPU.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

A3B = dict(hidden_size=2048, intermediate_size=6144, num_attention_heads=32, num_key_value_heads=4,
           head_dim=128, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
           norm_topk_prob=True, vocab_size=151936, rope_theta=1000000.0, max_position_embeddings=4096,
           rms_norm_eps=1e-6, tie_word_embeddings=False)
TINY = dict(A3B, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, vocab_size=512)


def make(out: str, layers: int, tiny: bool) -> None:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    config = Qwen3MoeConfig(**(TINY if tiny else A3B), num_hidden_layers=layers, bos_token_id=1,
                            eos_token_id=2, pad_token_id=0)
    device = "cuda" if torch.cuda.is_available() and not tiny else "cpu"
    with torch.device(device):
        model = Qwen3MoeForCausalLM(config).to(torch.bfloat16 if not tiny else torch.float32)
    model.save_pretrained(out)
    print("MADE", out, sum(p.numel() for p in model.parameters()), flush=True)


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(length)] for _ in range(n)]


def varied(prompts, completions, **_):
    """A reward that differs within groups (the text's character codes mod 3)."""
    return [float(sum(map(ord, c)) % 3) for c in completions]


def run_grpo(args) -> None:
    import lightning as L

    from lightning_mcore import GRPOModule, GRPOSampling, LoRAConfig, MegatronStrategy, OptimizerSettings
    from lightning_mcore import RolloutCorrection

    class Ids:
        """Stands in for a tokenizer: completions are scored on their ids' text."""

        def decode(self, ids, skip_special_tokens=True):
            return " ".join(map(str, ids))

    class Prompts(L.LightningDataModule):
        tokenizer, stop_token_ids = Ids(), []

        def __init__(self, per_rank: int, vocab: int):
            super().__init__()
            self.per_rank, self.vocab = per_rank, vocab

        def train_dataloader(self):
            rank = self.trainer.global_rank
            batches = [{"prompt_ids": prompts(self.per_rank, args.prompt_length, self.vocab, 1000 * step + rank),
                        "prompt": [""] * self.per_rank} for step in range(args.steps)]
            return torch.utils.data.DataLoader(batches, batch_size=None)

    class Timed(GRPOModule):
        def make_rollout(self, batch):
            if not args.profile or self.trainer.global_step != 1:
                return super().make_rollout(batch)
            from torch.profiler import ProfilerActivity, profile

            sync()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                rollout = super().make_rollout(batch)
                sync()
            if self.trainer.global_rank == 0:
                events = prof.key_averages()
                with open(args.profile, "w") as f:
                    f.write(f"GPU busy (sum of kernel time): {sum(e.self_device_time_total for e in events) / 1e6:.2f} s\n")
                    f.write(events.table(sort_by="self_cpu_time_total", row_limit=35))
                    f.write("\n")
                    f.write(events.table(sort_by="self_device_time_total", row_limit=25))
            return rollout

        def _token_logps(self, batch, reference):
            sync()
            start = time.perf_counter()
            out = super()._token_logps(batch, reference)
            sync()
            self.logps_s = getattr(self, "logps_s", 0.0) + time.perf_counter() - start
            return out

    class Report(L.Callback):
        def on_train_batch_start(self, trainer, module, *a):
            module.logps_s = 0.0
            if torch.cuda.is_available():
                torch.cuda.reset_peak_memory_stats()

        def on_train_batch_end(self, trainer, module, *a):
            got = {k: float(v) for k, v in trainer.callback_metrics.items()}
            peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0
            peaks = [peak] * trainer.world_size
            if torch.distributed.is_initialized():
                torch.distributed.all_gather_object(peaks, peak)
            if trainer.global_rank == 0:
                keep = ("rollout_s", "rollout_tokens_per_s", "train_step_s", "rollout_logp_diff", "rollout_kl",
                        "routing_mismatch", "loss", "reward", "completion_length")
                print("RESULT " + json.dumps({
                    "bench": "moe_grpo", "replay": args.replay, "ep": args.ep, "step": trainer.global_step,
                    "precision": precision, "fp32_logits": args.fp32_logits == "on",
                    "logps_s": round(module.logps_s, 3), "peak_gib": [round(p, 2) for p in peaks],
                    **{k: got[f"train/{k}"] for k in keep if f"train/{k}" in got},
                    "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                    "gpus": trainer.world_size, "lora": args.lora, "prompts_per_rank": args.prompts, "generations": args.generations,
                    "prompt_length": args.prompt_length, "new": args.new}), flush=True)

    gpu = torch.cuda.is_available() and not args.tiny
    per_rank = args.prompts * args.generations
    precision = args.precision if gpu else "32-true"
    trainer = L.Trainer(
        accelerator="gpu" if gpu else "cpu", devices=2, max_steps=args.steps, precision=precision,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        use_distributed_sampler=False, callbacks=[Report()],
        strategy=MegatronStrategy(expert_model_parallel_size=args.ep, global_batch_size=2 * per_rank,
                                  micro_batch_size=args.micro_batch),
    )
    module = Timed(args.model, OptimizerSettings(lr=1e-5, warmup_steps=0),
                   model_overrides={"seq_length": args.prompt_length + args.new},
                   lora=None if args.lora == "none" else LoRAConfig(target_modules=args.lora, rank=8, alpha=16),
                   reward_funcs=[varied],
                   num_generations=args.generations, max_completion_length=args.new, beta=0.04,
                   sampling=GRPOSampling(temperature=1.0, seed=0),
                   correction=RolloutCorrection(routing_replay=args.replay, fp32_logits=args.fp32_logits == "on"))
    vocab = module.model_config.vocab_size
    trainer.fit(module, Prompts(args.prompts, vocab))


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run_hf(args) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16).cuda().eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    ids = torch.tensor(prompts(args.rows, args.prompt_length, model.config.vocab_size, 0), device="cuda")
    kwargs = dict(max_new_tokens=args.new, min_new_tokens=args.new, do_sample=True, temperature=1.0,
                  top_k=0, top_p=1.0)
    if args.impl == "hf-static":
        kwargs["cache_implementation"] = "static"  # transformers compiles the forward for it
    seconds = []
    for _ in range(args.warmup + args.repeats):
        sync()
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(input_ids=ids, **kwargs)
        sync()
        seconds.append(time.perf_counter() - start)
        assert out.shape[1] == args.prompt_length + args.new
    timed = seconds[args.warmup:]
    print("RESULT " + json.dumps({
        "bench": "moe_generate", "impl": args.impl, "rows": args.rows, "new": args.new,
        "prompt_length": args.prompt_length, "warmup_seconds": [round(s, 2) for s in seconds[:args.warmup]],
        "seconds": [round(s, 3) for s in timed],
        "tokens_per_s": round(args.rows * args.new / statistics.median(timed), 1),
        "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
        "device": torch.cuda.get_device_name()}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make")
    m.add_argument("--out", required=True)
    m.add_argument("--layers", type=int, default=8)
    m.add_argument("--tiny", action="store_true")
    g = sub.add_parser("grpo")
    g.add_argument("--model", required=True)
    g.add_argument("--replay", choices=("off", "r3"), default="off")
    g.add_argument("--ep", type=int, default=2, help="expert-parallel size (1: each GPU holds every expert, DP=2)")
    g.add_argument("--steps", type=int, default=3)
    g.add_argument("--fp32-logits", choices=("on", "off"), default="off", help="RolloutCorrection.fp32_logits")
    g.add_argument("--precision", choices=("bf16-mixed", "32-true"), default="bf16-mixed")
    g.add_argument("--prompts", type=int, default=8, help="prompts per rank and step")
    g.add_argument("--generations", type=int, default=8)
    g.add_argument("--prompt-length", type=int, default=128)
    g.add_argument("--new", type=int, default=256)
    g.add_argument("--micro-batch", type=int, default=8)
    g.add_argument("--tiny", action="store_true")
    g.add_argument("--lora", default="all-linear", help="LoRA target_modules, or none (full training)")
    g.add_argument("--profile", default="", help="write a torch.profiler table of the second rollout here")
    h = sub.add_parser("hf")
    h.add_argument("--model", required=True)
    h.add_argument("--impl", choices=("hf-eager", "hf-static"), default="hf-static")
    h.add_argument("--rows", type=int, default=64)
    h.add_argument("--prompt-length", type=int, default=128)
    h.add_argument("--new", type=int, default=256)
    h.add_argument("--warmup", type=int, default=1)
    h.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    {"make": lambda: make(args.out, args.layers, args.tiny), "grpo": lambda: run_grpo(args),
     "hf": lambda: run_hf(args)}[args.cmd]()


if __name__ == "__main__":
    main()
