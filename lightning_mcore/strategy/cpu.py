"""megatron-core on CPU (gloo): the one place that handles mcore's CUDA assumptions.

Applied by MegatronStrategy only when the accelerator is CPU; nothing here runs on GPU.
What mcore assumes, and what we do about it:

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
MoE (local spec, SequentialMLP experts), patched in mcore's modules while installed:
6. The alltoall dispatcher copies split sizes device-to-host on a CUDA side stream
   (`torch.cuda.Stream()` at construction, `torch.cuda.stream`/events per step) and turns them
   into numpy only for CUDA tensors: a CPU step does the numpy conversion without streams.
7. The router's gating GEMM uses `te_general_gemm`, a CUDA kernel when Transformer Engine
   imports: None on CPU, so the torch.mm path runs.
8. Uneven all-gathers (tokens per rank, alltoall dispatcher with TP) use `dist.all_gather`
   with unequal sizes, which gloo refuses: pad to the longest, gather, trim.
9. mcore's DDP orders its gradient reduction after `torch.cuda.current_stream()`: a
   stream whose waits and records do nothing (CPU work is in program order).
10. With Transformer Engine installed (a GPU machine running CPU work), mcore picks TE's fused
   (CUDA) Adam and SGD and TE's multi-tensor kernels for the grad norm, clipping and main-param
   copies: on CPU, torch's Adam and SGD and mcore's own local implementations, as when neither
   TE nor Apex is installed.
11. Threads: a rank on CPU runs small models whose ops are too short to share among many
   threads. Unless the user sets OMP_NUM_THREADS, each of n > 1 local ranks gets min(4, cpus // n)
   (Lightning's default is cpus // n: on 16 cores the quickstart at TP=2 ran 6.9 it/s with 8
   threads per rank, 13.8 with 4, 11.1 with 1; benchmarks/RESULTS.md, session 20).
Torch function modes are not active inside autograd's backward; none of the above is needed
there (checked by tests/test_cpu_compat.py).
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator

import megatron.core.optimizer as package
import torch
from megatron.core import utils
from megatron.core.optimizer import clip_grads, distrib_optimizer, optimizer
from megatron.core.tensor_parallel import mappings
from megatron.core.transformer.moe import moe_utils, token_dispatcher
from torch.overrides import TorchFunctionMode

_CPU = torch.device("cpu")
MAX_THREADS_PER_RANK = 4  # (11)


def choose_rank_threads(local_ranks: int) -> None:
    """(11) In the launching process, before any rank starts: OMP_NUM_THREADS for ranks that
    start later to inherit (Lightning's launchers then set none of their own). A user's value
    stays; a single process keeps torch's default (on 16 cores: 16.3 it/s with 16 threads,
    17.9 with 4, the same within this measurement's noise)."""
    if local_ranks > 1 and "OMP_NUM_THREADS" not in os.environ:
        cpus = len(os.sched_getaffinity(0))
        os.environ["OMP_NUM_THREADS"] = str(max(1, min(MAX_THREADS_PER_RANK, cpus // local_ranks)))


def use_rank_threads() -> None:
    """(11) In a rank: torch's CPU thread pool at OMP_NUM_THREADS. The launching process, which
    becomes rank 0 under the CLI, sized its pool when torch was imported, before the value was
    chosen; a forked rank gets its pool rebuilt on this thread (strategy/forked.py)."""
    value = os.environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    if value.isdigit() and int(value) > 0:
        torch.set_num_threads(int(value))


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


def _moe_dtoh_on_cpu(self, point, tokens_per_expert=None):
    """MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize without CUDA streams (6)."""
    if not self.drop_and_pad and point == self.cuda_dtoh_point:
        for name in ("input_splits", "output_splits", "output_splits_tp"):
            value = getattr(self, name, None)
            if torch.is_tensor(value):  # gloo's all_to_all_single takes lists/arrays, not tensors
                setattr(self, name, value.numpy())
    return tokens_per_expert


def _padded_uneven_gather(original):
    """mappings._gather_along_first_dim for gloo: unequal pieces padded to the longest (8)."""

    def gather(input_, group, output_split_sizes=None, *args, **kwargs):
        if output_split_sizes is None or group is None or group.size() == 1:
            return original(input_, group, output_split_sizes, *args, **kwargs)
        sizes = [int(n) for n in output_split_sizes]
        padded = input_.new_zeros((max(sizes), *input_.shape[1:]))
        padded[: input_.shape[0]] = input_
        pieces = [torch.empty_like(padded) for _ in sizes]
        torch.distributed.all_gather(pieces, padded, group=group)
        return torch.cat([piece[:n] for piece, n in zip(pieces, sizes)])

    return gather


_ABSENT = object()


class _NoStream:
    """Stands in for a CUDA stream on CPU: every wait, record and sync is a no-op."""

    def wait_stream(self, *_):
        pass

    def wait_event(self, *_):
        pass

    def record_event(self, *_):
        pass

    def synchronize(self):
        pass

    def query(self) -> bool:
        return True


_NO_STREAM = _NoStream()


class CpuCompat:
    """Installs and removes the process-wide part (torch.cuda functions, mcore MoE helpers)."""

    def __init__(self) -> None:
        self._saved: list[tuple[object, str, object]] = []

    def _replace(self, owner, name: str, value) -> None:
        self._saved.append((owner, name, vars(owner).get(name, _ABSENT)))
        setattr(owner, name, value)

    def install(self) -> None:
        if self._saved:
            return
        # (1) mcore passes torch.cuda.current_device() as device=
        self._replace(torch.cuda, "current_device", lambda: _CPU)
        # (2) mcore calls torch.cuda.synchronize() in p2p and DDP
        self._replace(torch.cuda, "synchronize", lambda *a, **k: None)
        # (9) mcore's DDP asks for the current stream before reducing gradients
        self._replace(torch.cuda, "current_stream", lambda *a, **k: _NO_STREAM)
        self._install_moe()
        self._install_multi_tensor()

    def _install_multi_tensor(self) -> None:
        # (10)
        self._replace(package, "USING_PYTORCH_OPTIMIZER", True)
        self._replace(package, "SGD", torch.optim.SGD)  # Adam follows the flag; SGD is the name
        self._replace(distrib_optimizer, "HAVE_APEX_OR_TE", False)
        for module in (clip_grads, optimizer):
            self._replace(module, "multi_tensor_applier", utils.local_multi_tensor_applier)
            self._replace(module, "multi_tensor_scale_impl", utils.local_multi_tensor_scale)
        self._replace(clip_grads, "l2_norm_impl", utils.local_multi_tensor_l2_norm)
        self._replace(clip_grads, "multi_tensor_scale_tensor_impl", None)

    def _install_moe(self) -> None:
        dispatcher = token_dispatcher.MoEAlltoAllTokenDispatcher
        # (6) the alltoall dispatcher copies split sizes to host on a torch.cuda.Stream, made
        # at construction unless the class already holds one
        if dispatcher.cuda_dtoh_stream is None:
            self._replace(dispatcher, "cuda_dtoh_stream", "no CUDA stream on CPU")
        self._replace(dispatcher, "_maybe_dtoh_and_synchronize", _moe_dtoh_on_cpu)
        # (7) the router GEMM reads te_general_gemm: a CUDA kernel with TE
        self._replace(moe_utils, "te_general_gemm", None)
        # (8) uneven all-gathers use dist.all_gather with unequal sizes (NCCL only, not gloo)
        gather = _padded_uneven_gather(mappings._gather_along_first_dim)
        self._replace(mappings, "_gather_along_first_dim", gather)

    def uninstall(self) -> None:
        for owner, name, value in reversed(self._saved):
            if value is _ABSENT:
                delattr(owner, name)
            else:
                setattr(owner, name, value)
        self._saved.clear()
