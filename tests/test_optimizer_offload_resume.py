"""What resuming with optimizer cpu_offload needs from us, checked without a GPU (the whole run:
test_gpu_sft_checkpoint.py::test_optimizer_offload_resumes_exactly).

mcore's HybridDeviceOptimizer (i) keeps its CPU and GPU optimizer classes in every param group,
which mcore saves with the optimizer state and reads back with weights_only=True; (ii) before
loading, steps its Adam once on random gradients and copies the result into the weights."""

import contextlib
import io

import torch

from lightning_mcore.strategy import checkpoint_io
from lightning_mcore.strategy.optimizer import MegatronOptimizer


class HybridLike:
    """The parts of an mcore DistributedOptimizer around a HybridDeviceOptimizer that saving
    and resuming touch: its sharded state dict's plain part, its param groups and loading."""

    def __init__(self) -> None:
        self.param_groups = [{"lr": 1e-3, "betas": (0.9, 0.95), "wd_mult": 1.0, "offload_fraction": 1.0,
                              "cpu_optimizer_cls": torch.optim.AdamW, "gpu_optimizer_cls": torch.optim.Adam}]
        self.lr_while_loading = []

    def sharded_state_dict(self, model_state, is_loading=False, metadata=None):
        groups = [{k: v for k, v in g.items()} for g in self.param_groups]  # torch's state_dict copies
        return {"optimizer": {"param_groups": groups}, "param_state_sharding_type": "fully_reshardable"}

    def load(self) -> None:
        self.lr_while_loading.append([g["lr"] for g in self.param_groups])
        torch.randn(4)  # the random gradients of mcore's allocating step


def test_saved_optimizer_state_loads_with_weights_only():
    state = checkpoint_io.optimizer_sharded_state_dict(HybridLike(), {}, is_loading=False)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)  # as mcore reads a checkpoint's plain part
    assert loaded["optimizer"]["param_groups"] == [
        {"lr": 1e-3, "betas": (0.9, 0.95), "wd_mult": 1.0, "offload_fraction": 1.0}]
    assert loaded["param_state_sharding_type"] == "fully_reshardable"


def test_loading_state_dict_is_mcore_own():
    optimizer = HybridLike()
    template = checkpoint_io.optimizer_sharded_state_dict(optimizer, {}, is_loading=True)
    assert template["optimizer"]["param_groups"][0]["cpu_optimizer_cls"] is torch.optim.AdamW


def test_resume_loads_at_lr_zero_and_keeps_the_restored_rng():
    inner = HybridLike()
    optimizer = MegatronOptimizer(inner, scheduler=None, zero_grad_buffers=lambda: None,
                                  compat=contextlib.nullcontext)
    torch.manual_seed(5)
    restored = torch.get_rng_state()  # what the checkpoint's RNG state set
    optimizer.resume(inner.load, schedule=None)
    assert inner.lr_while_loading == [[0.0]]  # mcore's allocating step moves nothing
    assert [g["lr"] for g in inner.param_groups] == [1e-3]  # this run's settings again
    assert inner.param_groups[0]["cpu_optimizer_cls"] is torch.optim.AdamW
    assert torch.equal(torch.get_rng_state(), restored)
