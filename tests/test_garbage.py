"""The strategy freezes the garbage collector's objects after a fit's first step (collections then
walk only newer objects) and unfreezes them when the fit ends (strategy/garbage.py)."""

import gc

import lightning as L
from toy import fit

from lightning_mcore.strategy.garbage import FrozenAfterFirstStep


class FreezeCounts(L.Callback):
    def __init__(self) -> None:
        self.counts = []

    def on_train_batch_end(self, *args) -> None:
        self.counts.append(gc.get_freeze_count())


def test_objects_frozen_after_the_first_step_and_released_at_the_end(tmp_path):
    assert gc.get_freeze_count() == 0
    probe = FreezeCounts()
    losses = fit(tmp_path, devices=1, steps=3, callbacks=[probe], start_method="popen")  # in this process
    assert len(losses) == 3
    # the model, its optimizer and mcore's state are all tracked objects: far more than a few
    assert probe.counts[0] == 0 and min(probe.counts[1:]) > 10_000, probe.counts
    assert gc.get_freeze_count() == 0  # a notebook that drops the model gets its memory back


def test_leaves_a_freeze_it_did_not_make():
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        objects = FrozenAfterFirstStep()
        for step in range(3):
            objects.before_step(step)
        assert not objects.frozen
        objects.release()
        assert gc.get_freeze_count() == frozen
    finally:
        gc.unfreeze()
