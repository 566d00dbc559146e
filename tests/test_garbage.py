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
    gc.unfreeze()  # what an import may have frozen (Transformer Engine's does)
    probe = FreezeCounts()
    losses = fit(tmp_path, devices=1, steps=3, callbacks=[probe], start_method="popen")  # in this process
    assert len(losses) == 3
    # the model, its optimizer and mcore's state are all tracked objects: far more than a few
    assert probe.counts[0] == 0 and min(probe.counts[1:]) > 10_000, probe.counts
    assert gc.get_freeze_count() == 0  # a notebook that drops the model gets its memory back


def test_freezes_only_after_a_step_of_this_fit():
    gc.unfreeze()
    objects = FrozenAfterFirstStep()
    objects.before_step(7)  # a resumed fit's first step
    objects.before_step(7)  # no optimizer step done yet in this fit
    assert not objects.frozen and gc.get_freeze_count() == 0
    objects.before_step(8)
    assert objects.frozen and gc.get_freeze_count() > 0
    objects.release()
    assert gc.get_freeze_count() == 0
