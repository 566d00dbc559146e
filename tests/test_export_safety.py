"""Nothing lost, nothing foreign run: exports never replace what lightning-mcore did not write,
and checkpoint files are loaded without unpickling code.

The refusals happen before any process group exists, so they run in this process through the
command's own `main`; one successful export per case runs the console command, forked from this
process (the README's tests run it in a fresh interpreter).
"""

import hashlib
import os
from pathlib import Path

import lightning as L
import pytest
import torch
from safetensors.torch import load_file
from torch.utils.data import DataLoader

from lightning_mcore import HFExport, MegatronStrategy, OptimizerSettings, PretrainModule
from lightning_mcore.hf.export_dir import MARKER, ExportTargetError, check_target
from lightning_mcore.export_checkpoint import main as export_main
from lightning_mcore.strategy import checkpoint_io
import forked_process
from toy import ROOT, TokenRows, fit_with_checkpoints, tiny_config

TOKENIZER = ROOT / "configs/sample_data/tokenizer"


def snapshot(path: Path) -> dict:
    """Every file under `path` (or `path` itself) with the hash of its bytes."""
    path = Path(path)
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def strays(directory: Path) -> list:
    return [p.name for p in Path(directory).iterdir() if ".tmp-" in p.name]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A 3-step checkpoint of a tiny model trained on the sample text (the sample tokenizer)."""
    tmp = tmp_path_factory.mktemp("run")
    fit_with_checkpoints(tmp, "x", 1, stop=3, config=tiny_config(vocab_size=512, num_layers=2))
    return tmp


def export(args, capsys) -> tuple:
    """(exit code, stderr) of `lightning-mcore export ARGS` run in this process."""
    with pytest.raises(SystemExit) as info:
        export_main([str(a) for a in args])
    return info.value.code, capsys.readouterr().err


def forked_export(args) -> tuple:
    """(exit code, stdout + stderr) of `lightning-mcore export ARGS` (the command's own `main`) in
    a process forked from this one (forked_process.py): no fresh interpreter's imports, and the
    process group the export starts stays out of this process (later forked ranks would hang on
    what it leaves)."""
    args = [str(a) for a in args]
    result = forked_process.run(lambda: export_main(args), [str(forked_process.CLI), "export", *args])
    return result.returncode, result.stdout + result.stderr


def refused(args, capsys, *names) -> str:
    code, err = export(args, capsys)
    assert code == 2, err
    line = err.strip().splitlines()[-1]
    assert line.startswith("lightning-mcore export: error: "), err
    for name in names:
        assert str(name) in line, line
    return line


# ---------------------------------------------------------------- the export's output
def test_export_refuses_the_checkpoint_directory_and_its_parent(run, capsys):
    ckpts = run / "x-ckpts"
    before = snapshot(ckpts)
    for output in (ckpts / "last.ckpt", ckpts, ckpts / "last.ckpt" / "weights" / "hf"):
        for extra in ([], ["--overwrite"]):
            line = refused(["--checkpoint", ckpts / "last.ckpt", "--output", output, *extra],
                           capsys, output)
            assert "reads from" in line
    assert snapshot(ckpts) == before
    assert not strays(ckpts) and not strays(run)


def test_export_refuses_a_foreign_directory_even_with_overwrite(run, capsys, tmp_path):
    mine = tmp_path / "notes"
    mine.mkdir()
    (mine / "thesis.txt").write_text("weeks of work")
    before = snapshot(mine)
    line = refused(["--checkpoint", run / "x-ckpts/last.ckpt", "--output", mine], capsys, mine, "--overwrite")
    assert "not empty" in line
    line = refused(["--checkpoint", run / "x-ckpts/last.ckpt", "--output", mine, "--overwrite"], capsys, mine, MARKER)
    assert snapshot(mine) == before and not strays(tmp_path)


def test_export_refuses_a_file(run, capsys, tmp_path):
    file = tmp_path / "model.bin"
    file.write_bytes(b"\x00" * 10)
    for extra in ([], ["--overwrite"]):
        line = refused(["--checkpoint", run / "x-ckpts/last.ckpt", "--output", file, *extra], capsys, file)
        assert "not a directory" in line
    assert file.read_bytes() == b"\x00" * 10 and sorted(p.name for p in tmp_path.iterdir()) == ["model.bin"]


def test_export_refuses_the_current_directory(run, capsys, tmp_path, monkeypatch):
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    for output in (".", ".."):
        for extra in ([], ["--overwrite"]):
            line = refused(["--checkpoint", run / "x-ckpts/last.ckpt", "--output", output, *extra],
                           capsys)
            assert "current directory" in line
    assert not list(work.iterdir()) and sorted(p.name for p in tmp_path.iterdir()) == ["work"]


def test_export_writes_then_replaces_only_its_own_export(run, tmp_path, capsys):
    """The console command (forked from this process: the README's tests run it in a fresh
    interpreter): what it prints, the tokenizer it copies, file modes; a second export needs
    --overwrite (refused before any process group: in this process) and then gives the same
    files (the command's `main`, forked)."""
    out = tmp_path / "hf"
    command = [str(forked_process.CLI), "export", "--checkpoint", str(run / "x-ckpts/last.ckpt"), "--output", str(out)]
    first = forked_process.run(forked_process.cli_command, command, cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    files = sorted(p.name for p in out.iterdir())
    assert {"config.json", "model.safetensors", MARKER, "tokenizer.json"} <= set(files)
    assert f"wrote {out}" in first.stdout and all(name in first.stdout for name in files)
    for name in ("tokenizer.json", "tokenizer_config.json"):  # the run's data tokenizer
        assert (out / name).read_bytes() == (TOKENIZER / name).read_bytes()
    assert {oct(p.stat().st_mode & 0o777) for p in out.iterdir()} == {"0o644"}
    weights = load_file(out / "model.safetensors")

    before = snapshot(out)
    code, err = export(command[2:], capsys)
    assert code == 2 and "--overwrite" in err.strip().splitlines()[-1]
    assert snapshot(out) == before
    code, err = forked_export(command[2:] + ["--overwrite"])
    assert code == 0, err[-2000:]
    assert sorted(p.name for p in out.iterdir()) == files
    assert all(torch.equal(weights[k], v) for k, v in load_file(out / "model.safetensors").items())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # no temporary left behind


def test_check_target_accepts_new_and_empty_and_names_what_it_refuses(tmp_path):
    assert check_target(tmp_path / "new") == tmp_path / "new"
    (tmp_path / "empty").mkdir()
    assert check_target(tmp_path / "empty") == tmp_path / "empty"
    (tmp_path / "source").mkdir()
    (tmp_path / "source" / "config.json").write_text("{}")
    with pytest.raises(ExportTargetError, match="reads from"):
        check_target(tmp_path / "source" / "out", overwrite=True, protected=[tmp_path / "source"])


# ---------------------------------------------------------------- HFExport during training
def fit_with_export(tmp_path, steps: int, **export):
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False,
        callbacks=[HFExport(tmp_path / "hf", **export)],
        strategy=MegatronStrategy(global_batch_size=2, micro_batch_size=2, start_method="fork"),
    )
    data = DataLoader(TokenRows(n=8, seq=16, vocab=100), batch_size=2)
    trainer.fit(PretrainModule(tiny_config(num_layers=2, vocab_size=100, seq_length=16),
                               OptimizerSettings(lr=1e-2)), data)


def test_hfexport_refuses_an_earlier_export_before_the_first_step(tmp_path):
    """A rerun finds step=2 from an earlier run (foreign files here): it stops before training,
    and the files are intact; with overwrite=True an earlier *export* is replaced."""
    earlier = tmp_path / "hf" / "step=2"
    earlier.mkdir(parents=True)
    (earlier / "notes.txt").write_text("mine")
    before = snapshot(tmp_path / "hf")
    with pytest.raises(Exception) as info:
        fit_with_export(tmp_path, 2)
    assert "step=2" in str(info.value) and "not empty" in str(info.value)
    assert snapshot(tmp_path / "hf") == before
    with pytest.raises(Exception, match=MARKER):
        fit_with_export(tmp_path, 2, overwrite=True)
    assert snapshot(tmp_path / "hf") == before

    (earlier / "notes.txt").unlink()
    (earlier / MARKER).write_text("{}")  # now an earlier lightning-mcore export
    fit_with_export(tmp_path, 2, overwrite=True)
    assert (earlier / "model.safetensors").is_file() and not (earlier / "notes.txt").exists()
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["step=2"]


def test_hfexport_plans_every_step_it_writes():
    callback = HFExport("x", every_n_train_steps=3)
    assert callback.planned_steps(0, 10) == [3, 6, 9, 10]
    assert callback.planned_steps(4, 10) == [6, 9, 10]  # a resumed run from step 4
    assert HFExport("x", at_end=False, every_n_train_steps=5).planned_steps(0, 10) == [5, 10]


# ---------------------------------------------------------------- no unpickling
class Payload:
    """Unpickling this creates `flag`: proof that loading ran code."""

    def __init__(self, flag: Path) -> None:
        self.flag = str(flag)

    def __reduce__(self):
        return (os.makedirs, (self.flag,))


def crafted_copy(run: Path, tmp_path: Path, name: str) -> Path:
    """A copy of the checkpoint whose file `name` also holds a code-running pickle."""
    import shutil

    copy = tmp_path / "crafted.ckpt"
    shutil.copytree(run / "x-ckpts/last.ckpt", copy)
    content = torch.load(copy / name, weights_only=True)
    content["payload"] = Payload(tmp_path / "PWNED")
    torch.save(content, copy / name)
    return copy


def test_a_pickle_payload_in_common_pt_is_refused_everywhere(run, tmp_path, capsys):
    crafted = crafted_copy(run, tmp_path, checkpoint_io.COMMON)
    line = refused(["--checkpoint", crafted, "--output", tmp_path / "hf"], capsys,
                   crafted / checkpoint_io.COMMON)
    assert "arbitrary code" in line and "os.makedirs" in line, line
    with pytest.raises(checkpoint_io.CheckpointLoadError, match="arbitrary code"):
        PretrainModule(str(crafted))  # `model: DIR`, parsed in the launching process
    with pytest.raises(checkpoint_io.CheckpointLoadError, match="arbitrary code"):
        checkpoint_io.read_common(crafted, tiny_config(vocab_size=512, num_layers=2))  # --ckpt_path
    assert not (tmp_path / "PWNED").exists() and not (tmp_path / "hf").exists()


def test_a_pickle_payload_in_an_rng_file_is_refused(run, tmp_path):
    crafted = crafted_copy(run, tmp_path, "rng_0.pt")
    with pytest.raises(checkpoint_io.CheckpointLoadError, match="rng_0.pt"):
        checkpoint_io.load_rng(crafted, 0)
    assert not (tmp_path / "PWNED").exists()


def test_saving_refuses_what_loading_would_refuse():
    checkpoint_io.strip_for_common({"epoch": 1, "callbacks": {"x": {"best": torch.tensor(1.0)}}}, {})
    with pytest.raises(ValueError, match=r"checkpoint\['callbacks'\]\['Mine'\]\['dir'\] is a pathlib"):
        checkpoint_io.strip_for_common({"callbacks": {"Mine": {"dir": Path("x")}}}, {})


def test_plain_content_round_trips_and_truncation_is_named(tmp_path):
    content = {"a": [1, 2.0, "x", None, (True,)], "t": torch.arange(3), "d": torch.float32}
    checkpoint_io.check_plain(content)
    torch.save(content, tmp_path / "ok.pt")
    loaded = checkpoint_io.load_plain(tmp_path / "ok.pt")
    assert torch.equal(loaded["t"], content["t"]) and loaded["a"] == content["a"]
    (tmp_path / "cut.pt").write_bytes((tmp_path / "ok.pt").read_bytes()[:100])
    with pytest.raises(checkpoint_io.CheckpointLoadError, match="cut.pt cannot be read"):
        checkpoint_io.load_plain(tmp_path / "cut.pt")


def test_fit_refuses_an_earlier_export_before_workers_start(tmp_path, capsys):
    """The CLI finds the HFExport target of a rerun in the launching process: exit 2, one
    `error:` line naming the callback and the directory, nothing written or removed."""
    from lightning_mcore.cli import main

    earlier = tmp_path / "hf" / "step=2"
    earlier.mkdir(parents=True)
    (earlier / "adapter_model.safetensors").write_bytes(b"x")
    before = snapshot(tmp_path)
    with pytest.raises(SystemExit) as info:
        main(["fit", "--config", str(ROOT / "configs/quickstart.yaml"), "--trainer.max_steps", "2",
              "--trainer.logger", "false", "--trainer.callbacks+=lightning_mcore.HFExport",
              f"--trainer.callbacks.dirpath={tmp_path / 'hf'}"])
    err = capsys.readouterr().err
    assert info.value.code == 2
    line = err.strip().splitlines()[-1]
    assert line.startswith("error: trainer.callbacks (HFExport") and "step=2" in line, err[-2000:]
    assert snapshot(tmp_path) == before
