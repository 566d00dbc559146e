"""On GPU a training step waits for the device once, in our code and Lightning's: the update's
check reads the loss and gradient norm back together with the step's metrics
(MegatronStrategy._checked_step). Logging them (the progress bar's loss, lr, gradient norm, and
MegatronThroughput between its windows) waits for nothing, so the host can queue the next step
while the GPU runs the update. Counted with torch's sync debug mode from one step's start to the
next's. Skipped without CUDA."""

import traceback
import warnings

import lightning as L
import pytest
import torch
from toy import fit, tiny_config

from lightning_mcore import MegatronThroughput

pytestmark = [pytest.mark.gpu]

# who asked for a wait: the innermost frame outside torch, by its package
_CALLERS = {"lightning_mcore/": "ours", "lightning/": "Lightning", "megatron/": "mcore",
            "transformer_engine/": "TE"}


def caller(frames) -> str:
    for frame in reversed(frames):
        if "/torch/" in frame.filename or frame.filename.endswith(("warnings.py", __file__)):
            continue
        for part, who in _CALLERS.items():
            if part in frame.filename:
                return f"{who} {frame.filename.rsplit('/', 1)[-1]}:{frame.name}"
        return f"other {frame.filename}:{frame.name}"
    return "torch"


class SyncCensus(L.Callback):
    """Each synchronising CUDA call from the start of step `step` (0-based) to the start of the
    next, named by its caller."""

    def __init__(self, step: int) -> None:
        self.step, self.calls, self._catching = step, [], None

    def on_train_batch_start(self, trainer, *args) -> None:
        if trainer.global_step == self.step:
            self._catching = warnings.catch_warnings()
            self._catching.__enter__()
            warnings.simplefilter("always")
            warnings.showwarning = self._record
            torch.set_warn_always(True)  # else torch warns once per kind of call and process
            torch.cuda.set_sync_debug_mode("warn")
        elif trainer.global_step == self.step + 1:
            self._stop()

    def on_train_end(self, *args) -> None:
        self._stop()

    def _stop(self) -> None:
        if self._catching is not None:
            torch.cuda.set_sync_debug_mode("default")
            torch.set_warn_always(False)
            self._catching.__exit__(None, None, None)
            self._catching = None

    def _record(self, message, category, filename, lineno, file=None, line=None) -> None:
        if "synchroniz" in str(message):
            self.calls.append(caller(traceback.extract_stack()[:-1]))


def test_a_training_step_waits_for_the_gpu_once(tmp_path):
    census = SyncCensus(step=2)  # MegatronThroughput(window_size=2) measures after steps 2 and 4
    fit(tmp_path, steps=4, config=tiny_config(transformer_impl="transformer_engine"),
        callbacks=[census, MegatronThroughput(window_size=2)], accelerator="gpu",
        precision="bf16-mixed", start_method="popen")
    print("\n".join(census.calls))
    ours = [c for c in census.calls if c.startswith(("ours", "Lightning", "other", "torch"))]
    assert ours == ["ours nonfinite.py:host_values"], census.calls
