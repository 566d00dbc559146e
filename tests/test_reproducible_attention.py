"""generation/reproducible_attention.py on CPU: the switch sets TE's backend variable and its
reselection flag inside the block and restores both after (a stand-in for TE's backend cache
module); it does nothing unless asked, or on CPU."""

import os
import sys
import types

import pytest
import torch

from lightning_mcore.generation import reproducible_attention

TE_MODULE = "transformer_engine.pytorch.attention.dot_product_attention.dot_product_attention"


@pytest.fixture
def te_cache(monkeypatch):
    cache = {"backend_selection_requires_update": False}
    names = TE_MODULE.split(".")
    for i in range(1, len(names) + 1):  # a stand-in package chain ending in TE's module
        module = types.ModuleType(".".join(names[:i]))
        if i > 1:
            setattr(sys.modules[".".join(names[:i - 1])], names[i - 1], module)
        monkeypatch.setitem(sys.modules, module.__name__, module)
    sys.modules[TE_MODULE]._attention_backends = cache
    return cache


@pytest.mark.parametrize("user_value", [None, "1"])
def test_unfused_inside_restored_after(te_cache, monkeypatch, user_value):
    monkeypatch.delenv("NVTE_FLASH_ATTN", raising=False)
    if user_value is None:
        monkeypatch.delenv("NVTE_FUSED_ATTN", raising=False)
    else:
        monkeypatch.setenv("NVTE_FUSED_ATTN", user_value)
    with reproducible_attention.unfused_attention():
        assert os.environ["NVTE_FUSED_ATTN"] == os.environ["NVTE_FLASH_ATTN"] == "0"
        assert te_cache["backend_selection_requires_update"] is True
        te_cache["backend_selection_requires_update"] = False  # TE selected inside
    assert os.environ.get("NVTE_FUSED_ATTN") == user_value and "NVTE_FLASH_ATTN" not in os.environ
    assert te_cache["backend_selection_requires_update"] is True  # the next call selects again


def test_off_changes_nothing(te_cache, monkeypatch):
    monkeypatch.delenv("NVTE_FUSED_ATTN", raising=False)
    with reproducible_attention.unfused_attention(False):
        assert "NVTE_FUSED_ATTN" not in os.environ
    assert te_cache["backend_selection_requires_update"] is False


def test_wanted_only_on_gpu_with_deterministic_algorithms():
    before = torch.are_deterministic_algorithms_enabled()
    try:
        torch.use_deterministic_algorithms(True)
        assert reproducible_attention.wanted(torch.device("cuda", 0))
        assert not reproducible_attention.wanted(torch.device("cpu"))
        torch.use_deterministic_algorithms(False)
        assert not reproducible_attention.wanted(torch.device("cuda", 0))
    finally:
        torch.use_deterministic_algorithms(before)
