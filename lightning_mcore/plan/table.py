"""The plan as a small table: one line per component, the total, the largest micro batch."""

from __future__ import annotations

import re
from typing import Optional

from lightning_mcore.plan.inputs import PlanInputs
from lightning_mcore.plan.memory import MICRO_BATCH_LIMIT, GiB, MemoryPlan

UNITS = {"": 1, "b": 1, "kib": 1024, "mib": 1024**2, "gib": GiB, "tib": 1024**4,
         "kb": 1000, "mb": 1000**2, "gb": 1000**3, "tb": 1000**4}


def parse_bytes(text: str) -> int:
    """'80GiB', '141 GB', '2.5e10' -> bytes."""
    match = re.fullmatch(r"\s*([0-9.eE+]+)\s*([A-Za-z]*)\s*", str(text))
    if not match or match.group(2).lower() not in UNITS:
        raise ValueError(f"{text!r} is not a memory size: write e.g. 80GiB, 141GB or 24GiB.")
    return int(float(match.group(1)) * UNITS[match.group(2).lower()])


def gib(n: float) -> str:
    """Bytes in GiB (MiB below one GiB, so a small model's lines are not all 0.00)."""
    return f"{n / GiB:9.2f} GiB" if n >= GiB else f"{n / 1024**2:9.2f} MiB"


def describe(inputs: PlanInputs, ranks: str = "GPUs") -> str:
    """One line of what was planned: layout, precision, optimizer, LoRA, recompute, batch."""
    p, m = inputs.parallel, inputs.model
    sizes = (f"TP={p.tensor_model_parallel_size} PP={p.pipeline_model_parallel_size}"
             + (f" VPP={p.virtual_pipeline_model_parallel_size}" if p.virtual_pipeline_model_parallel_size else "")
             + f" CP={p.context_parallel_size} EP={p.expert_model_parallel_size}"
             + (f" ETP={p.expert_tensor_parallel_size}" if p.expert_tensor_parallel_size else "")
             + f" DP={inputs.data_parallel_size}" + (" SP" if p.sequence_parallel else ""))
    optim = inputs.optim.optimizer + (" distributed" if p.use_distributed_optimizer else "") + \
        (f" offload {inputs.optim.offload_fraction:g}" if inputs.optim.cpu_offload else "")
    lora = "full"
    if inputs.lora:
        base = inputs.lora.base_precision
        lora = f"LoRA r{inputs.lora.rank}" + (f" over an {base} base" if base != "bf16" else "")
    recompute = m.recompute_granularity or "none"
    ranks = ranks[:-1] if inputs.world_size == 1 else ranks  # "1 GPU", "1 CPU rank"
    return (f"{inputs.world_size} {ranks}, {sizes}; {'bf16' if inputs.bf16 else 'fp32'}, {optim}, {lora}, "
            f"recompute {recompute}; micro batch {inputs.micro_batch_size} x seq {m.seq_length}")


def plan_table(inputs: PlanInputs, plan: MemoryPlan, gpu_bytes: Optional[int] = None,
               largest: Optional[int] = None, ranks: str = "GPUs") -> str:
    """`ranks`: what the ranks are ("GPUs", "CPU ranks")."""
    counts = plan.parameters
    lines = [describe(inputs, ranks),
             f"per GPU (pipeline stage {plan.stage}): {counts.total:,} parameters, {counts.trainable:,} trained"]
    lines += [f"  {name:<16}{gib(value)}" for name, value in plan.components().items()]
    lines.append(f"  {'total':<16}{gib(plan.total)}")
    if gpu_bytes is not None:
        lines.append(f"largest micro batch in {gpu_bytes / GiB:.4g} GiB: {largest}"
                     + (" (none fits)" if largest == 0 else " or more" if largest == MICRO_BATCH_LIMIT else ""))
    return "\n".join(lines)
