"""The memory plan (`lightning-mcore plan`'s figure) beside allocator peaks measured on GPU
(benchmarks/RESULTS.md: torch.cuda.max_memory_allocated, GiB), with the settings of each run.

    PYTHONPATH=. python benchmarks/plan_rows.py

Each row rebuilds the run's settings from its benchmark script's shape and flags; the error is
(planned - measured) / measured. No GPU needed."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from bench_pretrain import SHAPES  # noqa: E402
from bench_vlm_sft import SHAPES as VLM_SHAPES  # noqa: E402

from lightning_mcore import GPTConfig, LoRAConfig, OptimizerSettings  # noqa: E402
from lightning_mcore.models import gpt_config_from_hf  # noqa: E402
from lightning_mcore.plan.inputs import PlanInputs  # noqa: E402
from lightning_mcore.plan.memory import GiB, memory_plan  # noqa: E402
from lightning_mcore.plan.run import vision_parameters  # noqa: E402
from lightning_mcore.strategy.parallel import ParallelConfig  # noqa: E402

FULL = dict(recompute_granularity="full", recompute_num_layers=1)


def shape(name: str, seq: int = 4096, **overrides) -> GPTConfig:
    return GPTConfig(**{**SHAPES[name], "seq_length": seq, **overrides})


def vlm(seq: int = 4096):
    """The Qwen2.5-VL-7B config as our family reads it, and its vision encoder's size."""
    class Module:  # what vision_parameters reads of a module
        model_config, hf_family = gpt_config_from_hf({"architectures": ["Qwen2_5_VLForConditionalGeneration"],
                                                       **VLM_SHAPES["qwen2_5_vl_7b"]}, seq_length=seq)

    return Module.model_config, vision_parameters(Module)


def inputs(cfg, ranks=1, mbs=1, gbs=4, lora=None, optim=OptimizerSettings(), vision=0, **parallel):
    p = ParallelConfig(use_distributed_optimizer=True, **parallel)
    return PlanInputs(model=cfg, parallel=p, world_size=ranks, micro_batch_size=mbs, global_batch_size=gbs,
                      bf16=True, optim=optim, lora=lora, vision_parameters=vision,
                      fused=cfg.transformer_impl != "local")  # as `fit` plans on a GPU


def rows():
    """(recipe, where in RESULTS.md, measured GiB, PlanInputs)."""
    vl, vision = vlm()
    offload = OptimizerSettings(cpu_offload=True, offload_fraction=1.0)
    return [
        ("dense full: Llama-8B width, 13 layers, 1 GPU, full recompute", "issue 22 depth sweep", 68.1,
         inputs(shape("llama-8b", num_layers=13, **FULL))),
        ("dense full: Llama-8B width, 12 layers, 1 GPU, full recompute", "issue 22 depth sweep", 64.4,
         inputs(shape("llama-8b", num_layers=12, **FULL))),
        ("dense full, optimizer offloaded: 19 layers, 1 GPU", "issue 22 depth sweep", 38.7,
         inputs(shape("llama-8b", num_layers=19, **FULL), optim=offload)),
        ("dense full: Llama-3-8B, seq 32768, DP=2, full recompute", "issue 22 long context", 114.4,
         inputs(shape("llama-8b", seq=32768, **FULL), ranks=2, gbs=2)),
        ("dense full: Llama-3-8B, seq 65536, CP=2, full recompute", "issue 22 long context", 114.4,
         inputs(shape("llama-8b", seq=65536, **FULL), ranks=2, gbs=2, context_parallel_size=2)),
        ("dense LoRA r16: Llama-3-8B, 1 GPU, no recompute", "2026-11-21 LoRA SFT", 34.7,
         inputs(shape("llama-8b"), lora=LoRAConfig(rank=16, alpha=32))),
        ("MoE EP=2 full: 8 layers of Qwen3-30B-A3B, micro batch 4", "session 11 moe30b-ep2", 73.3,
         inputs(shape("qwen3-30b-a3b", num_layers=8), ranks=2, mbs=4, gbs=8, expert_model_parallel_size=2)),
        ("MoE EP=2 full: GPT-OSS-20B layer x4", "issue 45 throughput", 48.7,
         inputs(shape("gpt-oss-20b-layers"), ranks=2, gbs=8, expert_model_parallel_size=2)),
        ("MoE EP=2 full: GLM-4.5-Air layers x3", "issue 45 throughput", 61.9,
         inputs(shape("glm4.5-air-layers"), ranks=2, gbs=8, expert_model_parallel_size=2)),
        ("MoE LoRA r8: Qwen3-30B-A3B, EP=2, full recompute", "session 28 lora30", 36.1,
         inputs(shape("qwen3-30b-a3b", **FULL), ranks=2, gbs=8, expert_model_parallel_size=2,
                lora=LoRAConfig(rank=8, alpha=32))),
        ("MoE LoRA r8: Qwen3-30B-A3B, EP=2, no recompute", "session 28 lora30", 56.8,
         inputs(shape("qwen3-30b-a3b"), ranks=2, gbs=8, expert_model_parallel_size=2,
                lora=LoRAConfig(rank=8, alpha=32))),
        ("MoE LoRA r8 over an FP8 base: Qwen3-30B-A3B, 1 GPU, local layers, full recompute", "session 28 fg30", 38.9,
         inputs(shape("qwen3-30b-a3b", transformer_impl="local", **FULL), gbs=2,
                lora=LoRAConfig(rank=8, alpha=32, base_precision="fp8"))),
        ("dense LoRA r16 over an FP8 base: Llama-3-8B, 1 GPU, local layers", "session 28 eight", 37.6,
         inputs(shape("llama-8b", transformer_impl="local"), gbs=8, lora=LoRAConfig(rank=16, alpha=32, base_precision="fp8"))),
        ("dense LoRA r16 over an NF4 base: Llama-3-8B, 1 GPU, local layers", "session 28 eight", 34.7,
         inputs(shape("llama-8b", transformer_impl="local"), gbs=8, lora=LoRAConfig(rank=16, alpha=32, base_precision="nf4"))),
        ("VLM LoRA r16: Qwen2.5-VL-7B, 1 GPU", "session 5 (issue 24)", 35.7,
         inputs(vl, lora=LoRAConfig(rank=16, alpha=32), vision=vision)),
        ("VLM LoRA r16: Qwen2.5-VL-7B, TP=2 + SP", "issue 24 TP=2", 18.7,
         inputs(vl, ranks=2, lora=LoRAConfig(rank=16, alpha=32), vision=vision,
                tensor_model_parallel_size=2, sequence_parallel=True)),
        ("VLM full: Qwen2.5-VL-7B, TP=2 + SP", "issue 24 TP=2", 91.8,
         inputs(vl, ranks=2, vision=vision, tensor_model_parallel_size=2, sequence_parallel=True)),
    ]


def main() -> None:
    print("| recipe | RESULTS.md | measured GiB | planned GiB | error | weights+grads+optimizer | activations+logits |")
    print("|---|---|---|---|---|---|---|")
    for recipe, where, measured, plan_inputs in rows():
        plan = memory_plan(plan_inputs)
        states = (plan.weights + plan.gradients + plan.optimizer) / GiB
        acts = (plan.activations + plan.logits) / GiB
        error = (plan.total / GiB - measured) / measured
        print(f"| {recipe} | {where} | {measured} | {plan.total / GiB:.1f} | {error:+.1%} | {states:.1f} | {acts:.1f} |")


if __name__ == "__main__":
    main()
