"""MegatronThroughput: tokens/s per GPU and MFU, logged to every logger and the progress bar."""

from __future__ import annotations

import time
from typing import Optional

import lightning as L
import torch
from lightning.fabric.utilities.throughput import Throughput, get_available_flops

from lightning_mcore.model.flops import training_flops_per_token

# Dense bf16 tensor-core peaks (FLOP/s) Lightning's table lacks: it has no plain "NVIDIA H200"
# entry and lists the H200 SXM's bf16 figure with sparsity (2.0e15); dense equals the H100 SXM's.
_DENSE_BF16 = {"h200": 989.4e12}


def peak_flops(device: torch.device, dtype: torch.dtype) -> Optional[float]:
    """Dense peak FLOP/s of one device for `dtype`, or None when unknown (e.g. CPU)."""
    if device.type == "cuda" and dtype == torch.bfloat16:
        name = torch.cuda.get_device_name(device).lower()
        for chip, flops in _DENSE_BF16.items():
            if chip in name:
                return flops
    return get_available_flops(device, dtype) if device.type == "cuda" else None


class MegatronThroughput(L.Callback):
    """Logs, every `window_size` steps, the rates over those steps:

    - `perf/tokens_per_sec_per_gpu`: global batch tokens (global_batch_size x seq) per second,
      divided by the world size (every GPU, whatever its role in TP/PP/CP/EP);
    - `perf/tflops_per_gpu` and `perf/mfu` (%, of `peak_tflops` or the device's dense bf16
      peak): model FLOPs from the config (model/flops.py: attention incl. GQA, SwiGLU, MoE
      active experts; 2 x forward instead of 3 x with LoRA, whose base gets no weight grads).

    A window is timed between CUDA-synchronised batch ends on rank 0 (every rank waits for the
    same optimizer step), the first one from the start of training. Only a window's end waits
    for the GPU: a wait every step would keep the host from queueing the next step while the
    GPU runs the update (as Megatron-LM's timers, synchronised at its log interval).
    """

    def __init__(self, window_size: int = 10, peak_tflops: Optional[float] = None) -> None:
        if window_size < 1:
            raise ValueError(f"window_size must be >= 1 (steps per measurement), got {window_size}.")
        self.window_size, self.peak_tflops = window_size, peak_tflops
        self._throughput: Optional[Throughput] = None

    def on_train_start(self, trainer, pl_module) -> None:
        strategy = trainer.strategy
        peak = self.peak_tflops * 1e12 if self.peak_tflops else peak_flops(strategy.root_device, strategy.dtype)
        # All GPUs count as one "device" for Throughput: we pass global tokens and FLOPs, and
        # the available FLOPs of the whole job; per-GPU rates are divided out when logging.
        # Its window of 2 updates spans one of ours: an update at each synchronised window end.
        self._throughput = Throughput(
            available_flops=peak * trainer.world_size if peak else None, world_size=1, window_size=2,
        )
        self._steps, self._tokens, self._flops = 0, 0, 0
        self._sync(strategy)
        self._started = time.perf_counter()
        self._throughput.update(time=0.0, batches=0, samples=0, lengths=0, flops=0)

    @staticmethod
    def _sync(strategy) -> None:
        if strategy.root_device.type == "cuda":
            torch.cuda.synchronize(strategy.root_device)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        tokens = batch.get("tokens") if isinstance(batch, dict) else None
        if not torch.is_tensor(tokens):
            return  # not token rows (GRPO's prompts: it logs its own rollout and step times)
        strategy = trainer.strategy
        seq = tokens.shape[1]
        rows = strategy.batch.global_batch_size
        self._steps += 1
        self._tokens += rows * seq
        frozen_base = getattr(pl_module, "lora", None) is not None
        self._flops += rows * seq * training_flops_per_token(pl_module.model_config, seq, frozen_base)
        if self._steps % self.window_size:
            return
        self._sync(strategy)
        self._throughput.update(
            time=time.perf_counter() - self._started, batches=self._steps,
            samples=self._steps * rows, lengths=self._tokens, flops=self._flops,
        )
        self._flops = 0
        metrics = self._throughput.compute()
        world = trainer.world_size
        logs = {"perf/tokens_per_sec_per_gpu": metrics["device/items_per_sec"] / world}
        if "device/flops_per_sec" in metrics:
            logs["perf/tflops_per_gpu"] = metrics["device/flops_per_sec"] / world / 1e12
        if "device/mfu" in metrics:
            logs["perf/mfu"] = 100.0 * metrics["device/mfu"]
        logs = {k: torch.tensor(v) for k, v in logs.items()}  # CPU: nothing to copy to the GPU
        pl_module.log_dict(logs, batch_size=1)
        shown = "perf/mfu" if "perf/mfu" in logs else "perf/tokens_per_sec_per_gpu"
        pl_module.log(shown.removeprefix("perf/"), logs[shown], prog_bar=True, logger=False, batch_size=1)
