"""Python's garbage collector in training: what exists after the first step is frozen out of it.

A full collection walks every object the collector tracks: the model's modules and parameters,
mcore's and Transformer Engine's state. On one H100 one took 550-890 ms, at a step the interpreter
picks (5 of 20 MoE benchmark runs had one among 8 timed steps, 14-22% off their speed; at DP > 1 one
rank's pause holds up the others at the next collective). After the first step the long-lived
objects exist: they are frozen (gc.freeze), and a full collection then took 1.2 ms
(benchmarks/RESULTS.md, session 8). The collector stays on, so cycles made while training are
still freed; everything is unfrozen when the fit ends, so a notebook that drops the model gets its
memory back. GPU only (the strategy's fast path): on CPU each of the test suite's short fits paid
one full collection of a large forked heap (two LoRA test files: 48.4 s against 39.1 s without).
"""

from __future__ import annotations

import gc
from typing import Optional


class FrozenAfterFirstStep:
    """Freezes the collector's objects at the second training step of a fit, unfreezes at its end.
    gc.unfreeze() releases every frozen object, also those a library froze before (on a GPU
    machine 375 were, once torch and Transformer Engine were imported): they become collectable."""

    def __init__(self) -> None:
        self._first_step: Optional[int] = None
        self.frozen = False

    def before_step(self, global_step: int) -> None:
        if self._first_step is None:
            self._first_step = global_step
        elif not self.frozen and global_step > self._first_step:
            gc.collect()
            gc.freeze()
            self.frozen = True

    def release(self) -> None:
        if self.frozen:
            gc.unfreeze()
        self.frozen, self._first_step = False, None
