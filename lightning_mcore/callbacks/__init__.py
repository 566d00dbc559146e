"""Callbacks: HF export during training; throughput and MFU."""

from lightning_mcore.callbacks.hf_export import HFExport
from lightning_mcore.callbacks.throughput import MegatronThroughput

__all__ = ["HFExport", "MegatronThroughput"]
