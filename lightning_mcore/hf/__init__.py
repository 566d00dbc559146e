"""Hugging Face checkpoints: config translation and weight mapping."""
