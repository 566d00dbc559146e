"""The strategy starts torch.distributed unbound even on a GPU (MegatronStrategy.setup_distributed):
Lightning's DDPStrategy passes `device_id`, and a bound group opens the NCCL communicator of every
group mcore creates at once (6.1 GiB of one H100 in benchmarks/RESULTS.md, session 10;
tests/test_gpu_process_group.py checks a real GPU fit). Here the start is recorded, not run."""

import lightning.fabric.utilities.distributed as fabric_distributed
import torch
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.pytorch.strategies import DDPStrategy

from lightning_mcore import MegatronStrategy


def started_with(strategy, monkeypatch) -> dict:
    calls = []

    def record(env, backend, **kwargs):
        calls.append(dict(backend=backend, **kwargs))

    # Lightning's ddp module holds its own name for the function; ours imports it when it starts
    monkeypatch.setattr(fabric_distributed, "_init_dist_connection", record)
    monkeypatch.setattr("lightning.pytorch.strategies.ddp._init_dist_connection", record)
    strategy.parallel_devices = [torch.device("cuda", 0)]  # what a one-GPU trainer hands it
    strategy.cluster_environment = LightningEnvironment()
    strategy._process_group_backend = "nccl"
    strategy.setup_distributed()
    (call,) = calls
    return call


def test_gpu_start_is_not_bound_to_the_device(monkeypatch):
    lightning_start = started_with(DDPStrategy(), monkeypatch)  # the reference: Lightning binds
    assert lightning_start["device_id"] == torch.device("cuda", 0)
    ours = started_with(MegatronStrategy(global_batch_size=8, micro_batch_size=2), monkeypatch)
    assert ours.get("device_id") is None and ours["backend"] == "nccl"
    assert ours["timeout"] == lightning_start["timeout"]
