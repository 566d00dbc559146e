"""Vision-language SFT throughput: ours (VisionLanguageSFTModule, packed rows) against HF
transformers (Qwen2_5_VLForConditionalGeneration + peft, one sample per row) on the same
synthetic samples, LoRA on the decoder, vision encoder frozen, bf16.

    python benchmarks/bench_vlm_sft.py make --out /tmp/vl7b            # random Qwen2.5-VL-7B shape
    torchrun --nproc-per-node 1 benchmarks/bench_vlm_sft.py ours --model /tmp/vl7b
    torchrun --nproc-per-node 2 benchmarks/bench_vlm_sft.py ours --model /tmp/vl7b --tp 2 [--full]
    python benchmarks/bench_vlm_sft.py hf --model /tmp/vl7b --micro-batch 2

A sample: `--text` text tokens around one image of `--grid` patches (28x28 patches of 14 px:
392x392 pixels, 196 image tokens), loss on its second half. Ours packs seq // sample samples per
row; HF runs `--micro-batch` samples per forward (no padding: all samples have one length) and
accumulates to the same samples per step. Prints `RESULT {...}`: tokens/s per GPU (every
sample token, image tokens included), the vision encoder's patches/s, peak memory, and MFU of
the decoder's LoRA step (2 x forward, Megatron's attention count over each sample) plus the
encoder's forward (2 x its parameters per patch; its attention not counted).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

UNTIMED_STEPS = 3
PEAK_BF16_TFLOPS = 989.0  # H100/H200 SXM dense bf16
SHAPES = {
    # Qwen2.5-VL-7B-Instruct's config.json (text and vision)
    "qwen2_5_vl_7b": dict(
        text_config=dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                         num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
                         max_position_embeddings=128000, rms_norm_eps=1e-6,
                         rope_parameters=dict(rope_type="default", rope_theta=1000000.0,
                                              mrope_section=[16, 24, 24])),
        vision_config=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16,
                           out_hidden_size=3584, patch_size=14, spatial_merge_size=2,
                           temporal_patch_size=2, window_size=112, fullatt_block_indexes=[7, 15, 23, 31],
                           tokens_per_second=2),
        image_token_id=151655, video_token_id=151656, vision_start_token_id=151652,
        vision_end_token_id=151653, tie_word_embeddings=False),
    # a CPU smoke test of this script
    "tiny": dict(
        text_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=152064, max_position_embeddings=8192,
                         rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[2, 3, 3])),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=56,
                           fullatt_block_indexes=[1]),
        image_token_id=151655, video_token_id=151656, vision_start_token_id=151652,
        vision_end_token_id=151653),
}
CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


def step_profile(out_dir, name: str):
    """bench_pretrain's StepProfile over the first timed steps, or None without a DIR (bench_pretrain
    imports lightning_mcore, which the HF side loads only to profile)."""
    if not out_dir:
        return None
    from bench_pretrain import StepProfile  # here: see the docstring

    return StepProfile(out_dir, name, UNTIMED_STEPS)


TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make(args) -> None:
    import transformers

    config = transformers.Qwen2_5_VLConfig(**SHAPES[args.shape])
    if args.layers:
        config.text_config.num_hidden_layers = args.layers
    torch.manual_seed(0)
    with torch.device("cuda" if CUDA else "cpu"):
        model = transformers.Qwen2_5_VLForConditionalGeneration._from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(args.out)
    print(f"wrote {args.out}: {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B parameters")


def sample_tokens(config: dict, text: int, grid: tuple[int, int, int], seed: int):
    """(ids, loss mask, [3, n] positions) of one sample: text, <start> image <end>, text."""
    t, h, w = grid
    merge = 2
    n_image = t * h * w // merge ** 2
    gen = torch.Generator().manual_seed(seed)
    before = text // 4
    words = torch.randint(0, 150000, (text,), generator=gen)
    ids = torch.cat([words[:before], torch.tensor([config["vision_start_token_id"]]),
                     torch.full((n_image,), config["image_token_id"]),
                     torch.tensor([config["vision_end_token_id"]]), words[before:]])
    start = before + 1
    pos = torch.arange(len(ids)).expand(3, -1).clone()
    hh, ww = torch.meshgrid(torch.arange(h // merge), torch.arange(w // merge), indexing="ij")
    pos[0, start:start + n_image] = start
    pos[1, start:start + n_image] = start + hh.reshape(-1)
    pos[2, start:start + n_image] = start + ww.reshape(-1)
    after = start + max(h, w) // merge
    pos[:, start + n_image:] = torch.arange(after, after + len(ids) - start - n_image)
    mask = torch.zeros(len(ids))
    mask[len(ids) // 2:] = 1
    return ids, mask, pos


class PackedRows(torch.utils.data.Dataset):
    """Rows of `per_row` samples (VisionLanguageDataModule's batch contract)."""

    def __init__(self, config: dict, n: int, per_row: int, seq: int, text: int, grid) -> None:
        self.config, self.n, self.per_row, self.seq, self.text, self.grid = config, n, per_row, seq, text, grid

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        samples = [sample_tokens(self.config, self.text, self.grid, i * self.per_row + k) for k in range(self.per_row)]
        ids = torch.cat([s[0] for s in samples])
        fill = self.seq - len(ids)
        seg = torch.cat([torch.full((len(s[0]),), k + 1) for k, s in enumerate(samples)] + [torch.zeros(fill, dtype=torch.long)])
        tokens = torch.cat([ids, torch.zeros(fill, dtype=torch.long)])
        mask = torch.cat([s[1] for s in samples] + [torch.zeros(fill)])
        labels = torch.cat([tokens[1:], tokens[:1]])
        pos = torch.cat([s[2] for s in samples] + [torch.zeros(3, fill, dtype=torch.long)], dim=1)
        t, h, w = self.grid
        gen = torch.Generator().manual_seed(i)
        return dict(tokens=tokens, labels=labels, loss_mask=mask * (seg > 0), segment_ids=seg, position_ids=pos,
                    pixel_values=torch.randn(self.per_row * t * h * w, 3 * 2 * 14 * 14, generator=gen),
                    image_grid_thw=torch.tensor([list(self.grid)] * self.per_row))


def vision_params(config: dict) -> int:
    v = config["vision_config"]
    h, f, d = v["hidden_size"], v["intermediate_size"], v["depth"]
    block = 4 * h * h + 3 * h * f  # qkv + proj, gated MLP
    merger = (h * 4) ** 2 + h * 4 * v["out_hidden_size"]
    return d * block + merger + 3 * 2 * 14 * 14 * h


def flops(config: dict, sample_len: int, grid, full: bool = False) -> tuple[float, float]:
    """(decoder step FLOPs per token, encoder FLOPs per patch): LoRA, 2 x forward and the
    encoder's forward; full fine-tuning (`full`), 3 x forward for both."""
    from lightning_mcore.model.flops import training_flops_per_token
    from lightning_mcore.models import gpt_config_from_hf

    cfg, _ = gpt_config_from_hf(config, seq_length=4096)
    return (training_flops_per_token(cfg, sample_len, frozen_base=not full),
            (6.0 if full else 2.0) * vision_params(config))


def result(args, impl: str, step: float, tokens_per_step: int, patches_per_step: int, config: dict, extra: dict):
    sample_len = args.text + 2 + args.grid[0] * args.grid[1] * args.grid[2] // 4
    dec, enc = flops(config, sample_len, args.grid, full=impl == "ours" and args.full)
    tokens_s, patches_s = tokens_per_step / step, patches_per_step / step
    print("RESULT " + json.dumps({
        "impl": impl, "shape": args.shape, "layers": config["text_config"]["num_hidden_layers"],
        "sample_tokens": sample_len, "grid": args.grid, "seq": args.seq,
        "device": torch.cuda.get_device_name() if CUDA else "cpu",
        "tokens_per_s_per_gpu": round(tokens_s), "patches_per_s": round(patches_s), "step_s": round(step, 3),
        "mfu": round((tokens_s * dec + patches_s * enc) / (PEAK_BF16_TFLOPS * 1e12), 3),
        "peak_mem_gb": round(torch.cuda.max_memory_allocated() / 2**30, 1) if CUDA else None, **extra}), flush=True)


def ours(args) -> None:
    import lightning as L

    from lightning_mcore import MegatronStrategy, OptimizerSettings
    from lightning_mcore.lora.config import LoRAConfig
    from lightning_mcore.objectives.vision_language import VisionLanguageSFTModule

    config = json.load(open(os.path.join(args.model, "config.json")))
    sample_len = args.text + 2 + args.grid[0] * args.grid[1] * args.grid[2] // 4
    per_row = args.seq // sample_len
    times = []

    class Timer(L.Callback):
        def on_train_start(self, trainer, *a):
            self.profile = step_profile(args.profile, f"rank{trainer.global_rank}")

        def on_train_batch_start(self, *a):
            torch.cuda.synchronize() if CUDA else None
            if self.profile:
                self.profile.start(len(times))
            self.t = time.perf_counter()

        def on_train_batch_end(self, *a):
            torch.cuda.synchronize() if CUDA else None
            times.append(time.perf_counter() - self.t)
            if self.profile:
                self.profile.end(times)

    strategy = MegatronStrategy(global_batch_size=args.gbs, micro_batch_size=args.micro_batch,
                                use_distributed_optimizer=CUDA,
                                tensor_model_parallel_size=args.tp, sequence_parallel=args.tp > 1)
    devices = args.tp * args.dp
    trainer = L.Trainer(accelerator="gpu" if CUDA else "cpu", devices=devices, strategy=strategy, precision="bf16-mixed",
                        max_steps=args.steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[Timer()])
    module = VisionLanguageSFTModule(args.model, OptimizerSettings(lr=1e-4, warmup_steps=2),
                                     model_overrides=dict(seq_length=args.seq),
                                     lora=None if args.full else LoRAConfig(target_modules="all-linear", rank=args.rank,
                                                                            alpha=2.0 * args.rank))
    data = PackedRows(config, args.gbs * args.steps, per_row, args.seq, args.text, tuple(args.grid))
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=args.gbs // args.dp))  # each DP rank its share
    steady = times[UNTIMED_STEPS:]
    if trainer.global_rank == 0:
        t, h, w = args.grid
        result(args, "ours", sum(steady) / len(steady), args.gbs * per_row * sample_len // devices,
               args.gbs * per_row * t * h * w // devices, config,
               {"samples_per_row": per_row, "gbs_rows": args.gbs, "tp": args.tp, "dp": args.dp, "full": args.full,
                "micro_batch": args.micro_batch})


def hf(args) -> None:
    import peft
    import transformers

    config = json.load(open(os.path.join(args.model, "config.json")))
    model = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(
        args.model, dtype=torch.bfloat16, attn_implementation="sdpa").to(DEVICE)
    model = peft.get_peft_model(model, peft.LoraConfig(
        r=args.rank, lora_alpha=2 * args.rank, target_modules=r".*language_model.*\.(" + "|".join(TARGETS) + ")"))
    if args.vision_attention == "packed":
        from lightning_mcore.model.vision_attention import use_packed_attention

        use_packed_attention(model.get_base_model().model.visual)
    if args.compile:
        model.get_base_model().model.language_model.compile()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, fused=True)
    sample_len = args.text + 2 + args.grid[0] * args.grid[1] * args.grid[2] // 4
    per_step = (args.seq // sample_len) * args.gbs  # the same samples per step as ours
    times, k = [], 0
    t, h, w = args.grid
    profile = step_profile(args.profile, "hf")
    for step in range(args.steps):
        torch.cuda.synchronize() if CUDA else None
        if profile:
            profile.start(step)
        start = time.perf_counter()
        for _ in range(per_step // args.micro_batch):
            samples = [sample_tokens(config, args.text, tuple(args.grid), k + j) for j in range(args.micro_batch)]
            k += args.micro_batch
            ids = torch.stack([s[0] for s in samples]).to(DEVICE)
            labels = torch.where(torch.stack([s[1] for s in samples]).bool(), torch.stack([s[0] for s in samples]), -100).to(DEVICE)
            pixels = torch.randn(args.micro_batch * t * h * w, 3 * 2 * 14 * 14, device=DEVICE, dtype=torch.bfloat16)
            grids = torch.tensor([list(args.grid)] * args.micro_batch, device=DEVICE)
            out = model(input_ids=ids, labels=labels, pixel_values=pixels, image_grid_thw=grids,
                        mm_token_type_ids=(ids == config["image_token_id"]).int())
            (out.loss * args.micro_batch / per_step).backward()
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize() if CUDA else None
        times.append(time.perf_counter() - start)
        if profile:
            profile.end(times)
    steady = times[UNTIMED_STEPS:]
    result(args, "hf-compile" if args.compile else "hf-eager", sum(steady) / len(steady), per_step * sample_len,
           per_step * t * h * w, config, {"micro_batch": args.micro_batch, "samples_per_step": per_step,
                                          "vision_attention": args.vision_attention})


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["make", "ours", "hf"])
    ap.add_argument("--out", default="/tmp/vl7b")
    ap.add_argument("--model", default="/tmp/vl7b")
    ap.add_argument("--shape", default="qwen2_5_vl_7b", choices=sorted(SHAPES))
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--text", type=int, default=824, help="text tokens per sample")
    ap.add_argument("--grid", type=int, nargs=3, default=[1, 28, 28], help="image patches t h w")
    ap.add_argument("--gbs", type=int, default=4, help="rows per step (ours)")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--dp", type=int, default=1, help="ours: data-parallel ranks (devices = tp x dp)")
    ap.add_argument("--full", action="store_true",
                    help="ours: full fine-tuning (vision encoder included, distributed optimizer) instead of LoRA")
    ap.add_argument("--micro-batch", type=int, default=1,
                    help="HF: samples per forward; ours: rows per forward (each rank's rows, --gbs / --dp, allowing)")
    ap.add_argument("--vision-attention", default="sdpa", choices=["sdpa", "packed"],
                    help="HF's vision encoder: one SDPA call per window (transformers without flash-attn) or one "
                         "packed call a block (model/vision_attention.py: what flash-attn's users get); ours packs")
    ap.add_argument("--compile", action="store_true", help="HF: torch.compile the language model")
    ap.add_argument("--profile", default=None, metavar="DIR",
                    help="torch.profiler over the first 3 timed steps: DIR/rank{N}.txt (ours), DIR/hf.txt")
    args = ap.parse_args(argv)
    if args.gbs % args.dp:
        ap.error(f"--gbs {args.gbs} rows must divide over --dp {args.dp}")
    if args.what == "ours" and (args.gbs // args.dp) % args.micro_batch:
        ap.error(f"--micro-batch {args.micro_batch} must divide each rank's {args.gbs // args.dp} rows")
    return args


def main() -> None:
    args = parse_args()
    {"make": make, "ours": ours, "hf": hf}[args.what](args)


if __name__ == "__main__":
    main()
