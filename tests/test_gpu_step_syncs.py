"""On GPU a training step waits for the device once, in our code and Lightning's: the update's
check reads the loss and gradient norm back together with the step's metrics
(MegatronStrategy._checked_step), an event's wait on a copy queued before it (before the update,
or after it with on_nonfinite="stop_after_update"). Logging them (the progress bar's loss, lr,
gradient norm, and MegatronThroughput between its windows) waits for nothing, so the host can
queue the next step while the GPU runs the update. Counted from one step's start to the next's:
the waits torch's sync debug mode reports, and each event wait. Skipped without CUDA."""

import os
import traceback
import warnings

import lightning as L
import pytest
import torch
from toy import fit, tiny_config

from lightning_mcore import MegatronThroughput, OptimizerSettings

pytestmark = [pytest.mark.gpu]

# who asked for a wait: the innermost frame outside torch, by its package
_CALLERS = {"lightning_mcore/": "ours", "lightning/": "Lightning", "megatron/": "mcore",
            "transformer_engine/": "TE"}


_TORCH = os.path.dirname(torch.__file__) + os.sep  # not "/torch/": a venv may live in /opt/torch/


def caller(frames) -> str:
    for frame in reversed(frames):
        if frame.filename.startswith(_TORCH) or frame.filename.endswith(("warnings.py", __file__)):
            continue
        for part, who in _CALLERS.items():
            if part in frame.filename:
                return f"{who} {frame.filename.rsplit('/', 1)[-1]}:{frame.name}"
        return f"other {frame.filename}:{frame.name}"
    return "torch"


class SyncCensus(L.Callback):
    """Each synchronising CUDA call from the start of step `step` (0-based) to the start of the
    next, named by its caller: `calls` those sync debug mode reports, `event_waits` the events'."""

    def __init__(self, step: int) -> None:
        self.step, self.calls, self.event_waits, self._catching = step, [], [], None
        self.stacks = []  # each reported wait's innermost frames, to name what the caller misses
        self._event_wait = torch.cuda.Event.synchronize

    def on_train_batch_start(self, trainer, *args) -> None:
        if trainer.global_step == self.step:
            self._catching = warnings.catch_warnings()
            self._catching.__enter__()
            warnings.simplefilter("always")
            warnings.showwarning = self._record
            torch.set_warn_always(True)  # else torch warns once per kind of call and process
            torch.cuda.set_sync_debug_mode("warn")
            census = self

            def counted(event):
                census.event_waits.append(caller(traceback.extract_stack()[:-1]))
                return census._event_wait(event)

            torch.cuda.Event.synchronize = counted
        elif trainer.global_step == self.step + 1:
            self._stop()

    def on_train_end(self, *args) -> None:
        self._stop()

    def _stop(self) -> None:
        if self._catching is not None:
            torch.cuda.set_sync_debug_mode("default")
            torch.cuda.Event.synchronize = self._event_wait
            torch.set_warn_always(False)
            self._catching.__exit__(None, None, None)
            self._catching = None

    def _record(self, message, category, filename, lineno, file=None, line=None) -> None:
        if "called a synchronizing CUDA operation" in str(message):  # torch's sync debug warning
            frames = traceback.extract_stack()[:-1]
            self.calls.append(caller(frames))
            self.stacks.append(" < ".join(f"{f.filename.rsplit('/', 2)[-2:]}:{f.lineno}:{f.name}"
                                          for f in reversed(frames[-8:])))


@pytest.mark.parametrize("on_nonfinite", ["stop", "stop_after_update"])
def test_a_training_step_waits_for_the_gpu_once(tmp_path, on_nonfinite):
    census = SyncCensus(step=2)  # MegatronThroughput(window_size=2) measures after steps 2 and 4
    fit(tmp_path, steps=4, config=tiny_config(transformer_impl="transformer_engine"),
        optim=OptimizerSettings(lr=1e-3, on_nonfinite=on_nonfinite),
        callbacks=[census, MegatronThroughput(window_size=2)], accelerator="gpu",
        precision="bf16-mixed", start_method="popen")
    print("\n".join(["reported:", *census.calls, "event waits:", *census.event_waits, "stacks:", *census.stacks]))
    ours = [c for c in census.calls if c.startswith(("ours", "Lightning", "other", "torch"))]
    assert ours == [] and census.event_waits == ["ours nonfinite.py:read"], (census.calls, census.event_waits)
