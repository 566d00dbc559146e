"""offload_reference (issue 22): a frozen DPO/GRPO reference kept in CPU memory, on the device only
for its forward pass (objectives/offload.py). Here on CPU: the weights round-trip bitwise in the same
Parameter objects; each block works on fresh copies and leaves the CPU copy as it was; DPO and
GRPO runs take their reference passes on those copies and give the losses of runs without
offload; what has nothing to offload, or no GPU to save, is refused. On CPU the losses would be
equal without offload too: what can fail there is where the passes ran.
tests/test_gpu_reference_offload.py runs the same DPO comparison on a GPU (run_dpo below)."""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_mcore import MegatronStrategy, OptimizerSettings
from lightning_mcore.lora.config import LoRAConfig
from lightning_mcore.objectives.dpo import DPOModule
from lightning_mcore.objectives.grpo import GRPOModule
from lightning_mcore.objectives.offload import OffloadedWeights, on_device
from lightning_mcore.strategy.memory import MemoryOptionError, validate_reference_offload
from test_bad_inputs import DPO_DATA, refused, write_config
from test_dpo import SEQ, pairs
from toy import tiny_config


class Tied(torch.nn.Module):
    """An embedding whose weight the output layer shares, a norm with buffers."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = torch.nn.Embedding(11, 6)
        self.norm = torch.nn.BatchNorm1d(6)
        self.output = torch.nn.Linear(6, 11, bias=False)
        self.output.weight = self.embedding.weight

    def forward(self, ids):
        return self.output(self.norm(self.embedding(ids)))


def tensors(chunks) -> list[torch.Tensor]:
    return [t for c in chunks for t in (*c.parameters(), *c.buffers())]


def test_weights_round_trip_bitwise_in_the_same_objects():
    torch.manual_seed(0)
    chunks = [Tied().eval(), torch.nn.Linear(6, 11, bias=False)]
    chunks[1].weight = chunks[0].embedding.weight  # tied across chunks too
    with torch.no_grad():
        chunks[0].norm.running_mean.normal_()  # buffers that are not their defaults
        chunks[0].norm.running_var.uniform_(0.5, 2.0)
    before = tensors(chunks)
    values = [t.detach().clone() for t in before]
    ids = torch.tensor([1, 4, 9])
    want = chunks[0](ids)
    weights = OffloadedWeights(chunks)

    held = [t.data_ptr() for t in before]
    assert weights.nbytes == sum(v.numel() * v.element_size() for v in values) - 11 * 6 * 4  # tied: once
    assert all(t.device.type == "cpu" and t.is_pinned() == torch.cuda.is_available() for t in before)
    with weights.on("cpu"):
        inside = tensors(chunks)
        assert [id(t) for t in inside] == [id(t) for t in before]
        assert all(t.device == torch.device("cpu") for t in inside)
        assert not set(t.data_ptr() for t in inside) & set(held), "the block must work on copies"
        assert chunks[0].output.weight is chunks[0].embedding.weight
        assert torch.equal(chunks[0](ids), want)
        chunks[0].norm.running_mean.add_(1.0)  # frozen weights only: a write here is dropped
    after = tensors(chunks)
    assert [id(t) for t in after] == [id(t) for t in before]
    assert [t.data_ptr() for t in after] == held, "the CPU copy is made once and kept"
    for t, v in zip(after, values):
        assert t.dtype == v.dtype and torch.equal(t, v)


def test_block_leaves_the_device_copies_on_error():
    layer = torch.nn.Linear(4, 4)
    weights = OffloadedWeights([layer])
    held = layer.weight.data_ptr()
    with pytest.raises(RuntimeError, match="boom"):
        with weights.on(torch.device("cpu")):
            assert layer.weight.data_ptr() != held
            raise RuntimeError("boom")
    assert layer.weight.data_ptr() == held
    with on_device(None, "cpu"):  # weights that are not offloaded: nothing moves
        assert layer.weight.data_ptr() == held


# ------------------------------------------------------------------ refusals
def test_modules_refuse_offload_without_a_copy():
    config = tiny_config(seq_length=SEQ)
    lora = LoRAConfig(rank=4, alpha=8.0)
    with pytest.raises(ValueError, match="offload_reference=True has nothing to offload with lora: the "
                                         "reference is the policy's own base weights"):
        DPOModule(config, lora=lora, offload_reference=True)
    with pytest.raises(ValueError, match="offload_reference=True has nothing to offload: beta=0 keeps no "
                                         "reference model"):
        GRPOModule(config, num_generations=2, max_completion_length=8, offload_reference=True)
    with pytest.raises(ValueError, match="offload_reference=True has nothing to offload: with lora"):
        GRPOModule(config, num_generations=2, max_completion_length=8, beta=0.1, lora=lora,
                   offload_reference=True)
    assert DPOModule(config, offload_reference=True).offload_reference
    assert GRPOModule(config, num_generations=2, max_completion_length=8, beta=0.1,
                      offload_reference=True).offload_reference


def test_reference_offload_needs_a_gpu():
    with pytest.raises(MemoryOptionError, match="offload_reference=True keeps the frozen reference off "
                                                "the GPU.*on accelerator='cpu' it already is there") as info:
        validate_reference_offload(True, "cpu")
    assert info.value.module_fields == ("offload_reference",) and info.value.accelerator
    validate_reference_offload(True, "gpu")
    validate_reference_offload(False, "cpu")


def test_cli_refuses_reference_offload_on_cpu(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(L.Trainer, "fit", lambda *a, **k: pytest.fail("fit ran: not refused before launch"))
    config = write_config(tmp_path, DPO_DATA, "DPOModule", offload_reference=True)
    line = refused(capsys, tmp_path, config)
    assert line.startswith("error: invalid memory setting (trainer.accelerator=cpu, "
                           "model.init_args.offload_reference=True): offload_reference=True keeps the "
                           "frozen reference off the GPU"), line


def test_cli_refuses_reference_offload_with_lora(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(L.Trainer, "fit", lambda *a, **k: pytest.fail("fit ran: not refused before launch"))
    config = write_config(tmp_path, DPO_DATA, "DPOModule", offload_reference=True,
                          lora={"rank": 4, "alpha": 8.0})
    line = refused(capsys, tmp_path, config)
    assert line.startswith("error: model") and "offload_reference=True has nothing to offload with lora" in line, line


# ------------------------------------------------------------------ a DPO run
class WatchReference(L.Callback):
    """Rank 0 writes its losses and where the reference's weights are: when fit starts, in each
    reference forward pass (a pre-hook on its first chunk) and when fit ends."""

    def __init__(self, out: Path) -> None:
        self.out, self.losses, self.during = out, [], []

    def on_fit_start(self, trainer, pl_module):
        self.start = where(pl_module._reference.chunks)
        pl_module._reference.chunks[0].register_forward_pre_hook(
            lambda *_: self.during.append(where(pl_module._reference.chunks)))

    def on_train_batch_end(self, trainer, pl_module, *args):
        self.losses.append(float(trainer.callback_metrics["train/loss"]))

    def on_train_end(self, trainer, pl_module):
        if trainer.global_rank == 0:
            self.out.write_text(json.dumps({"losses": self.losses, "start": self.start,
                                            "during": self.during, "end": where(pl_module._reference.chunks)}))


def where(chunks) -> dict:
    params = [p for c in chunks for p in c.parameters()]
    return {"devices": sorted({str(p.device) for p in params}), "pointers": [p.data_ptr() for p in params],
            "ids": [id(p) for p in params], "pinned": all(p.is_pinned() for p in params)}


ROWS, MICRO, STEPS = 8, 2, 3


def fit_watched(tmp_path: Path, name: str, module, data, accelerator: str = "cpu",
                precision: str = "32-true", start_method: str = "fork", **trainer_kwargs) -> dict:
    """STEPS steps on 1 device, ROWS rows of MICRO; rank 0's WatchReference record."""
    out = tmp_path / f"{name}.json"
    trainer = L.Trainer(
        accelerator=accelerator, devices=1, max_steps=STEPS, logger=False, precision=precision,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[WatchReference(out)],
        strategy=MegatronStrategy(global_batch_size=ROWS, micro_batch_size=MICRO, start_method=start_method),
        **trainer_kwargs,
    )
    trainer.fit(module, data)
    return json.loads(out.read_text())


def run_dpo(tmp_path: Path, name: str, offload: bool, config, **kwargs) -> dict:
    """DPO with a frozen reference (no LoRA); fit_watched's record."""
    module = DPOModule(config, OptimizerSettings(lr=1e-2, warmup_steps=0), beta=0.5, offload_reference=offload)
    rows, _ = pairs(ROWS * STEPS, config.vocab_size, seed=3)
    return fit_watched(tmp_path, name, module, DataLoader(rows, batch_size=ROWS), **kwargs)


def check_runs(kept: dict, offloaded: dict, device: str, passes: int = STEPS * ROWS // MICRO) -> None:
    """Equal losses; the kept reference stays on `device`; the offloaded one lives in one CPU copy
    and runs each forward pass on fresh copies on `device`. `passes`: the reference's chunk calls
    (one per microbatch of each reference pass)."""
    assert len(kept["losses"]) == STEPS and len(set(kept["losses"])) == STEPS, kept["losses"]
    assert offloaded["losses"] == kept["losses"]  # bitwise: floats compared with ==
    assert len(kept["during"]) == len(offloaded["during"]) == passes
    assert kept["start"]["devices"] == kept["end"]["devices"] == [device]
    assert all(d["pointers"] == kept["start"]["pointers"] for d in kept["during"])
    start, end = offloaded["start"], offloaded["end"]
    assert start["devices"] == end["devices"] == ["cpu"]
    assert end["pointers"] == start["pointers"] and end["ids"] == start["ids"]
    for during in offloaded["during"]:
        assert during["devices"] == [device] and during["ids"] == start["ids"]
        assert not set(during["pointers"]) & set(start["pointers"]), "a pass ran on the CPU copy itself"


@pytest.mark.distributed
def test_dpo_offloaded_reference_gives_the_same_losses(tmp_path, monkeypatch):
    """On CPU the refusal before launch is lifted (in the forked rank too) so that the path runs."""
    import lightning_mcore.strategy.megatron as megatron

    monkeypatch.setattr(megatron, "validate_reference_offload", lambda *args: None)
    config = tiny_config(seq_length=SEQ)
    kept = run_dpo(tmp_path, "kept", False, config)
    offloaded = run_dpo(tmp_path, "offloaded", True, config)
    check_runs(kept, offloaded, "cpu")


@pytest.mark.distributed
def test_grpo_offloaded_reference_gives_the_same_losses(tmp_path, monkeypatch):
    """GRPO (beta > 0, frozen reference) on a fixed rollout reused for 3 steps: one reference pass."""
    import lightning_mcore.strategy.megatron as megatron
    from test_grpo import G, FixedRollout, fixed_rollout

    monkeypatch.setattr(megatron, "validate_reference_offload", lambda *args: None)
    config, rollout = tiny_config(seq_length=32), fixed_rollout(ROWS // G, 500, seed=2)
    optim = OptimizerSettings(lr=1e-2, warmup_steps=0)
    runs = {}
    for name, offload in (("kept", False), ("offloaded", True)):
        module = FixedRollout(config, optim, rollout=rollout, num_generations=G, max_completion_length=16,
                              beta=0.5, num_iterations=STEPS, offload_reference=offload)
        runs[name] = fit_watched(tmp_path, name, module, DataLoader([0] * STEPS, batch_size=1))
    check_runs(runs["kept"], runs["offloaded"], "cpu", passes=ROWS // MICRO)
