"""The README's main job as a user runs it: its `fit` and `export` commands, read from README.md
and run verbatim in a fresh directory with a copy of configs/. The loss falls; the metrics, the
checkpoint and the export land where the README says; the export is the trained model for
transformers; the console counts steps and gives the whole model's size and FLOPs per token
(checked against transformers' model and torch's FLOP counter); no warning is printed, while a
warning from anyone else's code still is."""

import csv
import re

import pytest
import torch
from readme import ROOT, commands, run, section, user_dir, warnings_in
from test_throughput import counted_training_flops

from lightning_mcore.quiet import HARMLESS, HARMLESS_LINES


@pytest.fixture(scope="module")
def quickstart(tmp_path_factory):
    work = user_dir(tmp_path_factory.mktemp("quickstart"))
    fit, export = [argv for argv in commands(section("The main job: quickstart"))
                   if argv[1] in ("fit", "export") and "--trainer.logger" not in argv]
    return work, run(fit, work), run(export, work)


def test_quickstart_trains_and_loss_falls(quickstart):
    work, _, _ = quickstart
    metrics = work / "runs" / "quickstart" / "lightning_logs" / "version_0" / "metrics.csv"
    rows = list(csv.DictReader(open(metrics)))
    losses = [float(r["train/loss"]) for r in rows if r.get("train/loss")]
    assert len(losses) == 8 and losses[-1] < losses[0] - 2.0, losses
    assert any(r.get("val/loss") for r in rows)
    assert (metrics.parent / "config.yaml").is_file()


def test_checkpoint_and_export_land_where_the_readme_says(quickstart):
    """last.ckpt holds both ranks' shards; the export is the trained model: on the sample text
    transformers' loss is far below that of an untrained model (ln 512 = 6.24)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    work, _, _ = quickstart
    ckpt = work / "runs" / "quickstart" / "checkpoints" / "last.ckpt"
    assert sorted(p.name for p in ckpt.glob("rng_*.pt")) == ["rng_0.pt", "rng_1.pt"]
    model = AutoModelForCausalLM.from_pretrained(work / "runs" / "quickstart" / "hf", dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(ROOT / "configs" / "sample_data" / "tokenizer")
    text = (ROOT / "configs" / "sample_data" / "sample.txt").read_text()[:2000]
    ids = tokenizer(text, return_tensors="pt").input_ids[:, :128]
    with torch.no_grad():
        loss = model(input_ids=ids, labels=ids).loss
    assert loss < 2.5, loss


def test_console_counts_steps_and_the_whole_model(quickstart):
    """No `Epoch 0/-2`, no `v_num`; `step=80/80`. The summary's parameters are those of the exported
    transformers model; its FLOPs per token torch's count for one forward and backward of it."""
    from transformers import AutoModelForCausalLM

    work, fit, _ = quickstart
    console = fit.stdout + fit.stderr
    assert "/-2" not in console and "v_num" not in console and "Total FLOPs" not in console
    assert "step=80/80" in console
    params = int(re.search(r"([\d,]+) parameters", console).group(1).replace(",", ""))
    flops = int(re.search(r"Training FLOPs per token: ([\d,]+) at seq_length 128", console).group(1).replace(",", ""))
    model = AutoModelForCausalLM.from_pretrained(work / "runs" / "quickstart" / "hf", dtype=torch.float32)
    assert params == model.num_parameters()
    model.config._attn_implementation = "eager"  # explicit matmuls over the full s x s scores
    assert flops == pytest.approx(counted_training_flops(model, 128), rel=1e-6)


def test_quickstart_prints_no_warning(quickstart):
    _, fit, export = quickstart
    for proc in (fit, export):
        assert warnings_in(proc.stderr) == [], proc.stderr
        for entry in HARMLESS + HARMLESS_LINES:  # log lines too (mcore 0.19's GPTModel notice)
            assert not re.search(entry.message, proc.stderr)


def test_help_prints_no_warning(tmp_path):
    proc = run(["lightning-mcore", "--help"], tmp_path)
    assert "fit" in proc.stdout and proc.stderr == ""


def test_other_warnings_still_show():
    """The filters are by exact message *and* module: the user's own warning shows, and so does
    a silenced message raised from any module but the one known to raise it."""
    import warnings

    apex = "Apex is not installed. Falling back to Torch Norm"

    def warn() -> None:
        warnings.warn("a real problem")
        warnings.warn_explicit(apex, UserWarning, "user_code.py", 1, module="user_code")
        warnings.warn_explicit(apex, UserWarning, "backends.py", 21, module="megatron.core.models.backends")

    def shown(silenced: bool) -> list[tuple[str, str]]:
        return [(str(w.message), w.filename) for w in caught(warn, silenced)]

    assert [file for _, file in shown(silenced=False)][1:] == ["user_code.py", "backends.py"]
    (mine, _), apex_shown = shown(silenced=True)
    assert mine == "a real problem" and apex_shown == (apex, "user_code.py")  # megatron's own: silenced


def caught(action, silenced: bool) -> list:
    """The warnings `action` gives, every one shown (none filtered), or with quiet.py's filters
    alone when `silenced`."""
    import warnings

    from lightning_mcore import quiet

    with warnings.catch_warnings(record=True) as shown:
        warnings.resetwarnings()
        warnings.simplefilter("always")
        if silenced:
            quiet.install()
        action()
    return shown


def warned(action, silenced: bool) -> list[str]:
    """The messages of `caught(action, silenced)`."""
    return [str(w.message) for w in caught(action, silenced)]


def test_lightning_advice_on_workers_is_silenced(monkeypatch):
    """Where a device has 3 or more CPUs (a user's machine, not CI's 2 cores) Lightning advises
    DataLoader workers for a loader with fewer than 2. It does on this machine when made to see 16
    CPUs for 2 devices, and quiet.py silences exactly that message from that module."""
    import types

    from lightning.pytorch.trainer.connectors import data_connector
    from torch.utils.data import DataLoader

    monkeypatch.setattr(data_connector, "suggested_max_num_workers", lambda devices: 16 // devices - 1)
    trainer, loader = types.SimpleNamespace(num_devices=2), DataLoader(list(range(4)))

    def advice():
        data_connector._worker_check(trainer, loader, "train_dataloader")

    (said,) = warned(advice, silenced=False)
    assert said.startswith("The 'train_dataloader' does not have many workers") and "num_workers=7" in said
    assert warned(advice, silenced=True) == []


def test_torch_cuda_home_notice_is_silenced_only_where_no_gpu_is_missed(monkeypatch, tmp_path):
    """Run on CPU on a machine with CUDA installed (CUDA_VISIBLE_DEVICES=, as the CPU suite runs on
    our GPU machines), torch logs that it finds no CUDA runtime while mcore imports its extension
    builder. quiet.py drops that line where the GPUs are hidden or the machine has no GPU
    driver, and only there."""
    import logging

    import torch
    from torch.utils import cpp_extension

    from lightning_mcore import quiet

    monkeypatch.setenv("CUDA_HOME", str(tmp_path))  # CUDA installed here
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # and no runtime to be found
    monkeypatch.setattr(quiet, "NVIDIA_DRIVER", str(tmp_path))  # on a machine with a GPU driver

    logger, seen = logging.getLogger("torch.utils.cpp_extension"), []
    handler = logging.Handler()  # on the logger itself: torch's loggers do not propagate to root
    handler.emit = lambda record: seen.append(record.getMessage())

    def notices(visible) -> list[str]:
        if visible is None:
            monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
        else:
            monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
        quiet.install()
        seen.clear()
        assert cpp_extension._find_cuda_home() == str(tmp_path)
        return list(seen)

    logger.addHandler(handler)
    try:
        (said,) = notices(None)  # no GPU hidden: torch's line means something, and shows
        assert said.startswith("No CUDA runtime is found") and str(tmp_path) in said
        assert notices("") == [] and notices("-1") == []
        assert notices("0") == [said]  # a GPU asked for and not found
        monkeypatch.setattr(quiet, "NVIDIA_DRIVER", str(tmp_path / "none"))  # a CPU machine
        assert notices(None) == [] and notices("0") == []
    finally:
        logger.removeHandler(handler)
        monkeypatch.undo()
        quiet.install()


def test_torch_checkpoint_notices_of_mcore_019_loads_are_silenced(tmp_path):
    """mcore 0.19 loads a torch_dist checkpoint with `checkpoint.load(state, reader, ...,
    no_dist=True)`, and torch warns twice at each load (every resume and export). Called the same
    way here, torch's own load gives both warnings, quiet.py silences them, and a single-process
    save's warning, which is not ours to hide, still shows."""
    import torch.distributed.checkpoint as dcp


    def save_and_load(where):
        dcp.save({"w": torch.ones(3)}, storage_writer=dcp.FileSystemWriter(where), no_dist=True)
        state = {"w": torch.zeros(3)}
        dcp.load(state, dcp.FileSystemReader(where), no_dist=True)
        assert torch.equal(state["w"], torch.ones(3))

    save, order, load = warned(lambda: save_and_load(tmp_path / "a"), silenced=False)
    assert "intent is to save in a single process" in save and "argument order of load" in order
    assert "intent is to load in a single process" in load
    assert warned(lambda: save_and_load(tmp_path / "b"), silenced=True) == [save]


def test_mcore_gptmodel_notice_is_silenced(tmp_path):
    """mcore 0.19 logs that GPTModel is deprecated each time one is built (rank 0), and GPTModel
    is what we build. A tiny run logs that line once quiet.py's filter is taken off its logger,
    and does not with it."""
    import logging

    from toy import fit

    (line,) = [line for line in HARMLESS_LINES if line.logger == "megatron.core.models.gpt.gpt_model"]
    logger = logging.getLogger(line.logger)
    filters = list(logger.filters)

    def logged(name: str) -> str:
        handler = logging.FileHandler(tmp_path / f"{name}.log")  # a forked rank inherits it
        logger.addHandler(handler)
        try:
            fit(tmp_path, steps=1, name=name)
        finally:
            logger.removeHandler(handler)
            handler.close()
        return (tmp_path / f"{name}.log").read_text()

    quiet = logged("quiet")
    for f in filters:
        logger.removeFilter(f)
    try:
        loud = logged("loud")
    finally:
        for f in filters:
            logger.addFilter(f)
    assert re.search(line.message, loud) and not re.search(line.message, quiet)
