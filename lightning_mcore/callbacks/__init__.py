"""Callbacks: HF export during training."""

from lightning_mcore.callbacks.hf_export import HFExport

__all__ = ["HFExport"]
