"""The per-GPU memory of a training config: weights, gradients, optimizer state, activations,
logits and a fixed allowance, for each pipeline stage; the plan is the fullest stage's.

Bytes per parameter, as mcore allocates them (grad_reduce_in_fp32, strategy/megatron.py):

                      weights  grad buffer  optimizer state (Adam: fp32 master + 2 moments)
    bf16, trained        2          4        12 / shards  (fp32 master only for bf16 weights)
    fp32, trained        4          4         8 / shards
    frozen (LoRA base)   2 or 4     -         -
    frozen, FP8 base     1 + 4 per row (its scale), + the largest weight dequantized for a call
    frozen, NF4 base     1/2 + 4 per 64 inputs (a block's scale), + the same largest weight
    frozen, MXFP4 base   1/2 + 1 per 32 inputs (a block's exponent), + the same largest weight

shards: the data-parallel x context-parallel ranks (routed experts: the expert data-parallel
ranks) with the distributed optimizer, else 1; `cpu_offload` keeps 1 - offload_fraction of
the state on the GPU. SGD keeps one momentum (and the master copy). The precision-aware
optimizer (TE's FusedAdam) holds the same fp32 master weights and moments as mcore's copies."""

from __future__ import annotations

from dataclasses import dataclass

from lightning_mcore.plan.activations import embedding_elements, logits_elements, stage_activation_elements
from lightning_mcore.plan.inputs import PlanInputs
from lightning_mcore.plan.parameters import ParameterCount, stage_parameters

GiB = 1024**3
# CUDA and cuBLAS workspaces, RNG states, the loss and metrics: not modelled, a stated allowance
FIXED_ALLOWANCE = GiB // 2
MICRO_BATCH_LIMIT = 1024  # the largest micro batch searched


@dataclass(frozen=True)
class MemoryPlan:
    """One rank's planned bytes, by component; `stage`: the pipeline rank it is for."""

    stage: int
    parameters: ParameterCount
    weights: int
    gradients: int
    optimizer: int
    activations: int
    logits: int
    buffers: int

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer + self.activations + self.logits + self.buffers

    def components(self) -> dict[str, int]:
        return {"weights": self.weights, "gradients": self.gradients, "optimizer state": self.optimizer,
                "activations": self.activations, "logits": self.logits, "buffers": self.buffers}


def stage_plan(inputs: PlanInputs, stage: int) -> MemoryPlan:
    params = stage_parameters(inputs, stage)
    width = 2 if inputs.bf16 else 4
    last = stage == inputs.parallel.pipeline_model_parallel_size - 1
    activations = (stage_activation_elements(inputs, stage) + embedding_elements(inputs, stage)) * width
    return MemoryPlan(
        stage=stage, parameters=params,
        weights=(params.total - params.quantized) * width + params.code_bytes + params.scale_bytes
        + params.largest_quantized * width,
        gradients=params.trainable * 4, optimizer=optimizer_bytes(inputs, params),
        activations=int(activations),
        # the logits in the weights' dtype and the loss's fp32 softmax of them (mcore's native loss)
        logits=logits_elements(inputs) * (width + 4) if last else 0,
        buffers=FIXED_ALLOWANCE,
    )


def optimizer_bytes(inputs: PlanInputs, params: ParameterCount) -> int:
    """The optimizer state on this rank's GPU."""
    optim, p = inputs.optim, inputs.parallel
    moments = 2 if optim.optimizer == "adam" else 1  # mcore's SGD keeps a momentum buffer
    per_param = 4 * (moments + (1 if inputs.bf16 else 0))
    dense, experts = params.dense, params.experts
    if p.use_distributed_optimizer:
        dense /= inputs.data_parallel_size * p.context_parallel_size
        experts /= inputs.expert_data_parallel_size
    on_gpu = 1 - optim.offload_fraction if optim.cpu_offload else 1
    return int((dense + experts) * per_param * on_gpu)


def memory_plan(inputs: PlanInputs) -> MemoryPlan:
    """The plan of the pipeline stage that needs the most memory."""
    stages = range(inputs.parallel.pipeline_model_parallel_size)
    return max((stage_plan(inputs, s) for s in stages), key=lambda plan: plan.total)


def largest_micro_batch(inputs: PlanInputs, gpu_bytes: int) -> int:
    """The largest micro batch whose plan fits in `gpu_bytes` (0: not even 1), at most
    MICRO_BATCH_LIMIT."""
    fits = 0
    for mbs in range(1, MICRO_BATCH_LIMIT + 1):
        if memory_plan(inputs.with_micro_batch(mbs)).total > gpu_bytes:
            break
        fits = mbs
    return fits
