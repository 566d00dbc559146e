"""Baseline: HF transformers' LlamaForCausalLM (SDPA attention) trained by a plain PyTorch loop on one GPU.

Same shape (a bench_pretrain.SHAPES entry), batches, optimizer settings and step timing as the
mcore side of bench_pretrain.py. Precision (--hf-dtype):
  amp  (default) fp32 weights, grads and AdamW state, forward/backward under torch.autocast(bf16):
       the standard HF recipe (Trainer(bf16=True)), and like mcore's bf16 + fp32 main params it
       keeps an fp32 master copy. Costs 16 bytes/param, so llama-8b does not fit one 80 GB GPU.
  bf16 pure bf16 weights, grads and AdamW state (no master copy): faster, less memory, less exact.
  fp32 no autocast at all (the CPU self-check uses it).

    python benchmarks/hf_baseline.py --shape llama-1.2b [--compile] [--hf-dtype bf16]
    python benchmarks/hf_baseline.py --selftest [--compile]      # CPU, tiny shape

Prints one RESULT JSON line in bench_pretrain's format (impl "hf-eager" or "hf-compile"); bench_pretrain
--impl hf-eager/hf-compile calls run_hf too (with the default precision unless its args carry hf_dtype).
"""

from __future__ import annotations

import argparse
import copy
import json
import time

import torch
import torch.nn.functional as F


def build_model(shape: dict, seq: int, dtype: str = "amp", device: str = "cuda", seed: int = 1234):
    from transformers import LlamaConfig, LlamaForCausalLM

    if shape.get("num_moe_experts") or shape.get("qk_layernorm"):
        raise ValueError("hf_baseline builds dense Llama models only (no MoE, no QK-norm)")
    heads = shape["num_attention_heads"]
    config = LlamaConfig(
        vocab_size=shape["vocab_size"], hidden_size=shape["hidden_size"], intermediate_size=shape["ffn_hidden_size"],
        num_hidden_layers=shape["num_layers"], num_attention_heads=heads, head_dim=shape.get("kv_channels"),
        num_key_value_heads=shape.get("num_query_groups") or heads, rope_theta=float(shape.get("rotary_base", 1e4)),
        max_position_embeddings=max(seq, 2048), rms_norm_eps=shape.get("norm_epsilon", 1e-5),  # GPTConfig's defaults
        tie_word_embeddings=False, use_cache=False, attn_implementation="sdpa")
    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16 if dtype == "bf16" else torch.float32)  # as from_pretrained(dtype=)
    try:  # (model.to(bf16) would also round the fp32 rotary inv_freq buffers)
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    return model.train()


def make_optimizer(model: torch.nn.Module, lr: float = 1e-4) -> torch.optim.AdamW:
    # No weight decay on norms (1-D params), as mcore's optimizer and HF's Trainer do.
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.01},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), fused=True)


def train(model, opt, loader, steps: int, mbs: int, timer, amp: bool, device: str = "cuda") -> list[float]:
    """`steps` optimizer steps, each over one loader batch (the global batch) split into micro batches
    of `mbs` rows; loss = sum of token losses / tokens of the global batch. Returns the step losses."""
    params = [p for p in model.parameters() if p.requires_grad]
    losses = []
    for step, batch in enumerate(loader):
        if step == steps:
            break
        timer.start()
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        mask = batch["loss_mask"] != 0
        labels = batch["labels"].masked_fill(~mask, -100)
        total_tokens = mask.sum()
        opt.zero_grad(set_to_none=True)
        step_loss = torch.zeros((), device=device)
        for i in range(0, batch["tokens"].shape[0], mbs):
            with torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=amp):
                logits = model(input_ids=batch["tokens"][i:i + mbs], position_ids=batch["position_ids"][i:i + mbs]).logits
            loss = F.cross_entropy(logits.float().flatten(0, 1), labels[i:i + mbs].flatten(), reduction="sum") / total_tokens
            loss.backward()
            step_loss += loss.detach()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        timer.stop()
        losses.append(step_loss)
    return [float(x) for x in losses]


def run_hf(shape: dict, args, loader, compile: bool, timer=None, device: str = "cuda"):
    """Build, optionally torch.compile (default mode; its compile time falls in the warm-up steps),
    and train. Uses args.seq, args.mbs, args.steps and, if present, args.hf_dtype ("amp"), args.lr
    (1e-4), args.profile.
    Returns the timer (bench_pretrain.StepTimer unless given) with `.losses` set."""
    if timer is None:  # imported here, not at the top: bench_pretrain imports this module
        from bench_pretrain import StepTimer

        timer = StepTimer(getattr(args, "profile", False))
    dtype = getattr(args, "hf_dtype", "amp")
    model = build_model(shape, args.seq, dtype, device)
    opt = make_optimizer(model, getattr(args, "lr", 1e-4))
    timer.losses = train(torch.compile(model) if compile else model, opt, loader, args.steps, args.mbs, timer,
                         amp=dtype == "amp", device=device)
    return timer


class WallTimer:
    """StepTimer without CUDA synchronisation, for the CPU self-check."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def start(self) -> None:
        self._t = time.perf_counter()

    def stop(self) -> None:
        self.times.append(time.perf_counter() - self._t)


def selftest(compile: bool = False, device: str = "cpu") -> None:
    """One accumulated step (3 micro batches of 2 rows, unequal masked token counts) against one
    plain forward/backward over the whole global batch: same loss, same clipped grads; and the
    AdamW step moved the weights by ~lr (first Adam step: |update| <= lr)."""
    shape = {"num_layers": 2, "hidden_size": 64, "ffn_hidden_size": 256, "num_attention_heads": 4,
             "num_query_groups": 2, "vocab_size": 500, "rotary_base": 10000.0}
    seq, gbs, mbs = 32, 6, 2
    g = torch.Generator().manual_seed(0)
    rows = torch.randint(0, shape["vocab_size"], (gbs, seq + 1), generator=g)
    mask = torch.ones(gbs, seq)
    mask[3:] = (torch.rand(gbs - 3, seq, generator=g) > 0.4).float()
    batch = {"tokens": rows[:, :-1], "labels": rows[:, 1:], "loss_mask": mask,
             "position_ids": torch.arange(seq).expand(gbs, seq)}

    model = build_model(shape, seq, "fp32", device)
    ref = copy.deepcopy(model)
    t0 = time.perf_counter()
    losses = train(torch.compile(model) if compile else model, make_optimizer(model), [batch], 1, mbs,
                   WallTimer(), amp=False, device=device)
    dt = time.perf_counter() - t0

    logits = ref(input_ids=batch["tokens"], position_ids=batch["position_ids"]).logits.float()
    tok = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), reduction="none")
    want = (tok * mask.flatten()).sum() / mask.sum()
    want.backward()
    torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
    gdiff = max((a.grad - b.grad).abs().max().item() for a, b in zip(model.parameters(), ref.parameters()))
    gmax = max(b.grad.abs().max().item() for b in ref.parameters())
    moved = max((a - b).abs().max().item() for a, b in zip(model.parameters(), ref.parameters()))
    print(f"selftest compile={compile}: loss {losses[0]:.7f} vs hand {want.item():.7f} "
          f"(diff {abs(losses[0] - want.item()):.1e}), grad diff {gdiff:.1e} of max {gmax:.1e}, "
          f"max update {moved:.2e} (lr 1e-4), {dt:.1f}s")
    assert abs(losses[0] - want.item()) < 1e-5 and gdiff < 1e-5 * gmax and 0.9e-4 < moved < 1.01e-4


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama-1.2b")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--mbs", type=int, default=1)
    ap.add_argument("--gbs", type=int, default=8, help="global batch (sequences per step)")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--compile", action="store_true", help="torch.compile(model), default mode")
    ap.add_argument("--hf-dtype", default="amp", choices=["amp", "bf16", "fp32"])
    ap.add_argument("--profile", action="store_true", help="print torch.profiler tables of steps 10-12")
    ap.add_argument("--selftest", action="store_true", help="CPU correctness check on a tiny shape")
    args = ap.parse_args()
    if args.selftest:
        return selftest(args.compile)

    from bench_pretrain import PEAK_BF16_TFLOPS, SHAPES, RandomTokens, flops_per_token
    from torch.utils.data import DataLoader

    from lightning_mcore import GPTConfig

    shape = SHAPES[args.shape]
    loader = DataLoader(RandomTokens(args.gbs * (args.steps + 2), args.seq, shape["vocab_size"]),
                        batch_size=args.gbs, num_workers=2, pin_memory=True)
    torch.cuda.set_device(0)
    timer = run_hf(shape, args, loader, args.compile)
    timed = timer.times[args.warmup:]
    step = sum(timed) / len(timed)
    tokens = args.gbs * args.seq / step
    mfu = tokens * flops_per_token(GPTConfig(**shape, seq_length=args.seq), args.seq) / (PEAK_BF16_TFLOPS * 1e12)
    import transformers

    print("RESULT " + json.dumps({
        "impl": "hf-compile" if args.compile else "hf-eager", "shape": args.shape, "gpus": 1, "tp": 1, "seq": args.seq,
        "sp": False, "mbs": args.mbs, "gbs": args.gbs, "timed_steps": len(timed), "step_s": round(step, 4),
        "tokens_per_s_per_gpu": round(tokens), "mfu": round(mfu, 4),
        "peak_mem_gb": round(torch.cuda.max_memory_allocated() / 2**30, 1),
        "device": torch.cuda.get_device_name(), "torch": torch.__version__,
        "hf_dtype": args.hf_dtype, "transformers": transformers.__version__, "last_loss": round(timer.losses[-1], 4),
    }), flush=True)


if __name__ == "__main__":
    main()
