"""A process that ran mcore once (an in-process export: lightning-mcore export, or
export_checkpoint in a notebook) and then forks training ranks. mcore's destroy_model_parallel
leaves some of its process groups behind; forked ranks inherited them and hung creating their
own (strategy/teardown.py). Run in a subprocess so that a regression fails instead of hanging."""

import gc
import os
import subprocess
import sys
import textwrap

import lightning as L
from toy import ROOT, TokenRows, fit

SCRIPT = textwrap.dedent("""
    import sys
    sys.path.insert(0, "tests")
    from megatron.core import parallel_state
    from lightning_mcore.export_checkpoint import single_process_megatron
    from toy import TokenRows, fit

    with single_process_megatron():
        assert parallel_state.model_parallel_is_initialized()
    losses = fit(sys.argv[1], devices=2, steps=1, gbs=2, mbs=1, dataset=TokenRows(n=4, seq=16, vocab=200))
    print("losses", losses)
""")


def test_forked_ranks_train_after_an_in_process_mcore_run(tmp_path):
    run = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], cwd=ROOT, capture_output=True,
                         text=True, timeout=240)
    assert run.returncode == 0 and "losses [" in run.stdout, run.stdout[-2000:] + run.stderr[-3000:]


class Canary:
    """Writes the pid of the process that frees it."""

    def __init__(self, path: str) -> None:
        self.path, self.me = path, self  # a cycle: only the collector frees it

    def __del__(self) -> None:
        with open(self.path, "a") as file:
            file.write(f"{os.getpid()}\n")


class DropAndCollect(L.Callback):
    """In each rank: drop the only reference to the parent's canary, make a canary of the rank's
    own, drop that too, and run a full collection."""

    def __init__(self, held: list, path: str) -> None:
        self.held, self.path = held, path

    def on_train_start(self, trainer, module) -> None:
        self.held.clear()
        Canary(f"{self.path}.rank")
        gc.collect()


def test_forked_ranks_leave_the_launching_process_garbage_alone(tmp_path):
    """What the launching process holds at the fork is never collected in a rank (its destructors
    are not the rank's to run: a torch process group's joins threads that did not come across the
    fork, and a rank that collected one hung). The collector still frees the ranks' own cycles."""
    held = [Canary(str(tmp_path / "parent"))]
    fit(tmp_path, devices=2, steps=1, gbs=2, mbs=1, dataset=TokenRows(n=4, seq=16, vocab=200),
        callbacks=(DropAndCollect(held, str(tmp_path / "parent")),))
    assert not (tmp_path / "parent").exists()  # neither rank freed it
    ranks = (tmp_path / "parent.rank").read_text().split()
    assert len(ranks) == 2 and str(os.getpid()) not in ranks  # each rank freed its own
    held.clear()
    gc.collect()
    assert (tmp_path / "parent").read_text().split() == [str(os.getpid())]
