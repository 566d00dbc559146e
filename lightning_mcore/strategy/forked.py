"""A rank forked from a process that already used torch's CPU thread pool.

After a fork torch marks its pthreadpool as corrupt and rebuilds it at the next call that asks
for it. That rebuild is not thread-safe: it releases the old pool before making the new one,
and a second thread asking in between gets none. The autograd engine's worker threads each
set their thread count when they start, all at once, so the first backward of a forked rank can
abort with "Invalid thread pool!" (seen on torch 2.11 when the parent had run models before).
Lightning rebuilds the pool in each forked rank unless OMP_NUM_THREADS is set; with it set (our
tests, most clusters) nothing does, so the rank's main thread does it here, before any backward.
"""

from __future__ import annotations

import torch


def rebuild_thread_pool() -> None:
    """Make torch rebuild its CPU thread pool now, on this thread, at its current size."""
    torch.set_num_threads(torch.get_num_threads())
