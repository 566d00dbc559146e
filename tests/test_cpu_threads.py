"""CPU threads per rank (strategy/cpu.py, item 11): unless the user sets OMP_NUM_THREADS, each of
n > 1 local ranks gets min(4, cpus // n), chosen in the launching process before any rank starts
and applied in each rank; a user's value and a single process are left as they are."""

import os

import lightning as L
import pytest
import torch

from lightning_mcore import MegatronStrategy
from lightning_mcore.strategy import cpu


@pytest.fixture
def cores(monkeypatch):
    """A machine with `n` cores for the test's own process, and no OMP_NUM_THREADS set."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)

    def machine(n: int) -> None:
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(n)))

    return machine


@pytest.mark.parametrize("n_cores, ranks, expected", [(16, 2, "4"), (16, 8, "2"), (16, 32, "1"),
                                                      (2, 2, "1"), (6, 4, "1"), (64, 4, "4")])
def test_ranks_get_at_most_four_threads_each(cores, n_cores, ranks, expected):
    cores(n_cores)
    cpu.choose_rank_threads(ranks)
    assert os.environ["OMP_NUM_THREADS"] == expected == str(max(1, min(4, n_cores // ranks)))


def test_a_users_value_and_a_single_process_are_left_alone(cores, monkeypatch):
    cores(16)
    cpu.choose_rank_threads(1)
    assert "OMP_NUM_THREADS" not in os.environ  # one process keeps torch's default
    monkeypatch.setenv("OMP_NUM_THREADS", "12")
    cpu.choose_rank_threads(2)
    assert os.environ["OMP_NUM_THREADS"] == "12"


def test_the_trainer_chooses_before_its_ranks_start(cores):
    """Building the Trainer (Lightning's _configure_launcher, in the launching process) sets the
    value its launcher then keeps (Lightning's own default would be 16 // 2 = 8)."""
    cores(16)
    L.Trainer(accelerator="cpu", devices=2, strategy=MegatronStrategy(tensor_model_parallel_size=2),
              logger=False, enable_checkpointing=False)
    assert os.environ["OMP_NUM_THREADS"] == "4"


@pytest.mark.parametrize("value, expected", [("3", 3), ("2,1", 2), ("", 1), ("many", 1)])
def test_a_rank_sizes_its_pool_to_the_value(monkeypatch, value, expected):
    """The launching process (rank 0 under the CLI) sized its pool at import; the rank resizes it.
    A value torch cannot read leaves the pool as it was (1 thread in the test session)."""
    monkeypatch.setenv("OMP_NUM_THREADS", value)
    assert torch.get_num_threads() == 1
    try:
        cpu.use_rank_threads()
        assert torch.get_num_threads() == expected
    finally:
        torch.set_num_threads(1)  # forked ranks of later tests need a one-thread parent


class RecordThreads(L.Callback):
    def __init__(self, out):
        self.out = out

    def on_train_start(self, trainer, pl_module):
        with open(self.out, "a") as f:
            f.write(f"{torch.get_num_threads()}\n")


def test_each_rank_runs_with_the_chosen_count(tmp_path, monkeypatch):
    """Two forked ranks train with OMP_NUM_THREADS's count (2), while the launching process,
    whose pool was sized at import, keeps its one thread."""
    from toy import fit

    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    fit(tmp_path, devices=2, steps=1, callbacks=(RecordThreads(tmp_path / "threads"),))
    assert (tmp_path / "threads").read_text().split() == ["2", "2"]
    assert torch.get_num_threads() == 1
