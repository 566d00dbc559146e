"""MegatronStrategy: Lightning drives, Megatron-Core parallelises.

Per step:  Lightning -> module.training_step(batch) -> strategy.forward_backward(batch, fn)
           -> mcore schedule over the microbatches (forward, backward, finalize_model_grads)
           -> gradient norm and clipping, the loss and norm checked (the step's one host read)
           -> MegatronOptimizer.step (update, LR schedule).
The batch a rank receives is its data-parallel share of the global batch
(global_batch_size / dp rows); the strategy cuts it into micro_batch_size pieces.

A module used with this strategy exposes `chunks` (an nn.ModuleList of mcore models, one per
virtual pipeline stage), built in its `configure_model` (objectives/base.py builds and loads them).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import shutil
import signal
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Literal, Optional

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.fabric.utilities import distributed as fabric_distributed
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from megatron.core import parallel_state, tensor_parallel
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.utils import get_model_config

from lightning_mcore.generation import decode_graphs
from lightning_mcore.lora.adapters import with_expert_tp_grad_sums
from lightning_mcore.lora.checks import check_lora_plan
from lightning_mcore.model.config import refuse_longer, to_transformer_config
from lightning_mcore.sequence.packing import cp_row_length, packed_context_parallel_slice
from lightning_mcore.strategy import checkpoint_io, determinism
from lightning_mcore.strategy.async_saves import AsyncSaves
from lightning_mcore.strategy.checkpoint_io import CheckpointOptions
from lightning_mcore.strategy.cpu import CpuCompat, choose_rank_threads, cuda_on_cpu, use_rank_threads
from lightning_mcore.strategy.cuda_graphs import (check_graph_shape, graph_safe_rng, release_captured_graphs,
                                                  validate_cuda_graphs, validate_graphed_module)
from lightning_mcore.strategy.expert_gemm import validate_expert_gemm, validate_expert_kernel
from lightning_mcore.strategy.forked import rebuild_thread_pool
from lightning_mcore.strategy.forked_ranks import ForkedRanksLauncher
from lightning_mcore.strategy.garbage import FrozenAfterFirstStep
from lightning_mcore.strategy.launcher import MultiprocessingLauncher
from lightning_mcore.strategy.memory import validate_memory, validate_reference_offload
from lightning_mcore.strategy.metrics import reduce_metrics
from lightning_mcore.strategy.nonfinite import NonFiniteError, host_values, refuse_nonfinite_weights
from lightning_mcore.strategy.optimizer import (
    MegatronOptimizer,
    OptimizerSettings,
    build_lr_scheduler,
    build_megatron_optimizer,
)
from lightning_mcore.strategy.parallel import (
    BatchConfig,
    LayoutError,
    ParallelConfig,
    context_parallel_slice,
    resolve_fast_path,
    validate_layout,
)
from lightning_mcore.strategy.signals import SignalWatch, StopSignal, hpc_checkpoint_path, requeue_slurm_job
from lightning_mcore.strategy.teardown import destroy_model_parallel

_PRECISIONS = {
    "32-true": torch.float32,
    "32": torch.float32,
    "bf16-mixed": torch.bfloat16,
}


def precision_dtype(precision) -> torch.dtype:
    """The weights' dtype of a Trainer `precision`; ValueError for one we do not run."""
    if str(precision) not in _PRECISIONS:
        raise ValueError(
            f"precision={str(precision)!r} is not supported by MegatronStrategy; use '32-true' "
            f"or 'bf16-mixed' (mcore keeps fp32 main weights and grads with bf16)."
        )
    return _PRECISIONS[str(precision)]


class MegatronStrategy(DDPStrategy):
    """The Lightning strategy that runs a MegatronModule under Megatron-Core's parallelism
    (tensor, pipeline, context, expert and data parallel, the distributed optimizer) and writes
    its distributed checkpoints; each step is one mcore schedule over the microbatches."""

    strategy_name = "megatron"

    def __init__(
        self,
        tensor_model_parallel_size: int = 1,
        pipeline_model_parallel_size: int = 1,
        virtual_pipeline_model_parallel_size: Optional[int] = None,
        context_parallel_size: int = 1,
        expert_model_parallel_size: int = 1,
        expert_tensor_parallel_size: Optional[int] = None,
        sequence_parallel: bool = False,
        use_distributed_optimizer: Optional[bool] = None,
        overlap_grad_reduce: Optional[bool] = None,
        overlap_param_gather: bool = False,
        global_batch_size: int = 8,
        micro_batch_size: int = 1,
        seed: int = 1234,
        checkpoint: Optional[CheckpointOptions] = None,
        timeout: Optional[timedelta] = timedelta(minutes=30),
        start_method: Optional[Literal["popen", "spawn", "fork", "forkserver"]] = None,
        process_group_backend: Optional[str] = None,
        accelerator: Optional[Accelerator] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
    ) -> None:
        """Parallel sizes carry Megatron's names; `checkpoint` says what checkpoints hold and
        whether they are written asynchronously; the rest is Lightning's usual plumbing.

        `use_distributed_optimizer` and `overlap_grad_reduce` left at None take the fast path
        for the device: on GPU both on (optimizer state sharded over data-parallel ranks, grad
        reduce-scatter overlapped with backward; the sharding with Adam only), on CPU both off.

        `start_method` is how this process starts the other ranks of its node: "popen" (left None)
        keeps this process as rank 0 and runs the program again for each other rank; the CLI on
        CPU forks them from its process instead where it is left None (`fork_ranks`). "fork" and
        "spawn" are Lightning's multiprocessing launcher (notebooks, tests).

        Lightning's `Trainer(deterministic=True)` also turns on mcore's deterministic mode and the
        environment TE, NCCL and cuBLAS need for it (strategy/determinism.py)."""
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method or "popen",
        )
        self._may_fork_ranks = start_method is None  # fork_ranks: the CLI's default on CPU
        self.parallel = ParallelConfig(
            tensor_model_parallel_size=tensor_model_parallel_size,
            pipeline_model_parallel_size=pipeline_model_parallel_size,
            virtual_pipeline_model_parallel_size=virtual_pipeline_model_parallel_size,
            context_parallel_size=context_parallel_size,
            expert_model_parallel_size=expert_model_parallel_size,
            expert_tensor_parallel_size=expert_tensor_parallel_size,
            sequence_parallel=sequence_parallel,
            use_distributed_optimizer=use_distributed_optimizer,
            overlap_grad_reduce=overlap_grad_reduce,
            overlap_param_gather=overlap_param_gather,
        )
        self._graph_shape = None  # the training batch shape CUDA graphs were captured for
        self._requested_parallel = self.parallel  # None = the device's fast path (resolve_fast_path)
        self.batch = BatchConfig(global_batch_size, micro_batch_size)
        self.seed = seed
        self.checkpoint_options = checkpoint or CheckpointOptions()
        self._async_saves = AsyncSaves()  # checkpoints still being written (async_save)
        self._cpu = CpuCompat()
        self.deterministic = False  # Trainer(deterministic=True): set when the Trainer builds us
        self._long_lived = FrozenAfterFirstStep()  # the garbage collector's (strategy/garbage.py)
        self._signals = SignalWatch()  # SIGTERM/SIGINT/SLURM requeue, acted on between steps
        self._signal_group = None  # a gloo group of all ranks for it, where the default is NCCL
        self._stopped_by = 0  # the signal this run stopped on

    # ---------------------------------------------------------------- environment
    @property
    def on_cpu(self) -> bool:
        return self.root_device.type == "cpu"

    @property
    def dtype(self) -> torch.dtype:
        return precision_dtype(self.precision_plugin.precision)

    def mcore_context(self):
        """Context for calls into mcore: on CPU, CUDA-only tensor creation lands on CPU."""
        return cuda_on_cpu() if self.on_cpu else contextlib.nullcontext()

    def validate(self, model_config=None, optimizer: Optional[str] = None,
                 optim: Optional[OptimizerSettings] = None) -> None:
        """All layout and memory-option checks, pure: runs before any process group or model
        exists. `optim`: the module's OptimizerSettings, where known."""
        accelerator = "cpu" if self.on_cpu else "gpu"
        use_te = model_config.uses_te(accelerator) if model_config else False
        self._validate_layout(self.num_nodes * self.num_processes, self.parallel, model_config, optimizer,
                              optim, accelerator, use_te)

    def _validate_layout(self, world_size: int, parallel: ParallelConfig, model_config, optimizer,
                         optim, accelerator: str, use_te: bool) -> None:
        validate_layout(world_size, parallel, self.batch, model_config, accelerator=accelerator,
                        use_te=use_te, optimizer=optimizer)
        validate_memory(parallel, model_config, optim, accelerator, use_te)
        if model_config is not None:
            validate_cuda_graphs(model_config, accelerator)
            validate_expert_gemm(model_config)

    def _configure_launcher(self) -> None:
        # Lightning calls this when the Trainer is built: the earliest point at which the world
        # size and the device are known. Layout and batch mistakes fail here, in the main process.
        self.parallel = resolve_fast_path(self._requested_parallel, on_gpu=not self.on_cpu)
        self.validate()
        self.deterministic = determinism.requested()  # Lightning has set torch's flag by now
        if self.deterministic:
            determinism.set_environment()  # before any rank starts (strategy/determinism.py)
        if self.on_cpu:
            choose_rank_threads(self.num_processes)  # before any rank starts (strategy/cpu.py)
        super()._configure_launcher()
        if type(self._launcher) is _MultiProcessingLauncher:  # fork/spawn (strategy/launcher.py)
            self._launcher = MultiprocessingLauncher(self, start_method=self._start_method)

    def fork_ranks(self) -> None:
        """For a program that makes one Trainer call and then ends, as the CLI does: on CPU,
        ranks 1.. are forked from this process when that call starts, instead of re-running the
        program in fresh interpreters (strategy/forked_ranks.py). Nothing changes on GPU, where
        `start_method` was given (popen included), or where this process does not start the
        ranks (torchrun, srun)."""
        if self.on_cpu and self._may_fork_ranks and type(self._launcher) is _SubprocessScriptLauncher:
            self._launcher = ForkedRanksLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    def validate_module(self, module) -> None:
        """Settle the fast-path defaults for the module's optimizer (`optim`), then run every
        check, those on its model config (`model_config`) and LoRA (`lora`) included. Needs no
        process group."""
        self.parallel = self.check_run(module, self.num_nodes * self.num_processes,
                                       "cpu" if self.on_cpu else "gpu")
        model_config = getattr(module, "model_config", None)
        self.refuse_packed_context_parallel(module)
        if model_config is not None:
            validate_graphed_module(model_config, type(module).__name__, getattr(module, "packed_sequences", False))
        if hasattr(module, "check_layout"):  # the module's own needs of the batch (GRPO's groups)
            module.check_layout(self)

    def check_run(self, module, world_size: int, accelerator: str, use_te: Optional[bool] = None) -> ParallelConfig:
        """The layout, memory-option and LoRA checks of `module` in a run of `world_size` ranks
        on `accelerator`, pure: also for a run this process will not launch (lightning-mcore
        plan checks a GPU config on a laptop). Returns the layout with the fast-path defaults
        settled for that device. `use_te`: whether the run has Transformer Engine (default:
        whether this machine has it)."""
        optim = getattr(module, "optim", None)
        optimizer = getattr(optim, "optimizer", None)
        parallel = resolve_fast_path(self._requested_parallel, accelerator == "gpu", optimizer)
        model_config = getattr(module, "model_config", None)
        if use_te is None:
            use_te = model_config.uses_te(accelerator) if model_config else False
        self._validate_layout(world_size, parallel, model_config, optimizer,
                              optim if isinstance(optim, OptimizerSettings) else None, accelerator, use_te)
        validate_reference_offload(getattr(module, "offload_reference", False), accelerator)
        if getattr(module, "lora", None) is not None and model_config is not None:
            check_lora_plan(module.lora, model_config, use_te, parallel.tensor_model_parallel_size,
                            parallel.expert_tensor_parallel_size)
        if model_config is not None:  # after LoRA's check, whose refusal names the LoRA fix
            validate_expert_kernel(model_config, use_te)
        return parallel

    def setup_distributed(self) -> None:
        """Lightning's, but the process group is not bound to the device (no `device_id`), as
        Megatron-LM starts it. Bound, torch opens the NCCL communicator of every group mcore
        creates at once: on one H100 that held 6.1 GiB outside PyTorch's allocator, enough to
        push a 30B-A3B-shaped run into allocator retries (benchmarks/RESULTS.md, session 10).
        Unbound, each communicator opens at its group's first collective."""
        reset_seed()
        self.set_world_ranks()
        self._process_group_backend = self._get_process_group_backend()
        fabric_distributed._init_dist_connection(self.cluster_environment, self._process_group_backend, timeout=self._timeout)

    def setup_environment(self) -> None:
        rebuild_thread_pool()  # a forked rank's first backward could find none (strategy/forked.py)
        self.validate_module(self.lightning_module)  # still before any process group exists
        _ = self.dtype  # refuse unsupported precision before starting processes groups
        if self.on_cpu:
            if self.num_processes > 1:  # a run in the caller's own process keeps its threads
                use_rank_threads()
            self._cpu.install()
        super().setup_environment()  # sets the device, starts torch.distributed

        parallel_state.initialize_model_parallel(**self.parallel.sizes())
        self._seed_rng()

    def _seed_rng(self) -> None:
        """Megatron's seeding: one stream per pipeline stage, plus mcore's per-TP/EP streams
        for dropout inside sharded regions. (Initial weights use their own per-tensor seeds.)"""
        seed = self.seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
        torch.manual_seed(seed)
        # On CPU, mcore's inference tracker keeps no CUDA generator state; dropout then draws
        # from the default generator. CUDA graphs need generators that a capture can replay.
        config = getattr(self.lightning_module, "model_config", None)
        tensor_parallel.model_parallel_cuda_manual_seed(
            seed, inference_rng_tracker=self.on_cpu, force_reset_rng=True,
            **graph_safe_rng(config, config is not None and self.uses_te(config)),
        )

    @property
    def data_parallel_size(self) -> int:
        return self.parallel.data_parallel_size(self.world_size)

    @property
    def data_parallel_rank(self) -> int:
        return parallel_state.get_data_parallel_rank()

    @property
    def data_parallel_batch_size(self) -> int:
        """Rows each data-parallel rank receives per optimizer step."""
        return self.batch.global_batch_size // self.data_parallel_size

    @property
    def num_microbatches(self) -> int:
        return self.batch.num_microbatches(self.data_parallel_size)

    @property
    def distributed_sampler_kwargs(self) -> dict[str, int]:
        return {"num_replicas": self.data_parallel_size, "rank": self.data_parallel_rank}

    @property
    def is_last_pipeline_stage(self) -> bool:
        return parallel_state.is_pipeline_last_stage(ignore_virtual=True)

    # ---------------------------------------------------------------- model
    def transformer_config(self, model_config):
        """mcore's TransformerConfig for `model_config` under this layout, dtype and device."""
        config = to_transformer_config(model_config, self.parallel, self.dtype, self.on_cpu,
                                       self.uses_te(model_config))
        if self.deterministic:
            determinism.make_deterministic(config)
        return config

    def refuse_unbuildable(self, model_config) -> None:
        """What this device cannot build, before anything is built."""
        if self.on_cpu and model_config.recompute_granularity:
            raise NotImplementedError(
                f"recompute_granularity={model_config.recompute_granularity!r} needs CUDA (mcore's "
                f"activation checkpointing saves and restores the CUDA RNG state); on CPU set it to None."
            )

    def uses_te(self, model_config) -> bool:
        return model_config.uses_te("cpu" if self.on_cpu else "gpu")

    @torch.no_grad()
    def forward_collect(self, batch: dict, forward_step: Callable, width: int, chunks=None,
                        packed: bool = False) -> torch.Tensor:
        """Forward-only pass over the batch's microbatches where `forward_step` returns
        (output, collect) and `collect(output)` gives [micro_batch, width] per microbatch on the
        last stage (e.g. per-sample log-probs); returns [rows, width] on every rank. `chunks`:
        other model chunks than the module's (a frozen reference), sharded the same way. Under
        context parallelism only packed rows of a module that sets `packed_context_parallel`
        (its collect adds the cp ranks' shares, as DPO's pair_logps does)."""
        if not packed:
            self.refuse_context_parallel("forward_collect (e.g. DPO's reference pass)")
        batch = {k: v.to(self.root_device, non_blocking=True) for k, v in batch.items()}
        micro = self._context_parallel_slices(self.split_microbatches(batch), packed)
        chunks = list(chunks if chunks is not None else self.lightning_module.chunks)
        rows, seq = next(iter(batch.values())).shape[:2]
        return self.forward_only(micro, forward_step, chunks, self._schedule_shape(seq, packed, micro),
                                  (rows, width))

    def check_sequence_length(self, seq: int, what: str) -> None:
        """Refuse sequences longer than the module's model_config.seq_length."""
        config = getattr(self.lightning_module, "model_config", None)
        if config is not None:
            refuse_longer(seq, config.seq_length, what)

    def refuse_context_parallel(self, what: str) -> None:
        if self.parallel.context_parallel_size > 1:
            raise NotImplementedError(
                f"{what} with context_parallel_size > 1 is not supported: it returns whole "
                f"sequences, which context parallelism splits over ranks. Use context_parallel_size=1."
            )

    def _context_parallel_slices(self, micro: list[dict], packed: bool) -> list[dict]:
        """This cp rank's balanced share of every microbatch (parallel.context_parallel_slice;
        for packed THD rows model/packing.packed_context_parallel_slice, every microbatch padded
        to one length). Token losses and counts from all shares meet in the data-parallel x cp
        reduction (reduce_metrics, finalize_model_grads' num_tokens)."""
        cp = self.parallel.context_parallel_size
        if cp == 1:
            return micro

        rank = parallel_state.get_context_parallel_rank()
        if packed:
            self.refuse_packed_context_parallel(self.lightning_module)
            multiple = 2 * cp * (self.parallel.tensor_model_parallel_size
                                 if self.parallel.sequence_parallel else 1)
            length = cp_row_length([mb["segment_ids"] for mb in micro], cp, multiple)
            return [packed_context_parallel_slice(mb, cp, rank, length) for mb in micro]

        return [context_parallel_slice(mb, cp, rank) for mb in micro]

    def refuse_packed_context_parallel(self, module) -> None:
        """Only modules whose forward step takes PackedSeqParams from the sliced microbatch
        (model/packing.packed_seq_params_for) and reduces token sums, such as SFT, set
        `packed_context_parallel`; others read whole rows (DPO's pairs, reward's last tokens)."""
        if (self.parallel.context_parallel_size > 1 and getattr(module, "packed_sequences", False)
                and not getattr(module, "packed_context_parallel", False)):
            raise LayoutError(
                f"context_parallel_size={self.parallel.context_parallel_size} with "
                f"{type(module).__name__}'s packed sequences is not supported yet (packed context "
                f"parallelism is wired for SFT only); use context_parallel_size=1.",
                options=("context_parallel_size",),
            )

    def _schedule_shape(self, seq: int, packed: bool, micro: Optional[list] = None) -> tuple[int, int]:
        """(seq_length, micro_batch_size) for mcore's schedule: a packed microbatch travels as
        one row of micro_batch_size * seq tokens, or under context parallelism of the padded
        length every microbatch was filled to (mcore divides it by the cp size itself)."""
        if packed and micro and "cu_seqlens_padded" in micro[0]:
            return int(micro[0]["cu_seqlens_padded"][-1]), 1
        mbs = self.batch.micro_batch_size
        return (seq * mbs, 1) if packed else (seq, mbs)

    def forward_only(self, micro: list, forward_step: Callable, chunks: list,
                      schedule_shape: tuple[int, int], shape: tuple) -> torch.Tensor:
        """mcore's forward-only schedule collecting `collect(output)` of every microbatch on the
        last stage; the concatenation, reshaped to `shape`, is shared with every stage."""
        def step_fn(data_iterator, model):
            output, collect = forward_step(next(data_iterator), model)
            return output, lambda out, non_loss_data=True: collect(out)

        with self.mcore_context():
            data = get_forward_backward_func()(
                forward_step_func=step_fn,
                data_iterator=[iter(micro) for _ in chunks] if len(chunks) > 1 else iter(micro),
                model=chunks,
                num_microbatches=len(micro),
                seq_length=schedule_shape[0],
                micro_batch_size=schedule_shape[1],
                forward_only=True,
                collect_non_loss_data=True,
            )
        if self.is_last_pipeline_stage:
            result = torch.cat([d.float() for d in data]).reshape(shape).contiguous()
        else:
            result = torch.empty(shape, device=self.root_device)
        if self.parallel.pipeline_model_parallel_size > 1:
            dist.broadcast(result, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                           group=parallel_state.get_pipeline_model_parallel_group())
        return result

    def model_to_device(self) -> None:
        pass  # chunks are built on their device

    def setup(self, trainer) -> None:
        self.accelerator.setup(trainer)
        module = self.lightning_module
        chunks = getattr(module, "chunks", None)
        if chunks is None or len(chunks) == 0:
            raise RuntimeError(
                f"{type(module).__name__} has no `chunks`: build them in configure_model() "
                f"(MegatronModule does: objectives/base.py)."
            )
        self._wrap_chunks(chunks)
        if trainer.state.fn == "fit":
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        self.model = module

    def _wrap_chunks(self, chunks: torch.nn.ModuleList) -> None:
        p = self.parallel
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=p.overlap_grad_reduce,
            overlap_param_gather=p.overlap_param_gather,
            use_distributed_optimizer=p.use_distributed_optimizer,
            check_for_nan_in_grad=False,
        )
        config = get_model_config(chunks[0])
        with self.mcore_context():
            for i, chunk in enumerate(chunks):
                if isinstance(chunk, DistributedDataParallel):
                    continue
                chunks[i] = DistributedDataParallel(
                    config=config, ddp_config=ddp_config, module=chunk, disable_bucketing=i > 0
                )
        wrapped = list(chunks)
        if p.overlap_grad_reduce:
            config.no_sync_func = [c.no_sync for c in wrapped]
            config.grad_sync_func = [c.start_grad_sync for c in wrapped]
            if len(wrapped) == 1:
                config.no_sync_func, config.grad_sync_func = wrapped[0].no_sync, wrapped[0].start_grad_sync
        if p.overlap_param_gather:
            config.param_sync_func = [c.start_param_sync for c in wrapped]
            if len(wrapped) == 1:
                config.param_sync_func = wrapped[0].start_param_sync

        config.finalize_model_grads_func = with_expert_tp_grad_sums(finalize_model_grads)

    def megatron_optimizer(self, settings: OptimizerSettings) -> MegatronOptimizer:
        """mcore optimizer (distributed when asked) and LR schedule over the wrapped chunks."""
        chunks = list(self.lightning_module.chunks)
        with self.mcore_context():
            opt = build_megatron_optimizer(chunks, settings, self.parallel, self.dtype, not self.on_cpu)
        max_steps = self.lightning_module.trainer.max_steps
        scheduler = build_lr_scheduler(opt, settings, max_steps if max_steps and max_steps > 0 else 0)

        def zero_grad_buffers():
            for chunk in chunks:
                chunk.zero_grad_buffer()

        def after_update():  # the fit's last update reaches every rank's weights before anything reads them
            trainer = self.lightning_module.trainer
            if 0 < trainer.max_steps <= trainer.global_step + 1:
                self.sync_weights()

        return MegatronOptimizer(opt, scheduler, zero_grad_buffers, self.mcore_context,
                                 settings.on_nonfinite, lambda: self.lightning_module.trainer.global_step,
                                 after_update)

    def sync_weights(self) -> None:
        """Collective: bring every rank's model weights up to date before they are read outside a
        training forward. With `overlap_param_gather` the distributed optimizer all-gathers each
        update during the next forward (mcore's forward pre-hooks), so until then each rank holds
        its own shard of the update only. The strategy calls this before a checkpoint, validation,
        testing, prediction, generation, an HF export, after the fit's last update and at its end;
        a callback of one's own that reads weights between steps calls it too. A no-op without
        the overlap."""
        if not self.parallel.overlap_param_gather:
            return
        with self.mcore_context(), torch.no_grad():
            for chunk in self.lightning_module.chunks:
                if isinstance(chunk, DistributedDataParallel) and chunk.use_forward_hook:
                    chunk.start_param_sync(force_sync=True)

    # ---------------------------------------------------------------- steps
    def check_training_rows(self, rows: int) -> None:
        """A training step takes global_batch_size / data-parallel size rows on every rank: more
        would train a larger global batch than configured, silently (a DataLoader whose
        batch_size is the global batch, at DP > 1)."""
        want = self.data_parallel_batch_size
        if rows != want:
            dp = self.data_parallel_size
            raise ValueError(
                f"a training batch of {rows} rows on each of the {dp} data-parallel rank(s) would "
                f"train {rows * dp} rows a step, but global_batch_size="
                f"{self.batch.global_batch_size}: give each rank global_batch_size / data-parallel "
                f"size = {want} rows (DataLoader(batch_size={want}); our data modules do)."
            )

    def split_microbatches(self, batch: dict) -> list[dict]:
        rows = next(iter(batch.values())).shape[0]
        if "tokens" in batch:
            self.check_sequence_length(batch["tokens"].shape[-1], "batch rows")
        mbs = self.batch.micro_batch_size
        if rows % mbs:
            raise ValueError(
                f"a batch of {rows} rows cannot be cut into micro batches of {mbs}; the data "
                f"loader should yield global_batch_size / data-parallel size = "
                f"{self.data_parallel_batch_size} rows."
            )
        return [{k: v[i : i + mbs] for k, v in batch.items()} for i in range(0, rows, mbs)]

    def forward_backward(
        self,
        batch: dict,
        forward_step: Callable[[dict, torch.nn.Module], tuple],
        forward_only: bool = False,
        packed: bool = False,
    ) -> dict[str, torch.Tensor]:
        """Run mcore's schedule over the batch's microbatches; return reduced metrics.

        `forward_step(microbatch, chunk)` returns (output, loss_fn) as mcore expects. Metrics
        come back as per-token means over the global batch on every rank; from a training step
        as CPU tensors, read back with the update's check (`_checked_step`). `packed`: the
        forward step sends each [micro_batch, seq] microbatch through the model as one THD row
        of micro_batch * seq tokens (sequence/packing.py), which sets the pipeline's tensor shape.
        """
        if not forward_only:
            self.check_training_rows(next(iter(batch.values())).shape[0])
        config = getattr(self.lightning_module, "model_config", None)
        # graphs are captured by the first training step; evaluation after it replays them too
        if getattr(config, "cuda_graphs", None) is not None and (not forward_only or self._graph_shape):
            self._graph_shape = check_graph_shape(config, self._graph_shape, next(iter(batch.values())).shape)
        batch = {k: v.to(self.root_device, non_blocking=True) for k, v in batch.items()}
        micro = self._context_parallel_slices(self.split_microbatches(batch), packed)
        chunks = list(self.lightning_module.chunks)
        iters = [iter(micro) for _ in chunks]
        # the whole sequence length: mcore divides it by the cp size for pipeline tensors itself
        schedule_shape = self._schedule_shape(next(iter(batch.values())).shape[1], packed, micro)

        if not forward_only:
            for optimizer in self.optimizers:
                optimizer.clear_grads()

        def step_fn(data_iterator, model):
            return forward_step(next(data_iterator), model)

        with self.mcore_context():
            outputs = get_forward_backward_func()(
                forward_step_func=step_fn,
                data_iterator=iters if len(iters) > 1 else iters[0],
                model=chunks,
                num_microbatches=len(micro),
                seq_length=schedule_shape[0],
                micro_batch_size=schedule_shape[1],
                forward_only=forward_only,
            )
            dp_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
            metrics = reduce_metrics(outputs, dp_group) if self.is_last_pipeline_stage else {}
        metrics = self._share_from_last_stage(metrics)
        return metrics if forward_only else self._checked_step(metrics)

    def _checked_step(self, metrics: dict) -> dict:
        """The optimizer's check of the loss and gradient norm before the update, which reads the
        metrics back in the same copy (MegatronOptimizer.check_update). Returns the metrics as CPU
        tensors: logging them, even to the progress bar each step, waits for nothing, so the host
        can queue the next step while the GPU runs the update."""
        values = list(metrics.values())
        for optimizer in self.optimizers:  # one in practice; a second reads host floats only
            values = optimizer.check_update(metrics.get("loss"), *values)
        return {k: torch.tensor(v) for k, v in zip(metrics, host_values(*values))}

    def _share_from_last_stage(self, metrics: dict) -> dict:
        """Give every rank the last pipeline stage's metrics (rank 0 logs and draws the bar)."""
        if self.parallel.pipeline_model_parallel_size == 1:
            return metrics
        payload = [{k: float(v) for k, v in metrics.items()}]  # one sync per metric: PP > 1 only
        dist.broadcast_object_list(
            payload,
            src=parallel_state.get_pipeline_model_parallel_last_rank(),
            group=parallel_state.get_pipeline_model_parallel_group(),
            device=self.root_device if not self.on_cpu else None,
        )
        return {k: torch.tensor(v) for k, v in payload[0].items()}  # read on the host already

    def on_train_start(self) -> None:
        """From here on a stop or requeue signal is acted on between steps (strategy/signals.py)."""
        super().on_train_start()
        env = self.cluster_environment
        requeue = env.requeue_signal if isinstance(env, SLURMEnvironment) and env.auto_requeue else None
        if dist.is_initialized() and dist.get_backend() != "gloo":
            self._signal_group = dist.new_group(backend="gloo")
        forward = getattr(self.launcher, "kill", None) if self.is_global_zero else None
        self._stopped_by = 0
        self._signals.install(forward, requeue, self._signal_group)

    def on_validation_start(self) -> None:
        super().on_validation_start()
        self.sync_weights()

    def on_test_start(self) -> None:
        super().on_test_start()
        self.sync_weights()

    def on_predict_start(self) -> None:
        super().on_predict_start()
        self.sync_weights()

    def on_train_end(self) -> None:
        super().on_train_end()
        self.sync_weights()

    def _act_on_signals(self) -> None:
        """Collective: every rank stops (or saves and requeues) at the same step."""
        stop, requeue = self._signals.agreed()
        trainer = self.lightning_module.trainer
        if requeue:
            path = hpc_checkpoint_path(trainer.default_root_dir)
            trainer.save_checkpoint(path)  # rank 0's path names it (checkpoint_io.save)
            if self.is_global_zero:
                requeue_slurm_job()
        if stop:
            if self.is_global_zero:
                sys.stderr.write(f"lightning-mcore: stopped by {signal.Signals(stop).name} before step "
                                 f"{trainer.global_step + 1}; checkpoints still being written are "
                                 f"finished first; exit code {128 + stop}.\n")
            self._stopped_by = stop
            raise StopSignal(stop)

    def training_step(self, *args: Any, **kwargs: Any):
        # No autocast context: mcore runs mixed precision itself (bf16 weights, fp32 main
        # weights and grads in its optimizer), so Lightning's autocast would only add casts.
        self._act_on_signals()
        self.finalize_async_saves()
        if not self.on_cpu:  # the GPU fast path (strategy/garbage.py says why not on CPU)
            self._long_lived.before_step(self.lightning_module.trainer.global_step)
        return self.lightning_module.training_step(*args, **kwargs)

    def validation_step(self, *args: Any, **kwargs: Any):
        return self.lightning_module.validation_step(*args, **kwargs)

    def backward(self, closure_loss, optimizer, *args: Any, **kwargs: Any):
        return closure_loss  # mcore's schedule already ran backward for every microbatch

    # ---------------------------------------------------------------- checkpoints
    def lightning_module_state_dict(self) -> dict:
        return {}  # weights go through dist_checkpointing in save_checkpoint, shard by shard

    def optimizer_state(self, optimizer) -> dict:
        return {}  # likewise

    def save_checkpoint(self, checkpoint: dict, filepath, storage_options: Optional[Any] = None) -> None:
        module = self.lightning_module
        self.refuse_nonfinite_weights(f"checkpoint {filepath}")
        self.sync_weights()
        optimizer = self.optimizers[0] if self.optimizers else None
        extra = {
            "model_config": dataclasses.asdict(module.model_config),
            "hf_family": getattr(module, "hf_family", None),
            "parallel": dataclasses.asdict(self.parallel),
            "lr_scheduler": optimizer.scheduler.state_dict() if optimizer is not None else None,
            "saved_optimizer": optimizer is not None and self.checkpoint_options.save_optimizer,
            "hf_path": getattr(module, "hf_path", None),
            "init_checkpoint": getattr(module, "init_checkpoint", None),
            "tokenizer_path": getattr(module, "tokenizer_path", None),
            "head": getattr(module, "output_head", "lm"),
            "lora": dataclasses.asdict(module.lora) if getattr(module, "lora", None) else None,
            "dtype": str(self.dtype).removeprefix("torch."),
        }
        common = checkpoint_io.strip_for_common(checkpoint, extra)
        pending = self._async_saves.new(filepath)
        with self.mcore_context():
            request = checkpoint_io.save(
                Path(filepath), common, list(module.chunks),
                optimizer.optimizer if optimizer is not None else None, self.global_rank,
                self.checkpoint_options, wanted=lambda: not pending.removed,
            )
            self._async_saves.schedule(request, pending)

    def refuse_nonfinite_weights(self, what: str) -> None:
        """Raise NonFiniteError rather than write `what` from NaN/inf weights, or from weights a
        NaN/inf update reached (on_nonfinite="stop_after_update"; every rank knows alike), which
        may still look finite (collective)."""
        if any(getattr(o, "applied_nonfinite", False) for o in self.optimizers):
            raise NonFiniteError(f"refusing to write {what}: a step's NaN/inf update reached the "
                                 f"weights (on_nonfinite='stop_after_update'). Resume from the last "
                                 f"checkpoint.")
        refuse_nonfinite_weights(self.lightning_module.chunks, self.root_device, what)

    def _finish_async_saves(self) -> None:
        """Wait for the checkpoints still being written and publish them. One whose writer was
        killed (a SIGKILL, SIGTERM to a writer) stays under its temporary name, reported in one
        line on a stopped run; otherwise its error is raised."""
        try:
            self.finalize_async_saves(blocking=True)
        except Exception as error:  # noqa: BLE001 - re-raised unless the run stops on a signal
            if not self._stopped_by:
                raise
            if self.is_global_zero:
                sys.stderr.write(f"lightning-mcore: a checkpoint being written when the run was "
                                 f"stopped could not be finished ({type(error).__name__}); it was not "
                                 f"published, the previous one stays in place.\n")

    def finalize_async_saves(self, blocking: bool = False) -> None:
        """Publish the async checkpoints whose writes finished on every rank (collective)."""
        if len(self._async_saves):
            with self.mcore_context():
                self._async_saves.finalize(blocking=blocking)

    def load_checkpoint(self, checkpoint_path, weights_only: Optional[bool] = None) -> dict:
        self._loading_path = Path(checkpoint_path)
        module = self.lightning_module
        common = checkpoint_io.read_resumed(self._loading_path, module.model_config,
                                            self.parallel.tensor_model_parallel_size,
                                            getattr(module, "lora", None))
        return {**common, "state_dict": {}, "optimizer_states": [{}]}

    def load_model_state_dict(self, checkpoint, strict: bool = True) -> None:
        with self.mcore_context():
            checkpoint_io.load_model(self._loading_path, list(self.lightning_module.chunks))
        checkpoint_io.load_rng(self._loading_path, self.global_rank)

    def load_optimizer_state_dict(self, checkpoint) -> None:
        """The checkpoint's optimizer state and LR schedule position, with this run's optimizer
        settings (lr, min_lr, warmup, decay steps, betas, ...); the differences are logged."""
        optimizer = self.optimizers[0]
        saved = checkpoint.get("megatron", {})
        load_state = None
        if saved.get("saved_optimizer", True):
            load_state = functools.partial(self._load_optimizer_shards, optimizer)
        else:
            rank_zero_warn(f"{self._loading_path} holds no optimizer state (saved with "
                           "save_optimizer=False): the optimizer starts fresh.")
        changes = optimizer.resume(load_state, saved.get("lr_scheduler"))
        if changes:
            rank_zero_info(f"Resuming {self._loading_path} with this run's optimizer settings, "
                           f"which differ from the checkpoint's: {'; '.join(changes)}.")

    def _load_optimizer_shards(self, optimizer: MegatronOptimizer) -> None:
        with self.mcore_context():
            checkpoint_io.load_optimizer(self._loading_path, list(self.lightning_module.chunks),
                                         optimizer.optimizer)

    def remove_checkpoint(self, filepath) -> None:
        """Lightning's removal (save_top_k); a checkpoint still being written is not published."""
        self._async_saves.remove(filepath)
        if self.is_global_zero:
            shutil.rmtree(filepath, ignore_errors=True)

    # ---------------------------------------------------------------- teardown
    def teardown(self) -> None:
        self._finish_async_saves()
        self._signals.uninstall()
        if self._signal_group is not None:
            dist.destroy_process_group(self._signal_group)
            self._signal_group = None
        self._long_lived.release()
        if self._graph_shape is not None:  # a graphed step ran (or began): its captures go
            release_captured_graphs()
            self._graph_shape = None
        decode_graphs.release()  # before the process groups their collectives use
        if parallel_state.model_parallel_is_initialized():
            destroy_model_parallel()
        super().teardown()
        self._cpu.uninstall()

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        strategy_registry.register(cls.strategy_name, cls, description="Megatron-Core parallelism")
