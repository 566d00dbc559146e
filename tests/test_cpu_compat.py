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
