"""The multi-node commands of docs/parallelism.md, run on one machine: its torchrun line with one node of 2 CPU
processes on a localhost endpoint, and its srun line under the environment that srun gives 2
tasks of one node (SLURM itself is not available here). Both on configs/quickstart.yaml for 2
steps. Each rank is started by the launcher, not by Lightning: were the launcher's environment
not recognised, every process would start a world of its own and the run would not end cleanly
with exactly two ranks."""

import subprocess

import pytest
from readme import as_python, clean_env, commands, free_port, section, user_dir

pytestmark = pytest.mark.distributed

MULTINODE = "Several nodes: torchrun and SLURM"
PAGE = "parallelism.md"


def adapt(argv: list[str], values: dict[str, str]) -> list[str]:
    """`argv` with the value after each flag replaced; every flag must be in the README's line."""
    argv = list(argv)
    for flag, value in values.items():
        assert flag in argv, f"the README's command has no {flag}: {argv}"
        argv[argv.index(flag) + 1] = value
    return argv


def ranks_started(output: str) -> list[str]:
    return sorted(line.split("GLOBAL_RANK: ")[1].split(",")[0]
                  for line in output.splitlines() if "Initializing distributed: GLOBAL_RANK" in line)


def test_readme_torchrun_on_localhost(tmp_path):
    (readme_argv,) = commands(section(MULTINODE, PAGE), program="torchrun")
    work = user_dir(tmp_path)
    for _ in range(2):  # another process may take the free port before torchrun binds it (seen
        # once in CI: the agent, finding it taken, waited 60 s as a client): once more, a new port
        argv = adapt(readme_argv, {"--nnodes": "1", "--nproc-per-node": "2",
                                   "--rdzv-endpoint": f"localhost:{free_port()}",
                                   "--config": "configs/quickstart.yaml", "--trainer.num_nodes": "1"})
        proc = subprocess.run(as_python(argv) + ["--trainer.max_steps", "2"], cwd=work,
                              env=clean_env(work), capture_output=True, text=True, timeout=300)
        if "RendezvousConnectionError" not in proc.stderr:
            break
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert ranks_started(proc.stdout + proc.stderr) == ["0", "1"]
    ckpt = work / "runs" / "quickstart" / "checkpoints" / "last.ckpt"
    assert sorted(p.name for p in ckpt.glob("rng_*.pt")) == ["rng_0.pt", "rng_1.pt"]


def test_readme_srun_with_tensorboard(tmp_path):
    """The sbatch script's srun line, with the README quickstart's TensorBoard logger flag: the two tasks
    train together and the loss of both steps is in TensorBoard's event file."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (srun,) = commands(section(MULTINODE, PAGE), program="srun")
    argv = adapt(srun[1:], {"--config": "configs/quickstart.yaml", "--trainer.num_nodes": "1"})
    (tensorboard,) = [a for a in commands(section("The main job: quickstart")) if "--trainer.logger" in a]
    argv += tensorboard[tensorboard.index("--trainer.logger"):]
    argv += ["--trainer.max_steps", "2", "--trainer.log_every_n_steps", "1"]
    work = user_dir(tmp_path)
    srun_env = dict(SLURM_NTASKS="2", SLURM_NTASKS_PER_NODE="2", SLURM_NNODES="1", SLURM_NODEID="0",
                    SLURM_JOB_ID="4242", SLURM_JOB_NAME="train.sbatch", SLURM_NODELIST="localhost",
                    MASTER_PORT=str(free_port()))
    tasks = [subprocess.Popen(as_python(argv), cwd=work, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, env=clean_env(work, SLURM_PROCID=str(i), SLURM_LOCALID=str(i), **srun_env))
             for i in range(2)]
    outputs = []
    try:
        for task in tasks:
            outputs.append(task.communicate(timeout=300)[0])
    finally:
        for task in tasks:
            task.kill()
    for task, output in zip(tasks, outputs):
        assert task.returncode == 0, output[-4000:]
    assert ranks_started("".join(outputs)) == ["0", "1"]

    (events,) = (work / "runs" / "quickstart").rglob("events.out.tfevents.*")
    accumulator = EventAccumulator(str(events.parent))
    accumulator.Reload()
    assert [e.step for e in accumulator.Scalars("train/loss")] == [0, 1]
