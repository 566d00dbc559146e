"""Baseline: HF transformers trained by a plain PyTorch loop on one GPU, configured as its best users would.

Same shape (a bench_pretrain.SHAPES entry), batches, optimizer settings and step timing as the
mcore side of bench_pretrain.py. The model is transformers' own: LlamaForCausalLM for dense shapes,
Qwen3ForCausalLM for dense shapes with QK-norm, Qwen3MoeForCausalLM for MoE shapes (experts through
transformers' grouped_mm implementation by default, no router aux loss). The loss is computed inside
the model (transformers' ForCausalLMLoss: summed token losses / num_items_in_batch, the global
batch's token count as a tensor), so that torch.compile sees forward and loss as one graph.

Attention (--hf-attn): "sdpa_causal" (default) is transformers' own sdpa_attention_forward registered
through AttentionInterface under a name with no mask function, so no mask is built and SDPA runs
is_causal=True (flash kernel), eager or compiled. Under torch.compile, stock "sdpa" materialises a
[batch, 1, seq, seq] mask (transformers 5.17-5.23 with torch < 2.14 never skip it while tracing, and
position_ids make it a packed-sequence mask), which rules out the flash kernel (and SDPA's GQA):
the reason this script's compiled runs were slower than its eager ones (on one H100, 1.2B shape,
micro batch 1: 25.8k tokens/s before, 47.9k with this; benchmarks/RESULTS.md, 2026-11-23 session 6). Plain causal attention over each row is mcore's semantics here too.

Precision (--hf-dtype):
  amp  (default) fp32 weights, grads and AdamW state, forward/backward under torch.autocast(bf16):
       the standard HF recipe (Trainer(bf16=True)), and like mcore's bf16 + fp32 main params it
       keeps an fp32 master copy. Costs 16 bytes/param, so llama-8b does not fit one 80 GB GPU.
       MoE experts run in fp32 here (grouped_mm is not autocast), on CUDA with TF32 allowed.
  bf16 pure bf16 weights, grads and AdamW state (no master copy): faster, less memory, less exact.
  fp32 no autocast at all (the CPU self-check uses it).

    python benchmarks/hf_baseline.py --shape llama-1.2b --mbs 4 [--compile] [--hf-dtype bf16]
    python benchmarks/hf_baseline.py --shape qwen3-moe-small --layers 6 --mbs 2 --compile
    python benchmarks/hf_baseline.py --selftest [--compile]      # CPU, tiny shapes

Prints one RESULT JSON line in bench_pretrain's format (impl "hf-eager" or "hf-compile"); bench_pretrain
--impl hf-eager/hf-compile calls run_hf too (its --hf-dtype/--hf-experts/--hf-attn/--compile-mode
reach run_hf through its args).
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

ATTN = "sdpa_causal"
# transformers' default and fastest without hub kernels (5.17 and 5.23 also have eager, batched_mm;
# deepgemm and sonicmoe download kernels)
EXPERTS = "grouped_mm"
# shape keys that only say how mcore runs the model, not what it computes
_MCORE_ONLY = {"moe_grouped_gemm", "moe_token_dispatcher_type"}
_MAPPED = {"num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
           "qk_layernorm", "vocab_size", "rotary_base", "norm_epsilon", "num_moe_experts", "moe_router_topk",
           "moe_ffn_hidden_size", "moe_router_pre_softmax"}


def register_causal_sdpa() -> None:
    """transformers' SDPA attention under ATTN, with no mask function: masking_utils then returns no
    mask (its early exit for attention functions without one), and SDPA runs is_causal=True."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    AttentionInterface.register(ATTN, sdpa_attention_forward)


def hf_config(shape: dict, seq: int, experts: str = EXPERTS, attn: str = ATTN):
    """(config, model class) for a bench shape; refuses shape keys it cannot map."""
    from transformers import (LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig,
                              Qwen3MoeForCausalLM)

    unknown = set(shape) - _MAPPED - _MCORE_ONLY
    if unknown:
        raise ValueError(f"hf_baseline has no transformers equivalent for shape keys {sorted(unknown)}")
    if attn == ATTN:
        register_causal_sdpa()
    heads = shape["num_attention_heads"]
    common = dict(  # GPTConfig's defaults where the shape leaves a key out
        vocab_size=shape["vocab_size"], hidden_size=shape["hidden_size"], intermediate_size=shape["ffn_hidden_size"],
        num_hidden_layers=shape["num_layers"], num_attention_heads=heads,
        num_key_value_heads=shape.get("num_query_groups") or heads,
        head_dim=shape.get("kv_channels") or shape["hidden_size"] // heads,
        rope_parameters={"rope_type": "default", "rope_theta": float(shape.get("rotary_base", 10000.0))},
        max_position_embeddings=max(seq, 2048), rms_norm_eps=shape.get("norm_epsilon", 1e-5), hidden_act="silu",
        attention_bias=False, tie_word_embeddings=False, use_cache=False, attn_implementation=attn)
    if shape.get("num_moe_experts"):
        if not shape.get("qk_layernorm"):
            raise ValueError("hf_baseline maps MoE shapes to Qwen3-MoE, which has QK-norm; this shape has none")
        # mcore's router without pre-softmax = softmax over the top-k logits = HF's renormalised top-k
        return Qwen3MoeConfig(
            **common, num_experts=shape["num_moe_experts"], num_experts_per_tok=shape["moe_router_topk"],
            moe_intermediate_size=shape["moe_ffn_hidden_size"],
            norm_topk_prob=not shape.get("moe_router_pre_softmax", False), decoder_sparse_step=1,
            mlp_only_layers=[], output_router_logits=False, router_aux_loss_coef=0.0,
            experts_implementation=experts), Qwen3MoeForCausalLM
    if shape.get("qk_layernorm"):
        return Qwen3Config(**common, use_sliding_window=False), Qwen3ForCausalLM
    return LlamaConfig(**common), LlamaForCausalLM


def check_model(model, shape: dict) -> None:
    """The built model has the shape's sizes (a config key transformers ignored would show here)."""
    heads, hidden = shape["num_attention_heads"], shape["hidden_size"]
    hd = shape.get("kv_channels") or hidden // heads
    layer = model.model.layers[0]
    want = {"q": (heads * hd, hidden), "k": ((shape.get("num_query_groups") or heads) * hd, hidden)}
    got = {"q": tuple(layer.self_attn.q_proj.weight.shape), "k": tuple(layer.self_attn.k_proj.weight.shape)}
    if shape.get("num_moe_experts"):
        want["experts"] = (shape["num_moe_experts"], 2 * shape["moe_ffn_hidden_size"], hidden)
        got["experts"] = tuple(layer.mlp.experts.gate_up_proj.shape)
    else:
        want["mlp"], got["mlp"] = (shape["ffn_hidden_size"], hidden), tuple(layer.mlp.gate_proj.weight.shape)
    want.update(layers=shape["num_layers"], qk_norm=bool(shape.get("qk_layernorm")), tied=False)
    got.update(layers=len(model.model.layers), qk_norm=hasattr(layer.self_attn, "q_norm"),
               tied=model.lm_head.weight is model.model.embed_tokens.weight)
    inv_freq = model.model.rotary_emb.inv_freq  # RoPE base (not readable on the meta device)
    rope = 1.0 if inv_freq.is_meta else float(inv_freq[1]) * float(shape.get("rotary_base", 10000.0)) ** (2 / hd)
    if abs(rope - 1) > 1e-5 or got != want:
        raise ValueError(f"transformers built a different model than the shape asks for: {got} vs {want}")


def build_model(shape: dict, seq: int, dtype: str = "amp", device: str = "cuda", seed: int = 1234,
                experts: str = EXPERTS, attn: str = ATTN):
    config, cls = hf_config(shape, seq, experts, attn)
    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16 if dtype == "bf16" else torch.float32)  # as from_pretrained(dtype=)
    try:  # (model.to(bf16) would also round the fp32 rotary inv_freq buffers)
        with torch.device(device):
            model = cls(config)
    finally:
        torch.set_default_dtype(default)
    check_model(model, shape)
    if shape.get("num_moe_experts") and model.config._experts_implementation != experts:
        raise ValueError(f"asked for experts_implementation={experts}, got {model.config._experts_implementation}")
    return model.train()


def make_optimizer(model: torch.nn.Module, lr: float = 1e-4) -> torch.optim.AdamW:
    # No weight decay on norms (1-D params), as mcore's optimizer and HF's Trainer do.
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.01},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), fused=True)


def compile_model(model, mode: str = "default"):
    """Static shapes: every micro batch has the same shape, so one graph serves them all."""
    return torch.compile(model, dynamic=False, mode=None if mode == "default" else mode)


def train(model, opt, loader, steps: int, mbs: int, timer, amp: bool, device: str = "cuda") -> list[float]:
    """`steps` optimizer steps, each over one loader batch (the global batch) split into micro batches
    of `mbs` rows; loss = sum of token losses / tokens of the global batch, computed inside the model
    by transformers (labels already shifted: shift_labels, -100 where loss_mask is 0). Returns the
    step losses."""
    params = [p for p in model.parameters() if p.requires_grad]
    losses = []
    for step, batch in enumerate(loader):
        if step == steps:
            break
        if batch["tokens"].shape[0] % mbs:
            raise ValueError(f"global batch of {batch['tokens'].shape[0]} rows is not a multiple of mbs {mbs}")
        timer.start()
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        labels = batch["labels"].masked_fill(batch["loss_mask"] == 0, -100)
        total_tokens = (labels != -100).sum()  # a tensor: no host sync, and no recompile as it changes
        opt.zero_grad(set_to_none=True)
        step_loss = torch.zeros((), device=device)
        for i in range(0, batch["tokens"].shape[0], mbs):
            mb = slice(i, i + mbs)
            with torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=amp):
                loss = model(input_ids=batch["tokens"][mb], position_ids=batch["position_ids"][mb],
                             labels=labels[mb], shift_labels=labels[mb], num_items_in_batch=total_tokens).loss
            loss.backward()
            step_loss += loss.detach()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        timer.stop()
        losses.append(step_loss)
    return [float(x) for x in losses]


def dynamo_counts() -> dict:
    from torch._dynamo.utils import counters

    return {"unique_graphs": counters["stats"]["unique_graphs"], "graph_breaks": sum(counters["graph_break"].values())}


def run_hf(shape: dict, args, loader, compile: bool, timer=None, device: str = "cuda"):
    """Build, optionally torch.compile (its compile time falls in the warm-up steps), and train.
    Uses args.seq, args.mbs, args.steps and, if present, args.hf_dtype ("amp"), args.hf_experts,
    args.hf_attn, args.compile_mode ("default"), args.lr (1e-4), args.profile.
    Returns the timer (bench_pretrain.StepTimer unless given) with `.losses` and `.hf` (the settings
    and, compiled, dynamo's graph and graph-break counts) set."""
    if timer is None:  # imported here, not at the top: bench_pretrain imports this module
        from bench_pretrain import StepTimer

        timer = StepTimer(getattr(args, "profile", False))
    dtype = getattr(args, "hf_dtype", None) or "amp"
    experts = getattr(args, "hf_experts", None) or EXPERTS
    attn = getattr(args, "hf_attn", None) or ATTN
    mode = getattr(args, "compile_mode", None) or "default"
    tf32 = torch.device(device).type == "cuda"
    if tf32:  # HF's Trainer(tf32=True): only fp32 matmuls use it (amp: MoE experts; bf16: none)
        torch.set_float32_matmul_precision("high")
    model = build_model(shape, args.seq, dtype, device, experts=experts, attn=attn)
    opt = make_optimizer(model, getattr(args, "lr", 1e-4))
    before = dynamo_counts()
    timer.losses = train(compile_model(model, mode) if compile else model, opt, loader, args.steps, args.mbs, timer,
                         amp=dtype == "amp", device=device)
    import transformers

    timer.hf = {"model": type(model).__name__, "hf_dtype": dtype, "attn": attn, "tf32": tf32,
                "experts": experts if shape.get("num_moe_experts") else None,
                "compile_mode": mode if compile else None, "transformers": transformers.__version__}
    if compile:  # one graph and no breaks = no recompiles between micro batches or steps
        timer.hf.update({k: v - before[k] for k, v in dynamo_counts().items()})
    return timer


class WallTimer:
    """StepTimer without CUDA synchronisation, for the CPU self-check."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def start(self) -> None:
        self._t = time.perf_counter()

    def stop(self) -> None:
        self.times.append(time.perf_counter() - self._t)


_TINY = {"num_layers": 2, "hidden_size": 64, "ffn_hidden_size": 256, "num_attention_heads": 4,
         "num_query_groups": 2, "vocab_size": 500, "rotary_base": 10000.0}
SELFTEST_SHAPES = {
    "llama": _TINY,
    "qwen3": {**_TINY, "kv_channels": 32, "qk_layernorm": True, "norm_epsilon": 1e-6},
    "qwen3-moe": {**_TINY, "kv_channels": 16, "qk_layernorm": True, "norm_epsilon": 1e-6, "rotary_base": 1e6,
                  "num_moe_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 32,
                  "moe_router_pre_softmax": False, "moe_grouped_gemm": True},
}


def selftest_shape(name: str, shape: dict, compile: bool = False, device: str = "cpu") -> dict:
    """One accumulated step (3 micro batches of 2 rows, unequal masked token counts) against one
    forward over the whole global batch of the same initial weights in transformers' plainest code
    (eager attention with its explicit causal mask, eager per-expert loop), with the loss by hand:
    same loss, same clipped grads; and the AdamW step moved the weights by ~lr (first Adam step:
    |update| <= lr)."""
    seq, gbs, mbs = 32, 6, 2
    g = torch.Generator().manual_seed(0)
    rows = torch.randint(0, shape["vocab_size"], (gbs, seq + 1), generator=g)
    mask = torch.ones(gbs, seq)
    mask[3:] = (torch.rand(gbs - 3, seq, generator=g) > 0.4).float()
    batch = {"tokens": rows[:, :-1], "labels": rows[:, 1:], "loss_mask": mask,
             "position_ids": torch.arange(seq).expand(gbs, seq)}

    model = build_model(shape, seq, "fp32", device)
    ref = build_model(shape, seq, "fp32", device, experts="eager", attn="eager")
    assert ref.config._attn_implementation == "eager" and model.config._attn_implementation == ATTN
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters())), "different initial weights"
    t0 = time.perf_counter()
    before = dynamo_counts()
    losses = train(compile_model(model) if compile else model, make_optimizer(model), [batch], 1, mbs,
                   WallTimer(), amp=False, device=device)
    graphs = {k: v - before[k] for k, v in dynamo_counts().items()}
    dt = time.perf_counter() - t0

    logits = ref(input_ids=batch["tokens"], position_ids=batch["position_ids"]).logits.float()
    tok = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), reduction="none")
    want = (tok * mask.flatten()).sum() / mask.sum()
    want.backward()
    torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
    gdiff = max((a.grad - b.grad).abs().max().item() for a, b in zip(model.parameters(), ref.parameters()))
    gmax = max(b.grad.abs().max().item() for b in ref.parameters())
    moved = max((a - b).abs().max().item() for a, b in zip(model.parameters(), ref.parameters()))
    print(f"selftest {name} ({type(model).__name__}) compile={compile}: loss {losses[0]:.7f} vs hand "
          f"{want.item():.7f} (diff {abs(losses[0] - want.item()):.1e}), grad diff {gdiff:.1e} of max {gmax:.1e}, "
          f"max update {moved:.2e} (lr 1e-4), {dt:.1f}s" + (f", dynamo {graphs}" if compile else ""), flush=True)
    assert abs(losses[0] - want.item()) < 1e-5 and gdiff < 1e-5 * gmax and 0.9e-4 < moved < 1.01e-4
    if compile:  # the three micro batches ran through one graph
        assert graphs == {"unique_graphs": 1, "graph_breaks": 0}, (
            f"{graphs}; fp32 experts compile through transformers' grouped_mm_fallback op, whose backward "
            "inductor cannot compile before transformers gave it its own backward op (in 5.23, not in 5.17/5.18)"
            if shape.get("num_moe_experts") else graphs)
    return {"loss": losses[0], "want": want.item(), "gdiff": gdiff, "gmax": gmax}


def selftest(compile: bool = False, device: str = "cpu", names=None) -> None:
    for name in names or SELFTEST_SHAPES:
        selftest_shape(name, SELFTEST_SHAPES[name], compile, device)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama-1.2b")
    ap.add_argument("--layers", type=int, default=None, help="override the shape's num_layers")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--mbs", type=int, default=1)
    ap.add_argument("--gbs", type=int, default=8, help="global batch (sequences per step)")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--compile", action="store_true", help="torch.compile(model, dynamic=False)")
    ap.add_argument("--compile-mode", default="default", choices=["default", "max-autotune-no-cudagraphs"])
    ap.add_argument("--hf-dtype", default="amp", choices=["amp", "bf16", "fp32"])
    ap.add_argument("--hf-experts", default=EXPERTS, choices=["grouped_mm", "batched_mm", "eager"],
                    help="MoE shapes: transformers' experts_implementation")
    ap.add_argument("--hf-attn", default=ATTN, help=f"attn_implementation ({ATTN}: SDPA, causal, no mask)")
    ap.add_argument("--profile", action="store_true", help="print torch.profiler tables of steps 10-12")
    ap.add_argument("--selftest", action="store_true", help="CPU correctness check on tiny shapes")
    args = ap.parse_args()
    if args.selftest:
        return selftest(args.compile)

    from bench_pretrain import PEAK_BF16_TFLOPS, SHAPES, RandomTokens, flops_per_token
    from torch.utils.data import DataLoader

    from lightning_mcore import GPTConfig

    shape = dict(SHAPES[args.shape])
    if args.layers:
        shape["num_layers"] = args.layers
    loader = DataLoader(RandomTokens(args.gbs * (args.steps + 2), args.seq, shape["vocab_size"]),
                        batch_size=args.gbs, num_workers=2, pin_memory=True)
    torch.cuda.set_device(0)
    timer = run_hf(shape, args, loader, args.compile)
    timed = timer.times[args.warmup:]
    step = sum(timed) / len(timed)
    tokens = args.gbs * args.seq / step
    mfu = tokens * flops_per_token(GPTConfig(**shape, seq_length=args.seq), args.seq) / (PEAK_BF16_TFLOPS * 1e12)
    print("RESULT " + json.dumps({
        "impl": "hf-compile" if args.compile else "hf-eager", "shape": args.shape, "layers": shape["num_layers"],
        "gpus": 1, "tp": 1, "seq": args.seq, "sp": False, "mbs": args.mbs, "gbs": args.gbs,
        "timed_steps": len(timed), "step_s": round(step, 4), "tokens_per_s_per_gpu": round(tokens),
        "mfu": round(mfu, 4), "peak_mem_gb": round(torch.cuda.max_memory_allocated() / 2**30, 1),
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "hf": timer.hf,
        "last_loss": round(timer.losses[-1], 4),
    }), flush=True)


if __name__ == "__main__":
    main()
