"""Python's garbage collector in training: what exists after the first step is frozen out of it.

A full collection walks every object the collector tracks. With a model's modules and parameters
and mcore's and Transformer Engine's caches alive, one took ~600 ms in the middle of a 0.42 s MoE
step on one H100 (benchmarks/RESULTS.md, session 8), at a step the interpreter picks: every few
runs a timed window held one, 13% off its mean, and across ranks one rank's pause stalls the
others at the next collective. After the first step the long-lived objects exist; they are
collected once and frozen (gc.freeze), so later collections walk only what is newer. The collector
stays on, so reference cycles made while training are still freed; the objects are unfrozen when
the fit ends, so a notebook that drops the model gets its memory back.
"""

from __future__ import annotations

import gc
from typing import Optional


class FrozenAfterFirstStep:
    """Freezes the collector's objects at the second training step of a fit, unfreezes at its end.
    gc.unfreeze() releases every frozen object, also those a library froze before (Transformer
    Engine's import freezes a few hundred): they become collectable again, as they were before."""

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
