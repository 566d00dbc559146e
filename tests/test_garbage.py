"""On GPU the strategy freezes the garbage collector's objects after a fit's first step
(collections then walk only newer objects) and unfreezes them when the fit ends
(strategy/garbage.py); on CPU it leaves the collector alone. Both checks run in child processes:
a forced collection or freeze in the pytest process would reach what earlier tests left there (in
one CI run it broke the next test's gloo rendezvous). The GPU fits' freeze: benchmarks/RESULTS.md
(session 8, a full collection 1.2 ms frozen against 552-767 ms)."""

import gc
import json
import multiprocessing

import lightning as L
from toy import fit

from lightning_mcore.strategy.garbage import FrozenAfterFirstStep


class FreezeCounts(L.Callback):
    """Writes the freeze count after each training step to `path` (the fit runs in a child)."""

    def __init__(self, path) -> None:
        self.path, self.counts = path, []

    def on_train_batch_end(self, *args) -> None:
        self.counts.append(gc.get_freeze_count())
        self.path.write_text(json.dumps(self.counts))


def test_cpu_fits_leave_the_collector_alone(tmp_path):
    """No freeze at the second step on CPU. A forked rank holds the launching process's heap
    frozen from its start (strategy/launcher.py), which the launching process unfreezes after."""
    out = tmp_path / "counts.json"
    before = gc.get_freeze_count()  # what imports froze (375 objects with Transformer Engine installed)
    losses = fit(tmp_path, devices=1, steps=3, callbacks=[FreezeCounts(out)])  # fork-launched rank
    counts = json.loads(out.read_text())
    assert len(losses) == 3 and counts[0] > before and counts == [counts[0]] * 3
    assert gc.get_freeze_count() == 0  # gc.unfreeze() releases what imports froze too


def _steps_of_a_resumed_fit(queue) -> None:
    # The forked child inherits the test process's heap; its collections must not walk it (an
    # inherited object's finalizer may wait on a lock a thread of the parent held at the fork: a
    # CI run hung here once). Frozen first, it stays out of the collections below.
    gc.freeze()
    inherited = gc.get_freeze_count()
    objects, seen = FrozenAfterFirstStep(), []
    objects.before_step(7)  # a resumed fit's first step
    objects.before_step(7)  # no optimizer step done yet in this fit
    seen.append((objects.frozen, gc.get_freeze_count() - inherited))
    kept = [[] for _ in range(100)]  # this fit's own objects (tracked by the collector), made after its first step
    objects.before_step(8)
    seen.append((objects.frozen, gc.get_freeze_count() - inherited >= len(kept)))
    objects.release()
    seen.append((objects.frozen, gc.get_freeze_count()))
    queue.put(seen)


def test_freezes_after_a_step_of_this_fit_and_releases():
    import queue as queues

    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_steps_of_a_resumed_fit, args=(queue,))
    child.start()
    try:
        seen = queue.get(timeout=120)
    except queues.Empty:
        child.kill()
        raise AssertionError(f"the child gave no result in 120 s (exit code {child.exitcode})") from None
    child.join()
    assert seen == [(False, 0), (True, True), (False, 0)]
