"""Acceptance (checkpoints): resume is exact, resharding works, bad ckpt_path fails clearly."""

import os
import signal
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from forked_process import ForkedProcess, script
from lightning_mcore.strategy.checkpoint_io import CheckpointOptions
from process_state import leaves_no_process_state
from toy import fit_with_checkpoints as run
from toy import tiny_config

DP2 = dict(tensor_model_parallel_size=1)  # DP=2, each rank its own data slice


def straight_run(tmp_path_factory, devices: int, **layout) -> tuple:
    """An uninterrupted 6-step run that the resumed ones are held to: (rank 0's losses, its
    directory). Trained once per module (its checkpoints are only read)."""
    tmp = tmp_path_factory.mktemp(f"straight{devices}")
    with leaves_no_process_state():  # module-scoped: the per-test cleanup does not cover it
        return run(tmp, "straight", devices, **layout), tmp


@pytest.fixture(scope="module")
def straight1(tmp_path_factory) -> tuple:
    return straight_run(tmp_path_factory, 1)


@pytest.fixture(scope="module")
def straight_dp2(tmp_path_factory) -> tuple:
    return straight_run(tmp_path_factory, 2, **DP2)


@pytest.mark.distributed
def test_resume_continues_exactly_with_data_parallel(tmp_path, straight_dp2):
    layout = DP2
    straight = straight_dp2[0]
    first = run(tmp_path, "first", 2, stop=3, **layout)
    assert first == straight[:3]
    saved = tmp_path / "first-ckpts" / "epoch=0-step=3.ckpt"
    assert (saved / "common.pt").is_file()
    resumed = run(tmp_path, "resumed", 2, ckpt_path=str(saved), **layout)
    assert len(resumed) == 3
    for got, want in zip(resumed, straight[3:]):
        assert abs(got - want) <= 1e-7, (resumed, straight[3:])


@pytest.mark.distributed
def test_async_save_resumes_exactly(tmp_path, straight_dp2):
    """The shards are written by a forked process; the directory appears once all are done."""
    layout = DP2
    straight = straight_dp2[0]
    run(tmp_path, "first", 2, stop=3, checkpoint=CheckpointOptions(async_save=True), **layout)
    saved = tmp_path / "first-ckpts" / "epoch=0-step=3.ckpt"
    assert sorted(p.name for p in saved.iterdir()) == ["common.pt", "rng_0.pt", "rng_1.pt", "weights"]
    assert not list((tmp_path / "first-ckpts").glob(".tmp-*"))
    resumed = run(tmp_path, "resumed", 2, ckpt_path=str(saved), **layout)
    for got, want in zip(resumed, straight[3:]):
        assert abs(got - want) <= 1e-7, (resumed, straight[3:])


@pytest.mark.distributed
def test_checkpoint_without_optimizer_and_rng(tmp_path, straight1):
    """save_optimizer/save_rng=False leave those out; resuming warns and starts a fresh
    optimizer: step 4's loss (weights after step 3) matches the straight run, step 5's (after
    an update from fresh Adam moments) does not."""
    from megatron.core import dist_checkpointing

    straight = straight1[0]
    lean = CheckpointOptions(save_optimizer=False, save_rng=False)
    first = run(tmp_path, "first", 1, stop=3, checkpoint=lean)
    assert first == straight[:3]
    saved = tmp_path / "first-ckpts" / "epoch=0-step=3.ckpt"
    assert sorted(p.name for p in saved.iterdir()) == ["common.pt", "weights"]
    keys = dist_checkpointing.load_tensors_metadata(str(saved / "weights"))
    assert keys and not [k for k in keys if k.startswith("optimizer")]
    resumed = run(tmp_path, "resumed", 1, ckpt_path=str(saved))  # warns: fresh optimizer
    assert len(resumed) == 3 and abs(resumed[0] - straight[3]) <= 1e-7
    assert abs(resumed[1] - straight[4]) > 1e-5


@pytest.mark.distributed
def test_checkpoint_from_tp2_pp2_resumes_at_tp1_and_pp2(tmp_path):
    big = dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    straight = run(tmp_path, "straight", 4, **big)
    saved = str(tmp_path / "straight-ckpts" / "epoch=0-step=3.ckpt")  # its own step-3 checkpoint
    for name, devices, layout in (("tp1", 1, {}), ("pp2", 2, dict(pipeline_model_parallel_size=2))):
        resumed = run(tmp_path, name, devices, ckpt_path=saved, **layout)
        for got, want in zip(resumed, straight[3:]):
            assert abs(got - want) <= 1e-5 * abs(want), (name, resumed, straight[3:])


@pytest.mark.distributed
def test_bad_ckpt_paths_are_refused_clearly(tmp_path, straight1):
    saved = straight1[1] / "straight-ckpts" / "epoch=0-step=3.ckpt"  # a real checkpoint (step 3)
    not_ckpt = tmp_path / "plain"
    not_ckpt.mkdir()
    cases = [
        (tmp_path / "missing.ckpt", tiny_config(vocab_size=512), "does not exist"),
        (not_ckpt, tiny_config(vocab_size=512), "is not a MegatronStrategy checkpoint"),
        (saved, tiny_config(vocab_size=512, ffn_hidden_size=96),
         "different model config: ffn_hidden_size: checkpoint 128 vs model 96"),
    ]
    for path, config, message in cases:
        with pytest.raises(Exception) as info:
            run(tmp_path, "bad", 1, ckpt_path=str(path), config=config)
        assert message in str(info.value), str(info.value)[-500:]
        assert not dist.is_initialized()


@pytest.mark.distributed
@pytest.mark.parametrize("point", ["writing", "renaming"])
def test_sigkill_mid_save_resumes_from_previous_checkpoint(tmp_path, point, straight1):
    """A run is SIGKILLed inside the step-6 save; `ckpt_path="last"` then finds the complete
    step-3 checkpoint (never the partial one) and steps 4-6 repeat the uninterrupted run."""
    straight = straight1[0]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent),
                                                        os.environ.get("PYTHONPATH", "")])}
    crash = str(Path(__file__).parent / "crash_during_save.py")  # forked: one rank, nothing to launch
    child = ForkedProcess(script(crash), [crash, str(tmp_path), point], env=env, start_new_session=True)
    deadline = time.monotonic() + 240
    while not (tmp_path / "frozen").exists():
        assert child.poll() is None and time.monotonic() < deadline, "child ended before the save"
        time.sleep(0.05)
    os.killpg(child.pid, signal.SIGKILL)
    child.wait()
    ckpts = tmp_path / "crash-ckpts"
    assert list(ckpts.glob(".tmp-*")), "the interrupted save left its temporary directory"
    assert (ckpts / "last.ckpt" / "common.pt").is_file()
    (ckpts.parent / "resumed-ckpts").symlink_to(ckpts)  # the resumed run's ModelCheckpoint dir
    resumed = run(tmp_path, "resumed", 1, ckpt_path="last")
    assert len(resumed) == 3
    for got, want in zip(resumed, straight[3:]):
        assert abs(got - want) <= 1e-7, (point, resumed, straight[3:])
