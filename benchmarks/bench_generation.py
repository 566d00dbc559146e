"""Generation speed (issue 21): our KV-cache engine (lightning_mcore.generation.batched) against
transformers' `generate` on the same weights and prompts. Llama-3.2-1B shape with random bf16
weights, 64 prompts of random tokens, 256 new tokens each, greedy; no stop token, so every row
makes all its tokens and both sides do the same work.

    python benchmarks/bench_generation.py make --out /tmp/gen1b
    python benchmarks/bench_generation.py run --model /tmp/gen1b --impl ours            # CUDA graphs
    python benchmarks/bench_generation.py run --model /tmp/gen1b --impl ours --eager
    python benchmarks/bench_generation.py run --model /tmp/gen1b --impl hf-eager
    python benchmarks/bench_generation.py run --model /tmp/gen1b --impl hf-static   # static cache, compiled

Each run prints one `RESULT {json}` line: new tokens/s over the timed calls, their seconds and
the warm-up calls' (ours: the first call captures the decode steps' CUDA graphs, which later
calls with as many prompts replay, as GRPO's rollouts do each step; transformers' static cache:
the first call compiles), and the prompt lengths (--lengths MIN:MAX, drawn with seed 0).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

SHAPE = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
             num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True,
             rope_theta=500000.0, max_position_embeddings=4096, rms_norm_eps=1e-5)


def make(out: str) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**SHAPE, bos_token_id=1, eos_token_id=2, pad_token_id=0, torch_dtype="bfloat16")
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out)
    print("MADE", out, sum(p.numel() for p in model.parameters()))


def prompts(n: int, lengths: str, vocab: int) -> list[list[int]]:
    low, high = (int(x) for x in lengths.split(":"))
    rng = random.Random(0)
    return [[rng.randrange(10, vocab) for _ in range(rng.randint(low, high))] for _ in range(n)]


def timed(call, warmup: int, repeats: int) -> dict:
    """Seconds of each call: the warm-up calls (ours: capturing the CUDA graphs; transformers'
    static cache: compiling) and the timed ones after them."""
    seconds = []
    for _ in range(warmup + repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        call()
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
    return {"warmup_seconds": [round(s, 3) for s in seconds[:warmup]], "seconds": seconds[warmup:]}


def run_hf(args, batch: list[list[int]]) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16).cuda().eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    width = max(len(p) for p in batch)  # left padding, as for decoder-only generation
    ids = torch.tensor([[0] * (width - len(p)) + p for p in batch], device="cuda")
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device="cuda")
    kwargs = dict(max_new_tokens=args.new, min_new_tokens=args.new, do_sample=False)
    if args.impl == "hf-static":
        kwargs["cache_implementation"] = "static"  # transformers compiles the forward for it

    def call():
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, **kwargs)
        assert out.shape[1] == width + args.new
    return timed(call, args.warmup, args.repeats)


def run_ours(args, batch: list[list[int]]) -> dict:
    import lightning as L
    from torch.utils.data import DataLoader

    from lightning_mcore import MegatronStrategy, PretrainModule
    from lightning_mcore.generation.batched import SamplingSettings

    sampling = SamplingSettings(max_new_tokens=args.new, greedy=True, cuda_graphs=not args.eager)
    result: dict = {}

    class Time(L.Callback):
        def on_predict_end(self, trainer, module):
            def call():
                out = module.generate_batch(batch, sampling)
                assert all(len(c) == args.new for c in out)
            result.update(timed(call, args.warmup, args.repeats))
            if args.profile:
                result["profile"] = profile(lambda: module.generate_batch(batch, SamplingSettings(
                    max_new_tokens=16, greedy=True, cuda_graphs=not args.eager)), args.profile)

    trainer = L.Trainer(accelerator="gpu", devices=1, precision="bf16-mixed", logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        use_distributed_sampler=False, callbacks=[Time()],
                        strategy=MegatronStrategy(global_batch_size=1))
    tiny = {"prompts": [batch[0]], "sampling": SamplingSettings(max_new_tokens=1, greedy=True)}
    module = PretrainModule(args.model, model_overrides={"seq_length": args.seq_length})
    trainer.predict(module, DataLoader([tiny], batch_size=None))
    return result


def profile(call, path: str) -> dict:
    """CPU time by op and the GPU's busy time over one short generate call."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    call()
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        call()
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    events = prof.key_averages()
    gpu = sum(e.self_device_time_total for e in events) / 1e6
    with open(path, "w") as f:
        f.write(events.table(sort_by="self_cpu_time_total", row_limit=40))
        f.write("\n")
        f.write(events.table(sort_by="self_device_time_total", row_limit=25))
    return {"wall_s": wall, "gpu_busy_s": gpu}


def main() -> None:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make")
    m.add_argument("--out", required=True)
    r = sub.add_parser("run")
    r.add_argument("--model", required=True)
    r.add_argument("--impl", choices=("ours", "hf-eager", "hf-static"), required=True)
    r.add_argument("--prompts", type=int, default=64)
    r.add_argument("--new", type=int, default=256)
    r.add_argument("--lengths", default="64:192", help="prompt lengths MIN:MAX (uniform, seed 0)")
    r.add_argument("--seq-length", type=int, default=1024, help="our model's seq_length")
    r.add_argument("--warmup", type=int, default=1)
    r.add_argument("--repeats", type=int, default=3)
    r.add_argument("--profile", default="", help="ours: write a torch.profiler table here")
    r.add_argument("--eager", action="store_true", help="ours: decode steps without CUDA graphs")
    args = ap.parse_args()
    if args.cmd == "make":
        return make(args.out)
    batch = prompts(args.prompts, args.lengths, SHAPE["vocab_size"])
    result = (run_ours if args.impl == "ours" else run_hf)(args, batch)
    seconds = result.pop("seconds")
    tokens = args.prompts * args.new
    print("RESULT " + json.dumps({
        "impl": args.impl + ("-eager" if args.eager else ""), "prompts": args.prompts, "new_tokens": args.new, "lengths": args.lengths,
        "seconds": [round(s, 3) for s in seconds], "tokens_per_s": round(tokens / statistics.median(seconds), 1),
        "device": torch.cuda.get_device_name(), **result}), flush=True)


if __name__ == "__main__":
    main()
