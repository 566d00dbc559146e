"""A forked rank's CPU thread pool (strategy/forked.py): torch marks it corrupt in the child and
rebuilds it at the next call that asks for it, a rebuild that is not thread-safe; the strategy
makes that call on each rank's main thread before any backward.

The race itself needs threads that start together in a fresh rank (the autograd engine's device
threads, one per visible GPU): a CPU-only machine has none, so only the call is checked here."""

import os

from lightning_mcore.strategy import forked, megatron
from toy import fit


def test_each_rank_rebuilds_its_pool_as_it_starts(tmp_path, monkeypatch):
    """Both forked ranks of a run call it, each once, as the strategy sets the rank up."""
    calls = tmp_path / "calls"

    def recorded():
        with open(calls, "a") as f:
            f.write(f"{os.getpid()}\n")
        forked.rebuild_thread_pool()

    monkeypatch.setattr(megatron, "rebuild_thread_pool", recorded)
    fit(tmp_path, devices=2, steps=1)
    pids = calls.read_text().split()
    assert len(pids) == len(set(pids)) == 2 and str(os.getpid()) not in pids
