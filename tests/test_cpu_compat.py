"""The CPU compatibility layer: what it changes, that it is undone, and that it is scoped."""

import math

import pytest
import torch

from lightning_mcore.strategy.cpu import CpuCompat, cuda_on_cpu


def test_cuda_tensors_land_on_cpu_inside_the_context():
    with cuda_on_cpu():
        made = torch.zeros([], dtype=torch.int, device="cuda")
        moved = torch.ones(3).cuda()
        to = torch.ones(2).to("cuda")
        assert made.device.type == moved.device.type == to.device.type == "cpu"
        assert torch.ones(2).type() == "torch.cuda.FloatTensor"  # mcore's fp32 parameter check
    with pytest.raises((RuntimeError, AssertionError)):
        torch.zeros(1, device="cuda")  # outside the context nothing is rewritten


def test_install_patches_and_uninstall_restores_torch_cuda():
    before = (torch.cuda.current_device, torch.cuda.synchronize, torch.cuda.current_stream)
    compat = CpuCompat()
    compat.install()
    try:
        assert torch.cuda.current_device() == torch.device("cpu")
        assert torch.cuda.synchronize() is None
        stream = torch.cuda.current_stream()  # mcore 0.19 DDP: waits and records are no-ops
        assert stream.wait_stream(stream) is None and stream.query()
        assert torch.empty(1, device=torch.cuda.current_device()).device.type == "cpu"
    finally:
        compat.uninstall()
    assert (torch.cuda.current_device, torch.cuda.synchronize, torch.cuda.current_stream) == before


def test_backward_inside_the_context_still_computes_gradients():
    x = torch.arange(4.0, requires_grad=True)
    with cuda_on_cpu():
        (x.sin() * 2).sum().backward()
    torch.testing.assert_close(x.grad, 2 * torch.cos(torch.arange(4.0)))


def test_lr_schedule_matches_hand_computation():
    from lightning_mcore.strategy.optimizer import OptimizerSettings, build_lr_scheduler

    class FakeOptimizer:
        param_groups = [{"lr": 0.0, "weight_decay": 0.0}]

    settings = OptimizerSettings(lr=1e-3, min_lr=1e-4, warmup_steps=4, decay_style="cosine")
    sched = build_lr_scheduler(FakeOptimizer(), settings, max_steps=20)
    seen = []
    for _ in range(20):
        seen.append(FakeOptimizer.param_groups[0]["lr"])
        sched.step(increment=1)
    for step, lr in enumerate(seen):
        if step < 4:
            want = 1e-3 * step / 4
        else:
            ratio = (step - 4) / (20 - 4)
            want = 1e-4 + (1e-3 - 1e-4) * 0.5 * (math.cos(math.pi * ratio) + 1)
        assert lr == pytest.approx(want, rel=1e-9, abs=1e-12), step


def _cuda_kernel(*args, **kwargs):
    """Stands in for Transformer Engine's fused optimizers and multi-tensor kernels, as mcore
    imports them where TE is installed: CUDA only, so any use on CPU fails."""
    raise AssertionError("a Transformer Engine CUDA kernel was picked on CPU")


@pytest.mark.distributed
@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_cpu_runs_torch_kernels_where_transformer_engine_is_installed(optimizer, monkeypatch, tmp_path):
    """mcore 0.19 picks TE's FusedAdam/FusedSGD and multi-tensor kernels whenever TE imports (a GPU
    machine running CPU work). Here mcore's optimizer modules are set as TE would set them, with
    kernels that fail on use: a CPU run (forked rank, which inherits them) still trains, as
    exactly as where TE is absent (torch's optimizers, mcore's local kernels; clipping active)."""
    import megatron.core.optimizer as package
    from megatron.core.optimizer import clip_grads, distrib_optimizer
    from megatron.core.optimizer import optimizer as module

    from lightning_mcore import OptimizerSettings
    from toy import fit

    settings = OptimizerSettings(lr=1e-2, warmup_steps=0, optimizer=optimizer, clip_grad=0.1)
    plain = fit(tmp_path, steps=3, optim=settings, name="plain")
    monkeypatch.setattr(package, "USING_PYTORCH_OPTIMIZER", False)
    monkeypatch.setattr(package, "Adam", _cuda_kernel)
    monkeypatch.setattr(package, "SGD", _cuda_kernel)
    monkeypatch.setattr(distrib_optimizer, "HAVE_APEX_OR_TE", True)
    for owner in (clip_grads, module):
        monkeypatch.setattr(owner, "multi_tensor_applier", _cuda_kernel)
        monkeypatch.setattr(owner, "multi_tensor_scale_impl", _cuda_kernel)
    monkeypatch.setattr(clip_grads, "l2_norm_impl", _cuda_kernel)
    monkeypatch.setattr(clip_grads, "multi_tensor_scale_tensor_impl", _cuda_kernel)
    with_te = fit(tmp_path, steps=3, optim=settings, name="with_te")
    assert len(plain) == 3 and plain[0] != plain[1] != plain[2]  # the updates changed the weights
    assert with_te == plain
