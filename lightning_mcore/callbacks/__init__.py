"""Callbacks: HF export during training; throughput and MFU; what the console shows, the
memory plan beside the measured peak included."""

from lightning_mcore.callbacks.console import MegatronModelSummary, MegatronProgressBar
from lightning_mcore.callbacks.hf_export import HFExport
from lightning_mcore.callbacks.memory_plan import MemoryPlanReport
from lightning_mcore.callbacks.throughput import MegatronThroughput

__all__ = ["HFExport", "MegatronModelSummary", "MegatronProgressBar", "MegatronThroughput", "MemoryPlanReport"]
