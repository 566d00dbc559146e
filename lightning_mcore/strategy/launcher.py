"""Lightning's multiprocessing launcher (start_method fork/spawn: notebooks, tests) with two
things its ranks need.

- A refusal a rank meets is printed by the CLI as one `error:` line, as under the subprocess
  launcher (the CLI's default), not as the traceback torch hands the launching process: each
  rank leaves the line in a directory of this launch (refusals.report_in_rank), read into
  `refusals` when the ranks have ended. A Python caller of Trainer.fit still gets torch's error.
- A forked rank never collects the launching process's garbage: everything that process holds
  is frozen out of the collector (gc.freeze) while the ranks run. Among it may be a torch
  process group of an earlier run in the same process (a notebook, a test session) whose
  destructor joins threads that did not come across the fork: a forked rank that collected
  one hung for good in std::thread::join. The ranks also skip walking the inherited heap. For the
  same reason mcore's rotary-embedding caches, which hold groups in their keys, are emptied
  first (strategy/teardown.py).
"""

from __future__ import annotations

import functools
import gc
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable, Optional

from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher

from lightning_mcore.refusals import report_in_rank
from lightning_mcore.strategy.teardown import clear_rotary_caches


class MultiprocessingLauncher(_MultiProcessingLauncher):
    refusals: dict[int, str] = {}  # rank: the refusal it met, in the last launch

    def launch(self, function: Callable, *args: Any, trainer: Optional[Any] = None, **kwargs: Any) -> Any:
        self.refusals = {}
        reports = tempfile.mkdtemp(prefix="lightning-mcore-refusals-")
        if trainer is not None:  # Lightning's trainer functions; a bare function is left as it is
            function = functools.partial(report_in_rank, reports, trainer, function)
        forking = self._start_method == "fork"  # spawned ranks start with a heap of their own
        if forking:
            clear_rotary_caches()  # nor inherit cached references to this process's groups
            gc.freeze()
        try:
            return super().launch(function, *args, trainer=trainer, **kwargs)
        finally:
            if forking:
                gc.unfreeze()
            self.refusals = {int(p.name.split("-")[1]): p.read_text() for p in Path(reports).glob("rank-*")}
            shutil.rmtree(reports, ignore_errors=True)
