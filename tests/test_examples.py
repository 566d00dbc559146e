"""The examples, run as a user runs them: the scripts as subprocesses, the notebook top to bottom in
a Jupyter kernel. Each checks its results against something computed independently."""

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from toy import assemble, fit, tiny_config

ROOT = Path(__file__).parents[1]
sys.path.insert(0, str(ROOT / "examples"))
from custom_loss import ZLossPretrain  # noqa: E402

# Earlier in-process launches leave these in this process's environment; a child that inherits
# them believes it was launched by torchrun (or is reseeded).
LAUNCH_VARS = {"MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "NODE_RANK", "RANK", "WORLD_SIZE",
               "LOCAL_WORLD_SIZE", "GROUP_RANK", "PL_GLOBAL_SEED", "PL_SEED_WORKERS", "PL_TRAINER_GPUS",
               "TORCHELASTIC_RUN_ID"}


def clean_env(tmp: Path, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               HF_DATASETS_CACHE=str(tmp / "datasets-cache"), **extra)
    # The checkout's package, also when this interpreter's install points elsewhere.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return env


def run_example(script: str, tmp: Path, *args: str) -> list[dict]:
    proc = subprocess.run([sys.executable, f"examples/{script}", *args], cwd=ROOT, env=clean_env(tmp),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return metrics(tmp)


def metrics(directory: Path) -> list[dict]:
    """The rows of the one metrics.csv a CSVLogger wrote under `directory`, floats."""
    (path,) = directory.rglob("metrics.csv")
    return [{k: float(v) for k, v in row.items() if v} for row in csv.DictReader(open(path))]


def losses(rows: list[dict], key: str = "train/loss") -> list[float]:
    return [r[key] for r in rows if key in r]


@pytest.fixture(scope="module")
def train_run(tmp_path_factory):
    """examples/train.py for 20 steps: PretrainModule at TP=2, the reference for the custom loss."""
    tmp = tmp_path_factory.mktemp("train")
    return tmp, run_example("train.py", tmp, "--steps", "20", "--out", str(tmp / "out"))


def test_train_script(train_run):
    tmp, rows = train_run
    loss = losses(rows)
    assert len(loss) == 20 and loss[-1] < loss[0] - 1.0, loss
    export = tmp / "out" / "hf" / "step=20"
    assert (export / "config.json").is_file() and (export / "model.safetensors").is_file()


def test_custom_loss_script(train_run, tmp_path):
    """ZLossPretrain at TP=2: its first step's cross-entropy is PretrainModule's loss on the same
    batch, and its cross-entropy and z-loss equal those computed from transformers' logits of the
    initial weights (full vocabulary, one process) on the first batch."""
    weight = 0.01
    rows = run_example("custom_loss.py", tmp_path, "--steps", "20", "--z-loss-weight", str(weight),
                       "--out", str(tmp_path / "out"), "--dump", str(tmp_path / "dump"))
    loss = losses(rows)
    assert len(loss) == 20 and loss[-1] < loss[0] - 1.0, loss

    first = rows[0]
    assert first["step"] == 0
    pretrain_first = losses(train_run[1])[0]  # same seed, data, model and batch sizes
    assert first["train/ce"] == pytest.approx(pretrain_first, rel=1e-6)
    assert first["train/loss"] == pytest.approx(first["train/ce"] + weight * first["train/z_loss"], rel=1e-6)

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "dump" / "init", dtype=torch.float32).eval()
    batch = torch.load(tmp_path / "dump" / "first_batch.pt")
    with torch.no_grad():
        logits = model(input_ids=batch["tokens"], position_ids=batch["position_ids"]).logits.float()
    mask = batch["loss_mask"].float()
    ce = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), reduction="none").view_as(mask)
    z = torch.logsumexp(logits, dim=-1).square()
    assert first["train/ce"] == pytest.approx(float((ce * mask).sum() / mask.sum()), rel=1e-5)
    assert first["train/z_loss"] == pytest.approx(float((z * mask).sum() / mask.sum()), rel=1e-5)


@pytest.mark.distributed
def test_custom_loss_tp2_trains_like_one_process(tmp_path):
    """The z-loss's gradient under TP=2 (vocab-sharded logits, padded vocab rows) equals the
    single-process one: same losses and the same trained weights. The weight is large so that a
    wrong gradient of the z term (e.g. summed over the TP ranks) changes the updates."""
    kwargs = dict(steps=3, config=tiny_config(), module_cls=ZLossPretrain,
                  module_kwargs={"z_loss_weight": 0.5}, dump_weights=True)
    ref = fit(tmp_path, devices=1, name="ref", **kwargs)
    tp2 = fit(tmp_path, devices=2, name="tp2", tensor_model_parallel_size=2, **kwargs)
    for step, (got, want) in enumerate(zip(tp2, ref)):
        assert abs(got - want) <= 1e-5 * abs(want), f"step {step}: {got} vs {want}"
    ref_init, ref_end = assemble([tmp_path / "ref.init0.pt"]), assemble([tmp_path / "ref.end0.pt"])
    trained = assemble(sorted(tmp_path.glob("tp2.end*.pt")))
    for key, want in ref_end.items():
        assert not torch.equal(want, ref_init[key]), f"{key} was not trained"
        torch.testing.assert_close(trained[key], want, rtol=0, atol=1e-5, msg=key)


def test_notebook(tmp_path):
    """examples/notebook.ipynb top to bottom (it asserts that transformers' greedy tokens from
    the export equal the TP=2 mcore model's); then its logged loss fell, in a new run-N directory
    beside an earlier run's, which it left alone."""
    import nbclient
    import nbformat

    notebook = nbformat.read(ROOT / "examples" / "notebook.ipynb", as_version=4)
    earlier = tmp_path / "nb" / "run-0" / "earlier.txt"  # an earlier run's output: left as it is
    earlier.parent.mkdir(parents=True)
    earlier.write_text("kept")
    client = nbclient.NotebookClient(notebook, timeout=300, kernel_name="python3",
                                     resources={"metadata": {"path": str(ROOT)}})
    client.execute(env=clean_env(tmp_path, NOTEBOOK_OUT=str(tmp_path / "nb")))

    loss = losses(metrics(tmp_path / "nb"))
    assert len(loss) >= 40 and loss[-1] < loss[0] - 1.0, loss
    assert earlier.read_text() == "kept" and sorted(p.name for p in earlier.parent.iterdir()) == ["earlier.txt"]
    check = json.loads((tmp_path / "nb" / "run-1" / "check.json").read_text())
    assert len(check["mcore"]) == 24 and check["transformers"] == check["mcore"], check
