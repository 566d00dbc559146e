"""Baseline: transformers' own model trained with FSDP2 (`torch.distributed.fsdp.fully_shard`, the path
accelerate and trl take), one process per GPU under torchrun, configured as its best users would.

    torchrun --nproc-per-node 2 benchmarks/hf_fsdp2.py --shape qwen3-30b-a3b --layers 16 --ac --compile --mbs 1,2,4
    torchrun --nproc-per-node 2 benchmarks/hf_fsdp2.py --shape llama-8b --compile --mbs 1
    torchrun --nproc-per-node 2 benchmarks/hf_fsdp2.py --shape llama-8b --lora-rank 16 --data sft --mbs 1,2,4
    python benchmarks/hf_fsdp2.py --qlora --shape llama-8b --lora-rank 16 --lora-alpha 32 --data sft --mbs 1,2,4

--qlora: no FSDP, one process on one GPU, the frozen base in NF4 (bitsandbytes): transformers' QLoRA
recipe as benchmarks/hf_qlora.py builds and describes it, trained by the same loop on the same rows.

The same shape (a bench_pretrain.SHAPES entry), global batch, sequence length, data and optimizer as
bench_pretrain.py (full fine-tuning) and bench_lora_sft.py (LoRA, `--data sft`: its rows of one sample):
- model: hf_baseline.build_model's (LlamaForCausalLM, Qwen3MoeForCausalLM with transformers' grouped_mm
  experts; causal SDPA without a mask), built on the meta device, sharded, then materialised on the GPU
  with random weights (normal(0, initializer_range), norms 1; LoRA: A uniform(+-1/sqrt(in)), B 0);
- FSDP2: fully_shard on each decoder layer (the model's _no_split_modules, as accelerate wraps), then on
  the root; parameters resharded after forward (ZeRO-3) unless --no-reshard; gradients reduce-scattered
  after every micro batch (FSDP2's default);
- precision "mixed" (the default) is ours: fp32 sharded master weights, fp32 gradients and AdamW state,
  forward and backward in bf16 (MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)); with LoRA the
  frozen base is stored in bf16 (as ours) and the adapters in fp32. "fp32": no cast (the CPU test);
- --compile: torch.compile of each decoder layer's forward (regional compilation, as accelerate offers;
  identical layers share one graph), static shapes;
- --ac: each decoder layer's forward under torch.utils.checkpoint (non-reentrant), FSDP2's hooks outside
  it: what transformers' gradient_checkpointing_enable does from 5.24 on (5.17 also re-runs the hooks);
- LoRA (--lora-rank r): peft on every linear, as ours ("all-linear"): q/k/v/o_proj and gate/up/down_proj,
  rank r each (ours: one rank-r adapter on the fused qkv and on the fused gate/up). Qwen3-MoE's experts are
  3-D parameters since transformers 5 (Qwen3MoeExperts.gate_up_proj [E, 2I, H], down_proj [E, H, I]), not
  nn.Linear: peft (0.21) adapts them through `target_parameters` (its ParamWrapper), a rank-r adapter
  per expert on gate_up_proj and on down_proj, as ours on each expert's fc1 and fc2. peft applies them by
  materialising W + scale * B A for all experts (a baddbmm, through nn.utils.parametrize) at every forward,
  which torch.compile cannot trace (on CPU, torch 2.13: under --ac the layer's graph breaks and runs eager;
  without, 8 graphs a layer), so the MoE LoRA runs are eager. Named as
  gate/up/down_proj in target_modules, peft would itself move them to target_parameters, with rank 2r on
  gate_up_proj (the two v4 adapters fused), so the MoE runs name the parameters. The router stays frozen;
- AdamW (fused), lr 1e-4, betas 0.9/0.95, weight decay 0.01 except 1-D, gradient clipping at 1.0
  (hf_baseline.make_optimizer);
- loss: transformers' own (summed token losses / the global batch's token count, all-reduced), times the
  world size, as HF's Trainer does with average_tokens_across_devices (FSDP averages gradients over ranks).

--mbs 1,2,4 sweeps the micro batch in one process, in the order given (smallest first): a setting that
runs out of GPU memory prints `RESULT {"oom": true, ...}` and ends the process (exit 1 with several ranks,
so that torchrun stops the others). Every finished setting prints one `RESULT {json}` line (rank 0) in
bench_pretrain's schema (impl "hf-fsdp2"; for LoRA also mfu_flops_run, lightning_mcore.model.flops'
frozen-base count, as bench_lora_sft.py). --profile-dir: torch.profiler tables of steps 10-12, one file
per rank (bench_pretrain.StepTimer). Runs on CPU with gloo (tests/test_hf_fsdp2_baseline.py).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys
from dataclasses import asdict, dataclass
from typing import Optional

import torch
import torch.distributed as dist
from bench_lora_sft import is_out_of_memory
from bench_pretrain import PEAK_BF16_TFLOPS, SHAPES, RandomTokens, StepTimer, flops_per_token
from hf_baseline import ATTN, EXPERTS, SELFTEST_SHAPES, WallTimer, build_model, dynamo_counts, make_optimizer
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, DistributedSampler

from lightning_mcore import GPTConfig
from lightning_mcore.model.flops import training_flops_per_token

# the bench shapes, and hf_baseline's tiny ones for the CPU test
ALL_SHAPES = {**SHAPES, **{f"tiny-{name}": shape for name, shape in SELFTEST_SHAPES.items()}}
LORA_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
LORA_MLP = ("gate_proj", "up_proj", "down_proj")  # dense MLPs (Llama)
LORA_EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")  # peft target_parameters (Qwen3-MoE)


@dataclass(frozen=True)
class FsdpSettings:
    """How the baseline trains, besides shape and batch."""

    precision: str = "mixed"  # "mixed" (fp32 master, bf16 compute) or "fp32"
    compile: bool = False
    ac: bool = False
    reshard_after_forward: bool = True
    lora_rank: Optional[int] = None  # None: full fine-tuning
    lora_alpha: Optional[float] = None  # None: 2 x rank (bench_lora_sft's default)
    experts: str = EXPERTS
    attn: str = ATTN
    qlora: bool = False  # one GPU, no FSDP, the base in NF4 (hf_qlora.py)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="llama-8b", choices=sorted(ALL_SHAPES))
    ap.add_argument("--layers", type=int, default=None, help="override the shape's num_layers")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--mbs", default="1", help="micro batch, or a comma-separated sweep (smallest first)")
    ap.add_argument("--gbs", type=int, default=8, help="global batch (sequences per step)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=4, help="untimed first steps (compilation falls in them)")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--precision", default="mixed", choices=["mixed", "fp32"])
    ap.add_argument("--compile", action="store_true", help="torch.compile each decoder layer's forward")
    ap.add_argument("--ac", action="store_true", help="activation checkpointing of each decoder layer")
    ap.add_argument("--no-reshard", action="store_true",
                    help="keep each layer's gathered parameters from forward to backward (ZeRO-2-like)")
    ap.add_argument("--lora-rank", type=int, default=None, help="LoRA (peft) of this rank; default: full FT")
    ap.add_argument("--lora-alpha", type=float, default=None, help="default: 2 x rank")
    ap.add_argument("--experts", default=EXPERTS, choices=["grouped_mm", "batched_mm", "eager"],
                    help="MoE shapes: transformers' experts_implementation")
    ap.add_argument("--attn", default=ATTN, help=f"attn_implementation ({ATTN}: SDPA, causal, no mask)")
    ap.add_argument("--data", default="random", choices=["random", "sft"],
                    help="random: bench_pretrain's rows; sft: bench_lora_sft's rows of one sample each")
    ap.add_argument("--qlora", action="store_true",
                    help="one process, the base in bitsandbytes NF4 (transformers' QLoRA recipe), no FSDP")
    ap.add_argument("--profile-dir", default=None, help="torch.profiler tables of steps 10-12, rank{N}.txt")
    ap.add_argument("--dump", default=None,
                    help="(tests) rank 0 saves the whole initial weights, first gradients and final weights here")
    args = ap.parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", 1))
    try:
        args.mbs = [int(x) for x in args.mbs.split(",")]
    except ValueError:
        ap.error(f"--mbs must be integers separated by commas, got {args.mbs!r}")
    rows = args.gbs // world
    if args.gbs % world or any(m < 1 or rows % m for m in args.mbs):
        ap.error(f"--gbs {args.gbs} must split into {world} ranks of rows that each --mbs {args.mbs} divides")
    if args.steps <= args.warmup:
        ap.error("--steps must be more than --warmup")
    if args.profile_dir and (args.steps < 13 or args.warmup > 10):
        ap.error("--profile-dir profiles steps 10-12: needs --steps >= 13 and --warmup <= 10")
    if args.dump and len(args.mbs) > 1:
        ap.error("--dump takes one --mbs")
    if args.lora_rank is not None and args.lora_rank < 1:
        ap.error("--lora-rank must be >= 1")
    if args.qlora and (world > 1 or args.lora_rank is None or args.no_reshard):
        ap.error("--qlora runs one process, needs --lora-rank, and does not take --no-reshard")
    return args


def settings_of(args) -> FsdpSettings:
    return FsdpSettings(precision=args.precision, compile=args.compile, ac=args.ac,
                        reshard_after_forward=not args.no_reshard, lora_rank=args.lora_rank,
                        lora_alpha=args.lora_alpha, experts=args.experts, attn=args.attn, qlora=args.qlora)


def decoder_layers(model) -> list[torch.nn.Module]:
    """The modules accelerate's FSDP auto-wrap shards one by one: the model's _no_split_modules."""
    names = set(model._no_split_modules)
    return [m for m in model.modules() if type(m).__name__ in names]


def lora_targets(moe: bool) -> dict:
    """peft's target_modules and target_parameters for every linear of a dense or an MoE model."""
    if moe:
        return {"target_modules": list(LORA_ATTENTION), "target_parameters": list(LORA_EXPERTS)}
    return {"target_modules": list(LORA_ATTENTION + LORA_MLP), "target_parameters": None}


def add_lora(model, s: FsdpSettings):
    """peft LoRA on every linear (lora_targets), the adapters in fp32 (peft's autocast_adapter_dtype
    does so for a bf16 base; said here for all)."""
    from peft import LoraConfig, get_peft_model  # here: peft only for LoRA runs

    config = LoraConfig(r=s.lora_rank, lora_alpha=s.lora_alpha or 2.0 * s.lora_rank, lora_dropout=0.0,
                        task_type="CAUSAL_LM", **lora_targets(hasattr(model.config, "num_experts")))
    model = get_peft_model(model, config)
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.float()
    return model


def checkpointed(forward):
    """`forward` recomputed in backward (torch.utils.checkpoint, non-reentrant)."""
    def run(*args, **kwargs):
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)
    return run


@torch.no_grad()
def init_weights(model, std: float, seed: int) -> None:
    """Each rank draws its own shards: matrices normal(0, std), vectors (RMSNorm) 1, LoRA A
    uniform(+-1/sqrt(in)) and B 0 (peft's default init)."""
    torch.manual_seed(seed + dist.get_rank())
    for name, p in model.named_parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        if "lora_B" in name:
            local.zero_()
        elif "lora_A" in name:
            local.uniform_(-1 / math.sqrt(p.shape[1]), 1 / math.sqrt(p.shape[1]))
        elif p.ndim >= 2:
            local.normal_(0.0, std)
        else:
            local.fill_(1.0)


def restore_rotary(model, device) -> None:
    """RoPE's inverse frequencies (buffers, not weights) as the model's constructor computes them:
    to_empty left them uninitialised."""
    for module in model.modules():
        if "RotaryEmbedding" in type(module).__name__:
            with torch.device(device):
                fresh = type(module)(module.config)
            for name, buf in fresh.named_buffers():
                setattr(module, name, buf)


def build(shape: dict, seq: int, s: FsdpSettings, device: torch.device, mesh, seed: int = 1234):
    """transformers' model for `shape`, LoRA/checkpointing/compilation applied, FSDP2-sharded over
    `mesh`, materialised on `device` (--qlora: hf_qlora's one-GPU model instead)."""
    if s.qlora:
        from hf_qlora import build_qlora  # here: bitsandbytes only for --qlora

        model = build_qlora(shape, seq, s, device)
        for layer in decoder_layers(model) if s.compile else ():  # regional, as below (bitsandbytes >= 0.46 traces)
            layer.forward = torch.compile(layer.forward, dynamic=False)
        return model
    model = build_model(shape, seq, "fp32", "meta", experts=s.experts, attn=s.attn)
    std = model.config.initializer_range
    layers = decoder_layers(model)
    mixed = s.precision == "mixed"
    if s.lora_rank:
        if mixed:  # the frozen base in bf16, as ours keeps it
            model.to(torch.bfloat16)
        model = add_lora(model, s)
    for layer in layers:  # torchtitan's order: checkpoint inside, compile around it, then shard
        if s.ac:
            layer.forward = checkpointed(layer.forward)
        if s.compile:
            layer.forward = torch.compile(layer.forward, dynamic=False)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed else MixedPrecisionPolicy()
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=s.reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=s.reshard_after_forward)
    model.to_empty(device=device)
    init_weights(model, std, seed)
    restore_rotary(model, device)
    return model.train()


def make_loader(args, vocab: int, world: int, rank: int, cuda: bool) -> DataLoader:
    """Each rank its gbs / world rows a step, in the order bench_pretrain's raw loop takes them."""
    n = args.gbs * (args.steps + 2)
    if args.data == "random":
        data = RandomTokens(n, args.seq, vocab)
    else:
        from bench_lora_sft import PackedRows  # here: only sft runs need it

        data = PackedRows(n, args.seq, vocab, samples_per_row=1)
    return DataLoader(data, batch_size=args.gbs // world, sampler=DistributedSampler(data, world, rank, shuffle=False),
                      num_workers=2 if cuda else 0, pin_memory=cuda)


def train(model, opt, loader, steps: int, mbs: int, timer, device, world: int,
          first_grads: Optional[dict] = None) -> list[float]:
    """`steps` optimizer steps over this rank's rows in micro batches of `mbs`; returns the global
    batch's mean token loss per step (all ranks). `first_grads` (a dict): filled with the first
    step's whole gradients, before clipping (tests)."""
    params = [p for p in model.parameters() if p.requires_grad]
    losses = []
    for step, batch in enumerate(loader):
        if step == steps:
            break
        timer.start()
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        labels = batch["labels"].masked_fill(batch["loss_mask"] == 0, -100)
        tokens = (labels != -100).sum()
        dist.all_reduce(tokens)  # the global batch's token count, a tensor (no host sync)
        opt.zero_grad(set_to_none=True)
        step_loss = torch.zeros((), device=device)
        for i in range(0, labels.shape[0], mbs):
            mb = slice(i, i + mbs)
            loss = model(input_ids=batch["tokens"][mb], position_ids=batch["position_ids"][mb], labels=labels[mb],
                         shift_labels=labels[mb], num_items_in_batch=tokens).loss
            (loss * world).backward()
            step_loss += loss.detach()
        if first_grads is not None and step == 0:
            first_grads.update(full_state(model, grads=True))
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        timer.stop()
        losses.append(step_loss)
    total = torch.stack(losses)
    dist.all_reduce(total)
    return total.tolist()


def full_state(model, grads: bool = False) -> dict:
    """Every parameter (or the gradient of every trainable one) whole, on the CPU (a collective:
    all ranks call it)."""
    tensors = {n: p.grad if grads else p for n, p in model.named_parameters() if p.requires_grad or not grads}
    return {n: (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu().clone() for n, t in tensors.items()}


def hf_settings(model, s: FsdpSettings, shape: dict, graphs: Optional[dict]) -> dict:
    """What the result says about the baseline's configuration."""
    import peft  # here: versions for the record only
    import transformers

    mixed = s.precision == "mixed"
    out = {**asdict(s), "model": type(model).__name__, "fsdp": "fully_shard per decoder layer + root",
           "param_dtype": "bfloat16" if mixed else "float32", "reduce_dtype": "float32", "master_dtype": "float32",
           "frozen_base_dtype": ("bfloat16" if mixed else "float32") if s.lora_rank else None,
           "grad_reduce": "every micro batch", "optimizer": "AdamW fused, fp32 state",
           "transformers": transformers.__version__, "peft": peft.__version__}
    if not shape.get("num_moe_experts"):
        out["experts"] = None
    if s.lora_rank:
        out["lora"] = {**lora_targets(bool(shape.get("num_moe_experts"))), "alpha": s.lora_alpha or 2.0 * s.lora_rank}
    if graphs is not None:
        out["dynamo"] = graphs
    if s.qlora:
        from hf_qlora import qlora_settings  # here: bitsandbytes only for --qlora

        out.update(qlora_settings(s))
    return out


def run_one(args, shape: dict, mbs: int, device: torch.device, mesh, world: int) -> Optional[dict]:
    """One setting: build, train, measure. Returns rank 0's result (None elsewhere)."""
    s, cuda = settings_of(args), device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    model = build(shape, args.seq, s, device, mesh)
    if cuda and s.qlora:  # from the bf16 model quantized in build only the NF4 codes are left, as after
        torch.cuda.empty_cache()  # from_pretrained, which never holds it whole: the peak is training's
        torch.cuda.reset_peak_memory_stats()
    params = sum(p.numel() * (2 if type(p).__name__ == "Params4bit" else 1) for p in model.parameters())  # 2 NF4 a byte
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    opt = make_optimizer(model, args.lr)
    init = full_state(model) if args.dump else None
    timer = StepTimer(profile=bool(args.profile_dir)) if cuda else WallTimer()
    timer.warmup = args.warmup
    before = dynamo_counts()
    grads = {} if args.dump else None
    losses = train(model, opt, make_loader(args, shape["vocab_size"], world, dist.get_rank(), cuda), args.steps, mbs,
                   timer, device, world, grads)
    graphs = {k: v - before[k] for k, v in dynamo_counts().items()} if s.compile else None
    if args.dump:
        end = full_state(model)
        if dist.get_rank() == 0:
            torch.save({"init": init, "first_grads": grads, "end": end, "losses": losses}, args.dump)
    per_rank = None
    if cuda:
        per_rank = [None] * world
        dist.all_gather_object(per_rank, timer.host_summary(args.warmup))
        gc.callbacks.remove(timer._on_gc)
    result = None
    if dist.get_rank() == 0:
        result = measure(args, shape, mbs, timer, losses, world, cuda)
        result.update(params=params, trainable_params=trainable, ranks=per_rank,
                      hf=hf_settings(model, s, shape, graphs))
    del model, opt
    gc.collect()
    if s.compile:  # the next setting's graphs anew (compiled code would keep this model alive)
        torch._dynamo.reset()
    if cuda:
        torch.cuda.empty_cache()
    return result


def impl_of(args) -> str:
    return "hf-qlora" if args.qlora else "hf-fsdp2"


def measure(args, shape: dict, mbs: int, timer, losses: list[float], world: int, cuda: bool) -> dict:
    """bench_pretrain's RESULT fields for one setting."""
    cfg = GPTConfig(**shape, seq_length=args.seq)
    timed = timer.times[args.warmup:]
    step = sum(timed) / len(timed)
    tokens = args.gbs * args.seq / step / world
    peak = PEAK_BF16_TFLOPS * 1e12
    out = {
        "impl": impl_of(args), "shape": args.shape, "gpus": world, "tp": 1, "pp": 1, "vpp": None, "cp": 1, "ep": 1,
        "sp": False, "fp8": None, "recompute": "full" if args.ac else None, "layers": cfg.num_layers,
        "seq": args.seq, "mbs": mbs, "gbs": args.gbs, "data": args.data, "lora_rank": args.lora_rank,
        "timed_steps": len(timed), "step_s": round(step, 4), "step_s_spread": [round(min(timed), 4), round(max(timed), 4)],
        "tokens_per_s_per_gpu": round(tokens), "mfu": round(tokens * flops_per_token(cfg, args.seq) / peak, 4),
        "losses": [round(x, 4) for x in losses], "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if cuda else "cpu",
    }
    if args.qlora:
        out["base_precision"] = "nf4"
    if args.lora_rank:  # what a LoRA step runs: the frozen base's forward and input gradients
        out["mfu_flops_run"] = round(tokens * training_flops_per_token(cfg, args.seq, frozen_base=True) / peak, 4)
    if cuda:
        out.update(peak_mem_gb=round(torch.cuda.max_memory_allocated() / 2**30, 1),
                   peak_reserved_gb=round(torch.cuda.max_memory_reserved() / 2**30, 1),
                   device_used_gb=round(timer.device_used / 2**30, 1),
                   alloc_retries=torch.cuda.memory_stats().get("num_alloc_retries", 0))
    return out


def main(argv=None) -> None:
    args = parse_args(argv)
    shape = dict(ALL_SHAPES[args.shape])
    if args.layers:
        shape["num_layers"] = args.layers
    if args.profile_dir:
        os.environ["BENCH_PROFILE_DIR"] = args.profile_dir
    world, rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
    cuda = torch.cuda.is_available()
    # plain `python` (no torchrun): a group of one, without a rendezvous
    alone = dict(store=dist.HashStore(), rank=0, world_size=1) if "MASTER_ADDR" not in os.environ else {}
    if cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device, **alone)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", **alone)
    mesh = init_device_mesh(device.type, (world,))
    for mbs in args.mbs:
        try:
            result = run_one(args, shape, mbs, device, mesh, world)
        except Exception as error:  # noqa: BLE001 - only running out of memory is a result
            if not is_out_of_memory(error):
                raise
            print("RESULT " + json.dumps({
                "oom": True, "impl": impl_of(args), "shape": args.shape, "layers": shape["num_layers"], "gpus": world,
                "rank": rank, "seq": args.seq, "mbs": mbs, "gbs": args.gbs, "lora_rank": args.lora_rank,
                "hf": asdict(settings_of(args)), "error": (str(error).splitlines() or [""])[0][:300],
                "peak_mem_gb": round(torch.cuda.max_memory_allocated() / 2**30, 1) if cuda else None,
            }), flush=True)
            sys.stderr.flush()
            os._exit(0 if world == 1 else 1)  # other ranks may wait in a collective: torchrun ends them
        if result is not None:
            print("RESULT " + json.dumps(result), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
