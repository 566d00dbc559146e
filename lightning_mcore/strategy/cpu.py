"""megatron-core on CPU (gloo): the one place that handles mcore's CUDA assumptions.

Applied by MegatronStrategy only when the accelerator is CPU; nothing here runs on GPU.
What mcore (0.16.1) assumes, and what we do about it:

1. `torch.cuda.current_device()` as `device=` (rope, buffers, p2p shapes): answer the CPU
   device, for as long as the strategy is set up.
2. `torch.cuda.synchronize()` (p2p, DDP): a no-op.
3. Tensors made with a hard-coded `device="cuda"` (schedules' token counter, grad-norm and
   clip-grad scalars) and `.cuda()` calls: moved to CPU by a torch function mode that the
   strategy enters around each mcore call it makes (`cuda_on_cpu()`).
4. Optimizers check `param.type() == 'torch.cuda.FloatTensor'`: the mode answers the CUDA
   type name for CPU tensors, so the fp32 paths are taken.
5. The RNG tracker keeps CUDA generator states: the strategy seeds mcore's CPU-safe
   inference tracker (dropout then draws from the default generator).
Torch function modes are not active inside autograd's backward; none of the above is needed
there (checked by tests/test_cpu_compat.py).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch.overrides import TorchFunctionMode

_CPU = torch.device("cpu")


def _is_cuda(device) -> bool:
    if device is None:
        return False
    if isinstance(device, int):
        return True  # a bare index means a CUDA device in torch's API
    return torch.device(device).type == "cuda"


class _CudaOnCpu(TorchFunctionMode):
    """Rewrites CUDA device requests to CPU for code written for CUDA only."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _is_cuda(kwargs.get("device")):
            kwargs = {**kwargs, "device": _CPU}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.to and args and len(args) > 1 and _is_cuda_arg(args[1]):
            args = (args[0], _CPU, *args[2:])
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if args[0].device.type == "cpu" else name
        return func(*args, **kwargs)


def _is_cuda_arg(x) -> bool:
    return isinstance(x, (str, torch.device)) and _is_cuda(x)


@contextlib.contextmanager
def cuda_on_cpu() -> Iterator[None]:
    """Context for mcore calls on CPU: hard-coded CUDA tensors land on CPU."""
    with _CudaOnCpu():
        yield


class CpuCompat:
    """Installs and removes the process-wide part (torch.cuda functions) around a run."""

    def __init__(self) -> None:
        self._saved: dict[str, object] = {}

    def install(self) -> None:
        if self._saved:
            return
        replacements = {
            "current_device": lambda: _CPU,
            "synchronize": lambda *a, **k: None,
        }
        for name, fn in replacements.items():
            self._saved[name] = getattr(torch.cuda, name)
            setattr(torch.cuda, name, fn)

    def uninstall(self) -> None:
        for name, fn in self._saved.items():
            setattr(torch.cuda, name, fn)
        self._saved.clear()
