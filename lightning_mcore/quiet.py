"""The warnings and notices known to say nothing to a user of this library, silenced in one place.

Each entry is an exact message (a regular expression matched from its start), the category and
the module that raises it (for a log line: the logger), and why it is harmless here; any other
warning still shows. `install` runs when `lightning_mcore` is imported, before megatron.core
(whose import warns) and again in every worker process, since each one imports the package.
"""

from __future__ import annotations

import logging
import os
import re
import warnings
from dataclasses import dataclass
from typing import Callable

import torch
from lightning.fabric.utilities.warnings import PossibleUserWarning

from lightning_mcore.model.te import te_cross_entropy_in_fp32


@dataclass(frozen=True)
class Harmless:
    message: str  # regex, matched from the start of the message
    category: type
    module: str  # regex, matched from the start of the raising module's name
    why: str
    cpu_only: bool = False  # on a machine with a GPU the warning means something: keep it
    only_if: Callable[[], bool] = lambda: True  # asked once, at install


HARMLESS = (
    Harmless(r"Apex is not installed\. Falling back to Torch Norm", UserWarning, r"megatron\.core\.",
             "we never use Apex's norm: Transformer Engine's on GPU, torch's otherwise"),
    Harmless(r"Transformer Engine and Apex are not installed\. Falling back to ", UserWarning,
             r"megatron\.core\.",
             "on CPU torch's optimizers and multi-tensor ops are the ones to use", cpu_only=True),
    Harmless(r"full scope is deprecated\. Use empty cuda_graph_modules", UserWarning,
             r"megatron\.core\.transformer\.transformer_config",
             "mcore's TransformerConfig warns about its own default (cuda_graph_modules='full')"),
    Harmless(r"MimoModelConfig is experimental", UserWarning, r"megatron\.core\.models\.mimo",
             "mcore 0.19 imports its multimodal model's config as it starts; we do not use it"),
    Harmless(r"When using (async grad allreduce|sequence parallelism) it is recommended to set the "
             r"environment variable CUDA_DEVICE_MAX_CONNECTIONS", UserWarning,
             r"megatron\.core\.tensor_parallel\.layers",
             "a CUDA stream setting: nothing to set on CPU", cpu_only=True),
    Harmless(r"`isinstance\(treespec, LeafSpec\)` is deprecated", FutureWarning,
             r"lightning\.pytorch\.utilities\._pytree",
             "Lightning's own use of a torch API that newer torch deprecates"),
    Harmless(r"It is recommended to use `self\.log\('val/[^']*', \.\.\., sync_dist=True\)`",
             PossibleUserWarning, r"lightning\.pytorch\.trainer\.connectors\.logger_connector",
             "the strategy reduces val/ metrics over data-parallel ranks before they are logged"),
    Harmless(r"The '\w+' does not have many workers which may be a bottleneck", PossibleUserWarning,
             r"lightning\.pytorch\.trainer\.connectors\.data_connector",
             "our data modules hold tokenized rows in memory (or memory-mapped), which the main "
             "process batches without help; Lightning says this on any machine with 3 or more CPUs "
             "per device. A data module's num_workers still starts workers"),
    Harmless(r"Total length of `list` across ranks is zero", UserWarning,
             r"lightning\.pytorch\.utilities\.data",
             "our data modules' val_dataloader returns [] for no validation split (val_split: 0)"),
    Harmless(r"`torch\.distributed\.(reduce_scatter_tensor|all_gather_into_tensor)` is deprecated",
             FutureWarning, r"torch\.distributed\.",
             "mcore's sequence-parallel collectives use torch APIs that newer torch deprecates"),
    Harmless(r"`load_state_dict` is deprecated and will be removed in future versions\. Please use "
             r"`load` instead", FutureWarning, r"megatron\.core\.dist_checkpointing\.",
             "mcore's checkpoint loading uses a torch API that newer torch deprecates"),
    Harmless(r"Detected a Jax installation but could not find the shared object file for the "
             r"Transformer Engine Jax extension", RuntimeWarning, r"transformer_engine\b",
             "TE's JAX bindings, on a machine that has JAX: we use TE's PyTorch side only"),
    Harmless(r"invalid escape sequence", SyntaxWarning, r".*megatron[./]core[./]",
             "a docstring in mcore's source, reported when Python compiles it (no .pyc cached); "
             "the module is then the file's path"),
    Harmless(r"barrier\(\): using the device under current context", UserWarning, r"torch\.distributed\.",
             "the strategy leaves the process group unbound to the device on purpose (binding holds "
             "NCCL memory for every group at once: strategy/megatron.py); each rank's device is set "
             "before the group starts, so the barrier runs on it"),
    Harmless(r"torch\.distributed is disabled, unavailable or uninitialized, assuming the intent is "
             r"to load in a single process", UserWarning, r"torch\.distributed\.checkpoint\.",
             "mcore 0.19 loads each rank's shards without collectives (no_dist=True) and torch says "
             "so at every load, resume and export; the module is torch's wrapper, not the caller"),
    Harmless(r"The argument order of load has been changed", UserWarning,
             r"torch\.distributed\.checkpoint\.",
             "mcore 0.19 passes torch's checkpoint reader by position, which torch still accepts"),
    Harmless(r"Transformer Engine cross entropy loss fusion has known stability issues",
             UserWarning, r"megatron\.core\.",
             "mcore 0.19 says so of TE before 2.18, whose kernel rounded its gradient to bf16 "
             "(TransformerEngine #3193); we use TE's only from 2.18 (model/config.py)",
             only_if=te_cross_entropy_in_fp32),
    Harmless(r"Using a large number of experts \(e\.g\. >=32\) without fp32 routing", UserWarning,
             r"megatron\.core\.transformer\.transformer_config",
             "we route as transformers' model of the family does: DeepSeek's gates in float32, "
             "Qwen-MoE's in the model's dtype (GPTConfig.moe_router_dtype, which a config may set)"),
    Harmless(r"Please use DTensor instead and we are deprecating ShardedTensor", FutureWarning,
             r"(megatron\.core|lightning_mcore\.strategy\.cpu)\b",
             "mcore's dist_checkpointing builds torch ShardedTensors (seen through our CPU layer)"),
)


NVIDIA_DRIVER = "/proc/driver/nvidia"  # there wherever an NVIDIA GPU driver is loaded


def no_gpu_to_miss() -> bool:
    """No GPU the user could be missing: they hid the GPUs (CUDA_VISIBLE_DEVICES lists none), or
    the machine has no NVIDIA driver at all (a CPU machine with CUDA's toolkit, as our CI's)."""
    hidden = os.environ.get("CUDA_VISIBLE_DEVICES", "unset").strip() in ("", "-1")
    return hidden or not os.path.exists(NVIDIA_DRIVER)


@dataclass(frozen=True)
class HarmlessLine:
    """A log line from others' code (not a Python warning), silenced like a Harmless entry."""

    logger: str  # the logger's exact name
    message: str  # regex, matched from the start of the message with its arguments filled in
    why: str
    only_if: Callable[[], bool] = lambda: True  # asked once, at install


HARMLESS_LINES = tuple(
    HarmlessLine(name, r"💡 Tip:", "Lightning's log lines that advertise other products")
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero")
) + (
    HarmlessLine("lightning.pytorch.utilities.rank_zero",
                 r"The following callbacks returned in `LightningModule\.configure_callbacks` will "
                 r"override existing callbacks passed to Trainer: "
                 r"(?:(?:RichModelSummary|ModelSummary|RichProgressBar|TQDMProgressBar)(?:, |$))+$",
                 "MegatronModule puts our progress bar and model summary in place of Lightning's "
                 "defaults (objectives/console.py); an override of any other callback still shows"),
    HarmlessLine("megatron.core.models.gpt.gpt_model", r"GPTModel IS DEPRECATED\.",
                 "mcore 0.19 asks those who build on it to move to its HybridModel; GPTModel, which "
                 "it still has, is what we build for the user"),
    HarmlessLine("megatron.core.dist_checkpointing.strategies.torch", r"MCore's async save is deprecated",
                 "mcore 0.19 says it at each process's first checkpoint, asynchronous or not: we ask "
                 "for its own writer (strategy/checkpoint_io.py), not nvidia-resiliency-ext's, a "
                 "package we do not depend on"),
    HarmlessLine("torch.multiprocessing.spawn", r"Terminating process \d+ via signal SIGTERM",
                 "torch says it as it stops the other ranks when one has ended (start_method fork or "
                 "spawn): after the rank's `error:` line, or before its traceback, which says more"),
    HarmlessLine("torch.utils.cpp_extension", r"No CUDA runtime is found, using CUDA_HOME=",
                 "torch says it as mcore imports torch's extension builder on a machine with CUDA "
                 "installed; silenced only where the user hid the GPUs, and so knows, or where "
                 "the machine has no GPU driver to miss",
                 only_if=no_gpu_to_miss),
)


class _DropLines(logging.Filter):
    def __init__(self, lines: list[HarmlessLine]) -> None:
        super().__init__()
        self.lines = lines

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        return not any(re.match(line.message, text) for line in self.lines)


def install() -> None:
    """Add the filters (idempotent: warnings.filterwarnings replaces an identical entry, and a
    logger's filter replaces the one an earlier install added)."""
    has_gpu = torch.cuda.device_count() > 0  # NVML-based: does not initialise CUDA (fork-safe)
    for entry in HARMLESS:
        if (entry.cpu_only and has_gpu) or not entry.only_if():
            continue
        warnings.filterwarnings("ignore", message=entry.message, category=entry.category,
                                module=entry.module)
    for name in dict.fromkeys(line.logger for line in HARMLESS_LINES):
        logger = logging.getLogger(name)
        for old in [f for f in logger.filters if isinstance(f, _DropLines)]:
            logger.removeFilter(old)
        lines = [line for line in HARMLESS_LINES if line.logger == name and line.only_if()]
        if lines:
            logger.addFilter(_DropLines(lines))
