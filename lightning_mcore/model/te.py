"""Whether Transformer Engine is installed, and whether its fused cross entropy may be used: asked
without importing megatron.core, so that quiet.py can ask before mcore's import warns."""

from __future__ import annotations

import importlib.metadata

from packaging.version import Version


def te_available() -> bool:
    """Whether Transformer Engine's torch part imports here."""
    try:  # optional dependency (transformer_engine): its import failing is the answer
        import transformer_engine  # noqa: F401
        import transformer_engine.pytorch  # noqa: F401
    except Exception:
        return False
    return True


def te_cross_entropy_in_fp32() -> bool:
    """Whether the installed Transformer Engine's fused cross entropy keeps its gradient in
    float32: from 2.18 (TransformerEngine #3193). Before, it rounded the softmax gradient into the
    bf16 logits, which mcore 0.19 warns of and Megatron-LM refuses; mcore's own fusion is used
    then. Read from the package's metadata, so that quiet.py may ask before TE is imported."""
    for name in ("transformer_engine", "transformer_engine_torch"):  # the wheel, or its torch part
        try:
            return Version(importlib.metadata.version(name)) >= Version("2.18")
        except importlib.metadata.PackageNotFoundError:
            continue
    return False
