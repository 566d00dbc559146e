"""NaN/inf: a non-finite loss or gradient never reaches the weights, and NaN weights are never
written (checkpoint, HF export)."""

import math
import re
import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from lightning_mcore import MegatronStrategy, OptimizerSettings, PretrainModule
from lightning_mcore.strategy.nonfinite import NonFiniteError, host_values
from test_export_safety import forked_export
from toy import StopAfter, TokenRows, sharded_weights, tiny_config


class Poisoned(PretrainModule):
    """`poison`: {global_step: (what, rank)}: at that step, on that rank (None: all), either the
    gradients flowing back from the token losses become NaN (what="grad"; the loss stays
    finite), the loss itself does (what="loss"), or only the loss's value does, its gradients
    staying finite (what="value"), or the gradients become exactly 0 (what="zero")."""

    def __init__(self, *args, poison=None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.poison = poison or {}

    def _poisoned(self, what: str) -> bool:
        kind, rank = self.poison.get(self.trainer.global_step, (None, None))
        return kind == what and rank in (None, self.trainer.global_rank)

    def forward_step(self, batch, chunk):
        token_losses, loss_fn = super().forward_step(batch, chunk)
        if self._poisoned("grad"):
            token_losses.register_hook(lambda grad: grad * math.nan)
        if self._poisoned("zero"):  # every gradient exactly 0 (what frozen-through recompute gave)
            token_losses.register_hook(lambda grad: grad * 0)
        if self._poisoned("loss"):
            token_losses = token_losses * math.nan
        if self._poisoned("value"):  # d/dx of x + (nan - x).detach() is 1
            token_losses = token_losses + (torch.full_like(token_losses, math.nan) - token_losses).detach()
        return token_losses, loss_fn

    def optimizer_step(self, *args, **kwargs):
        try:
            super().optimizer_step(*args, **kwargs)
        except NonFiniteError:  # what the weights are once the error is raised, and a save then
            torch.save(sharded_weights(self), self.dump(f"raised{self.trainer.global_rank}"))
            try:
                self.trainer.strategy.refuse_nonfinite_weights("a save after the error")
            except NonFiniteError as refused:
                (Path(self.trainer.default_root_dir) / f"refused{self.trainer.global_rank}.txt").write_text(str(refused))
            raise

    def dump(self, name: str) -> Path:
        return Path(self.trainer.default_root_dir) / f"{name}.pt"


class DumpEachStep(L.Callback):
    """Weights, LR schedule position and skip flag after every step (each rank its own)."""

    def on_train_batch_end(self, trainer, pl_module, *args):
        optimizer = pl_module.optimizers(use_pl_optimizer=False)
        torch.save({"weights": sharded_weights(pl_module), "scheduler_steps": optimizer.scheduler.num_steps,
                    "skipped": optimizer.last_update_skipped},
                   pl_module.dump(f"step{trainer.global_step}-rank{trainer.global_rank}"))


def train(tmp: Path, devices: int = 1, steps: int = 4, optim=None, poison=None, callbacks=(),
          every: int = 1):
    trainer = L.Trainer(
        accelerator="cpu", devices=devices, max_steps=steps, logger=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=tmp,
        callbacks=[*callbacks, ModelCheckpoint(dirpath=tmp / "ckpts", every_n_train_steps=every,
                                               save_top_k=-1, save_last=True)],
        strategy=MegatronStrategy(global_batch_size=4, micro_batch_size=2, start_method="fork"),
    )
    module = Poisoned(tiny_config(), optim or OptimizerSettings(lr=1e-3), poison=poison)
    trainer.fit(module, DataLoader(TokenRows(), batch_size=4 // devices))


def checkpoints(tmp: Path) -> list[str]:
    return sorted(p.name for p in (tmp / "ckpts").iterdir())


def equal(a: list, b: list) -> bool:
    return all(ka == kb and torch.equal(ta, tb) for (ka, *_, ta), (kb, *_, tb) in zip(a, b, strict=True))


def finite(weights: list) -> bool:
    return all(torch.isfinite(t).all() for *_, t in weights)


@pytest.mark.distributed
def test_nan_gradient_on_one_rank_stops_every_rank_before_the_update(tmp_path):
    """Step 3's gradients turn NaN on rank 1 only (finite loss); after the data-parallel
    reduction both ranks hold them: both stop naming step 3, with the weights of step 2, and
    the checkpoints of steps 1 and 2 are the last ones written."""
    with pytest.raises(Exception) as info:
        train(tmp_path, devices=2, poison={2: ("grad", 1)}, callbacks=[DumpEachStep()])
    assert "non-finite gradient norm (nan) at step 3 (trainer.global_step 2)" in str(info.value)
    assert "Lower the learning rate (lr=0.001)" in str(info.value)
    assert checkpoints(tmp_path) == ["epoch=0-step=1.ckpt", "epoch=0-step=2.ckpt", "last.ckpt"]
    for rank in (0, 1):
        before = torch.load(tmp_path / f"step2-rank{rank}.pt")["weights"]
        raised = torch.load(tmp_path / f"raised{rank}.pt")
        assert finite(before) and equal(raised, before)


@pytest.mark.distributed
def test_skip_leaves_weights_and_schedule_as_they_were(tmp_path):
    """on_nonfinite="skip": step 2 (NaN gradients) and step 4 (NaN loss) change nothing, the
    LR schedule advances only on the 3 real updates, and training goes on to step 5."""
    train(tmp_path, steps=5, optim=OptimizerSettings(lr=1e-3, on_nonfinite="skip"),
          poison={1: ("grad", None), 3: ("loss", None)}, callbacks=[DumpEachStep()])
    steps = [torch.load(tmp_path / f"step{k}-rank0.pt") for k in range(1, 6)]
    assert [s["skipped"] for s in steps] == [False, True, False, True, False]
    assert [s["scheduler_steps"] for s in steps] == [1, 1, 2, 2, 3]
    weights = [s["weights"] for s in steps]
    assert equal(weights[1], weights[0]) and equal(weights[3], weights[2])
    assert not equal(weights[2], weights[1]) and not equal(weights[4], weights[3])
    assert all(finite(w) for w in weights)
    assert "epoch=0-step=5.ckpt" in checkpoints(tmp_path)


@pytest.mark.distributed
def test_diverging_run_stops_and_saves_nothing_after(tmp_path):
    """The issue's run: lr=1e6 diverges within a few steps; it stops naming the step, and the
    checkpoints written are exactly those of the steps before it."""
    with pytest.raises(Exception) as info:
        train(tmp_path, steps=8, optim=OptimizerSettings(lr=1e6))
    found = re.search(r"non-finite (loss|gradient norm) \((nan|inf|-inf)\) at step (\d+) ", str(info.value))
    assert found, str(info.value)[-800:]
    step = int(found.group(3))
    assert 1 < step <= 8
    assert checkpoints(tmp_path) == sorted([f"epoch=0-step={k}.ckpt" for k in range(1, step)] + ["last.ckpt"])


@pytest.mark.distributed
def test_stop_after_update_applies_the_step_then_stops_and_refuses_its_weights(tmp_path):
    """on_nonfinite="stop_after_update" reads the loss and norm while the update runs: its good
    steps give the weights of the default check's, step 3 (a NaN loss whose gradients are
    finite) is applied and stops training naming it, and a save of the weights it left (finite,
    but from a rejected step) is refused."""
    checked, late = tmp_path / "checked", tmp_path / "late"
    for root in (checked, late):
        root.mkdir()
    # the same LR schedule (max_steps); only steps 1 and 2 are compared
    train(checked, steps=4, callbacks=[DumpEachStep(), StopAfter(2)])
    with pytest.raises(Exception) as info:
        train(late, steps=4, optim=OptimizerSettings(lr=1e-3, on_nonfinite="stop_after_update"),
              poison={2: ("value", None)}, callbacks=[DumpEachStep()])
    assert "non-finite loss (nan) at step 3 (trainer.global_step 2): the update was applied" in str(info.value)
    assert checkpoints(late) == ["epoch=0-step=1.ckpt", "epoch=0-step=2.ckpt", "last.ckpt"]
    weights = {(root, k): torch.load(root / f"step{k}-rank0.pt")["weights"] for root in (checked, late) for k in (1, 2)}
    assert all(equal(weights[late, k], weights[checked, k]) for k in (1, 2))
    raised = torch.load(late / "raised0.pt")
    assert finite(raised) and not equal(raised, weights[late, 2])
    assert "a step's NaN/inf update reached the weights" in (late / "refused0.txt").read_text()
    assert not (checked / "refused0.txt").exists()


@pytest.mark.distributed
def test_stop_after_update_stops_every_rank_and_each_refuses_its_weights(tmp_path):
    """Two data-parallel ranks, NaN gradients on rank 1 only at step 3, on_nonfinite=
    "stop_after_update": the update (its parameter all-gather included) runs on both ranks
    before they read the reduced norm; both stop naming step 3 as applied, the checkpoints of
    steps 1 and 2 are the last ones written, and each rank refuses a save afterwards."""
    with pytest.raises(Exception) as info:
        train(tmp_path, devices=2, optim=OptimizerSettings(lr=1e-3, on_nonfinite="stop_after_update"),
              poison={2: ("grad", 1)})
    assert "non-finite gradient norm (nan) at step 3 (trainer.global_step 2): the update was applied" in str(info.value)
    assert checkpoints(tmp_path) == ["epoch=0-step=1.ckpt", "epoch=0-step=2.ckpt", "last.ckpt"]
    for rank in (0, 1):
        assert "a step's NaN/inf update reached the weights" in (tmp_path / f"refused{rank}.txt").read_text()


class PoisonWeightsThenExport(L.Callback):
    """After step 2, one weight of rank 1 becomes NaN; then an HF export is tried on every rank
    (collective) and its error recorded; ModelCheckpoint's save of step 2 follows."""

    def on_train_batch_end(self, trainer, pl_module, *args):
        if trainer.global_step != 2:
            return
        if trainer.global_rank == 1:
            with torch.no_grad():
                next(pl_module.chunks.parameters()).view(-1)[0] = math.nan
        out = Path(trainer.default_root_dir)
        try:
            pl_module.save_hf_checkpoint(out / "hf")
        except NonFiniteError as error:
            (out / f"hf-refused{trainer.global_rank}.txt").write_text(str(error))


@pytest.mark.distributed
def test_nan_weights_are_never_saved_or_exported(tmp_path):
    with pytest.raises(Exception) as info:
        train(tmp_path, devices=2, callbacks=[PoisonWeightsThenExport()])
    ckpt = tmp_path / "ckpts" / "epoch=0-step=2.ckpt"
    assert f"refusing to write checkpoint {ckpt}: the model's weights hold NaN/inf" in str(info.value)
    assert checkpoints(tmp_path) == ["epoch=0-step=1.ckpt", "last.ckpt"]
    for rank in (0, 1):  # rank 0's own weights are finite: it refuses because rank 1's are not
        said = (tmp_path / f"hf-refused{rank}.txt").read_text()
        assert said.startswith(f"refusing to write the HF export {tmp_path / 'hf'}: the model's weights")
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(("hf", ".tmp"))) == \
        ["hf-refused0.txt", "hf-refused1.txt"]


class PoisonWeights(L.Callback):
    def on_train_batch_end(self, trainer, pl_module, *args):
        with torch.no_grad():
            next(pl_module.chunks.parameters()).view(-1)[0] = math.nan


@pytest.mark.distributed
def test_export_command_refuses_a_checkpoint_with_nan_weights(tmp_path, monkeypatch):
    """A checkpoint written before saves were checked (the check switched off here) holds a
    NaN weight: `lightning-mcore export` refuses it and writes nothing. (In a forked process:
    an export in this process would leave state behind that hangs later forked ranks.)"""
    monkeypatch.setattr(MegatronStrategy, "refuse_nonfinite_weights", lambda self, what: None)
    train(tmp_path, steps=1, callbacks=[PoisonWeights()])
    monkeypatch.undo()  # the export checks as it always does
    out = tmp_path / "hf"
    code, err = forked_export(["--checkpoint", tmp_path / "ckpts" / "epoch=0-step=1.ckpt", "--output", out])
    assert code != 0
    assert f"refusing to write the HF export {out}: the model's weights hold NaN/inf" in err
    assert [p.name for p in tmp_path.iterdir()] == ["ckpts"]  # no export, no temporary


class RecordWarnings(L.Callback):
    """The warnings of the (forked) rank's training, written to warnings.txt at its end."""

    def on_train_start(self, trainer, pl_module):
        self.context = warnings.catch_warnings(record=True)
        self.caught = self.context.__enter__()
        warnings.simplefilter("always")

    def on_train_end(self, trainer, pl_module):
        self.context.__exit__(None, None, None)
        text = "\n".join(str(w.message) for w in self.caught)
        (Path(trainer.default_root_dir) / "warnings.txt").write_text(text)


def test_a_step_with_all_gradients_zero_is_said_once(tmp_path):
    """Steps 2 and 3 give every trained parameter a gradient of exactly 0 (the loss is finite):
    the run says so once, naming step 2, and goes on (a zero update is not a wrong one)."""
    train(tmp_path, steps=3, poison={1: ("zero", None), 2: ("zero", None)}, callbacks=[RecordWarnings()])
    said = (tmp_path / "warnings.txt").read_text()
    assert said.count("gradient norm is exactly 0") == 1, said
    assert "gradient norm is exactly 0 at step 2 (trainer.global_step 1)" in said
    assert "epoch=0-step=3.ckpt" in checkpoints(tmp_path)


def test_host_values_keep_order_none_and_numbers():
    """The step's check reads its values back in one copy: each in its place, None kept,
    numbers passed through, NaN still NaN."""
    values = host_values(torch.tensor(1.5), None, 2, torch.tensor([math.nan]), torch.tensor(3))
    assert values[:3] == [1.5, None, 2.0] and math.isnan(values[3]) and values[4] == 3.0
    assert all(type(v) is float for v in values if v is not None)
