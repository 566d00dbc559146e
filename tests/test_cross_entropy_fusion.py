"""Transformer Engine's fused cross entropy is used only where it keeps its gradient in float32
(TE 2.18 on, TransformerEngine #3193); before, mcore's own fusion. On GPU:
tests/test_gpu_cross_entropy.py."""

import importlib.metadata

import pytest

from lightning_mcore.model.config import te_cross_entropy_in_fp32


def pretend_installed(monkeypatch, **versions: str) -> None:
    """Package metadata that knows of TE's distributions `versions` (name: version) and no other."""
    real = importlib.metadata.version

    def version(name):
        if not name.startswith("transformer_engine"):
            return real(name)
        if name not in versions:
            raise importlib.metadata.PackageNotFoundError(name)
        return versions[name]

    monkeypatch.setattr(importlib.metadata, "version", version)


@pytest.mark.parametrize("installed,fp32", [("2.17.1", False), ("2.18.0.dev0", False), ("2.18.0", True),
                                            ("2.20.2", True), (None, False)])
def test_te_fusion_only_from_2_18(monkeypatch, installed, fp32):
    both = {} if installed is None else dict(transformer_engine=installed, transformer_engine_torch=installed)
    pretend_installed(monkeypatch, **both)
    assert te_cross_entropy_in_fp32() is fp32


def test_te_version_from_its_torch_part(monkeypatch):
    """Installed as its torch extension's distribution only (no `transformer_engine` one)."""
    pretend_installed(monkeypatch, transformer_engine_torch="2.20.2")
    assert te_cross_entropy_in_fp32()
