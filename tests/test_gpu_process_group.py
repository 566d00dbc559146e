"""On GPU the strategy starts torch.distributed without binding it to the device
(MegatronStrategy.setup_distributed): bound, every process group mcore creates opens its NCCL
communicator at once, 6.1 GiB of one H100 outside PyTorch's allocator (benchmarks/RESULTS.md,
session 10). Lightning's DDPStrategy binds it. Skipped without CUDA."""

import json

import lightning as L
import pytest
import torch
import torch.distributed as dist
from toy import fit, tiny_config

pytestmark = [pytest.mark.gpu]


class ProcessGroupFacts(L.Callback):
    def __init__(self, out):
        self.out = out

    def on_train_batch_end(self, trainer, *args):
        free, total = torch.cuda.mem_get_info()
        self.out.write_text(json.dumps({
            "bound": str(dist.group.WORLD.bound_device_id),
            "outside_allocator_gib": (total - free - torch.cuda.memory_reserved()) / 2**30}))


def test_gpu_fit_leaves_the_process_group_unbound(tmp_path):
    out = tmp_path / "facts.json"
    losses = fit(tmp_path, steps=2, config=tiny_config(transformer_impl="transformer_engine"),
                 callbacks=[ProcessGroupFacts(out)], accelerator="gpu", precision="bf16-mixed",
                 start_method="popen")
    facts = json.loads(out.read_text())
    print(facts)
    assert len(losses) == 2
    assert facts["bound"] == "None", facts


def test_torch_advice_to_bind_the_group_is_silenced(tmp_path):
    """An unbound NCCL group makes torch advise `device_id` at the first barrier; quiet.py silences
    that advice (the unbinding is deliberate, above), and the barrier runs on the current device."""
    from test_quickstart import warned

    torch.cuda.set_device(0)
    dist.init_process_group("nccl", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        advice = warned(dist.barrier, silenced=False)
        assert any(a.startswith("barrier(): using the device under current context") for a in advice), advice
        assert warned(dist.barrier, silenced=True) == []
    finally:
        dist.destroy_process_group()
