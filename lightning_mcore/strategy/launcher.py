"""Lightning's multiprocessing launcher (start_method fork/spawn: notebooks, tests) with two
things its ranks need.

- Each rank reports a refusal in one `error:` line (refusals.report_in_rank), as the ranks of
  the subprocess launcher (the CLI's default) do, instead of handing torch a traceback that the
  launching process prints.
- A forked rank never collects the launching process's garbage: everything that process holds
  is frozen out of the collector (gc.freeze) while the ranks run. Among it may be a torch
  process group of an earlier run in the same process (a notebook, a test session) whose
  destructor joins threads that did not come across the fork: a forked rank that collected
  one hung for good in std::thread::join. The ranks also skip walking the inherited heap.
"""

from __future__ import annotations

import functools
import gc
from typing import Any, Callable, Optional

from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher

from lightning_mcore.refusals import report_in_rank


class MultiprocessingLauncher(_MultiProcessingLauncher):
    def launch(self, function: Callable, *args: Any, trainer: Optional[Any] = None, **kwargs: Any) -> Any:
        if trainer is not None:  # Lightning's trainer functions; a bare function is left as it is
            function = functools.partial(report_in_rank, trainer, function)
        if self._start_method != "fork":  # spawned ranks start with a heap of their own
            return super().launch(function, *args, trainer=trainer, **kwargs)
        gc.freeze()
        try:
            return super().launch(function, *args, trainer=trainer, **kwargs)
        finally:
            gc.unfreeze()
