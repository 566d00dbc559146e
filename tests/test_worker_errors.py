"""Acceptance (issue 43, items 5 and 6): what was silently accepted is refused before launch,
and faults only the workers meet end with one `error:` line, not tracebacks.

Before launch (in-process, Trainer.fit forbidden, exit code 2): a YAML key given twice, a second
run in a checkpoint directory another run is writing into, `--ckpt_path last` with nothing to
resume, a checkpoint directory the run cannot write, and `preprocess` on files without the
text field. In the ranks (real 2-rank launches, exit code 1): a NaN gradient norm, a malformed
JSONL line past the records the data modules peek at, and a checkpoint on a full disk. These
ranks start as the CLI starts them on CPU (rank 1 forked from the command's process, rank 0);
the probes of the other launchers (popen, Lightning's fork) are in test_bad_inputs.py.
"""

from __future__ import annotations

import errno
import functools
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import lightning as L
import pytest
import torch
import yaml

from lightning_mcore import GPTConfig
from lightning_mcore.cli import main
from lightning_mcore.data import preprocess
from test_bad_inputs import (MODEL, PRETRAIN_DATA, ROOT, SFT_DATA, TOKENIZER, error_line,  # noqa: F401
                             fake_checkpoint, launch, no_fit, refused, sft_records, snapshot,
                             worker_error, write_config, write_jsonl)


def lines_of(text: str, prefix: str) -> list[int]:
    """The 1-based numbers of the lines of `text` that start with `prefix`."""
    return [number for number, line in enumerate(text.splitlines(), 1) if line.startswith(prefix)]


# --------------------------------------------------------------- a YAML key given twice
def test_yaml_key_given_twice(capsys, tmp_path):
    text = Path(write_config(tmp_path)).read_text()
    assert len(lines_of(text, "  max_steps:")) == 1 and len(lines_of(text, "  precision:")) == 1
    text = text.replace("  max_steps: 2\n", "  max_steps: 3\n")
    text = text.replace("  precision: 32-true\n", "  precision: 32-true\n  max_steps: 7\n")
    config = tmp_path / "twice.yaml"
    config.write_text(text)
    first, second = lines_of(text, "  max_steps:")
    assert yaml.safe_load(text)["trainer"]["max_steps"] == 7  # what YAML alone would train
    line = refused(capsys, tmp_path, str(config))
    assert str(config) in line and "key 'trainer.max_steps' is given twice" in line
    assert f"line {first} and line {second}" in line


def test_yaml_duplicates_inside_lists_are_named_and_merge_keys_are_not_duplicates():
    from lightning_mcore.config_yaml import DuplicateKeyError, refuse_duplicate_keys

    listed = "callbacks:\n  - class_path: A\n    init_args:\n      dirpath: x\n      dirpath: y\n"
    with pytest.raises(DuplicateKeyError, match=r"c\.yaml: key 'callbacks\.0\.init_args\.dirpath' "
                                                r"is given twice \(line 4 and line 5\)"):
        refuse_duplicate_keys(listed, "c.yaml")
    merged = "base: &base\n  lr: 1\n  steps: 2\nrun:\n  <<: *base\n  lr: 3\n"
    refuse_duplicate_keys(merged, "m.yaml")  # `lr` overrides a merged key: YAML's own rule
    assert yaml.safe_load(merged)["run"] == {"lr": 3, "steps": 2}


# --------------------------------------------------------------- --ckpt_path last
def test_ckpt_path_last_without_a_checkpoint(capsys, tmp_path):
    line = refused(capsys, tmp_path, write_config(tmp_path), "--ckpt_path", "last")
    assert "ckpt_path=last: there is no checkpoint to resume in" in line
    assert str(tmp_path / "run") in line and "--ckpt_path last-if-any" in line


@pytest.fixture
def fit_calls(monkeypatch) -> list:
    """The ckpt_path of each Trainer.fit call (which does nothing else)."""
    calls = []

    @functools.wraps(L.Trainer.fit)  # the CLI reads fit's arguments from its signature
    def record(self, *args, **kwargs):
        calls.append(kwargs.get("ckpt_path"))

    monkeypatch.setattr(L.Trainer, "fit", record)
    return calls


def test_ckpt_path_last_if_any(tmp_path, fit_calls):
    """No checkpoint: a fresh run. Two: the newer, as Lightning's "last" picks it (the newest
    `last*.ckpt` by modification time), for `last` as for `last-if-any`."""
    config = write_config(tmp_path)
    main(["fit", "--config", config, "--ckpt_path", "last-if-any"])
    assert fit_calls == [None]
    old = fake_checkpoint(tmp_path / "run" / "last-v1.ckpt", GPTConfig(**MODEL))
    new = fake_checkpoint(tmp_path / "run" / "last.ckpt", GPTConfig(**MODEL))
    os.utime(old, (1e9, 1e9))
    os.utime(new, (2e9, 2e9))
    main(["fit", "--config", config, "--ckpt_path", "last-if-any"])
    main(["fit", "--config", config, "--ckpt_path", "last"])
    assert fit_calls == [None, str(new), str(new)]


# --------------------------------------------------------------- two runs in one directory
def fit_until_killed(config: str, started) -> None:
    """A forked run whose Trainer.fit says so on `started` (a pipe) and sleeps until killed."""
    @functools.wraps(L.Trainer.fit)
    def fit(self, *args, **kwargs):
        started.send("training")
        time.sleep(600)

    L.Trainer.fit = fit
    try:
        main(["fit", "--config", config])
    except BaseException as error:  # noqa: BLE001 - told to the test, which waits for a word
        started.send(repr(error))
    os._exit(1)


def test_a_second_run_in_a_checkpoint_directory_in_use(capsys, monkeypatch, tmp_path):
    """While one run (another process, forked from this one: a fresh interpreter would only add
    its imports) trains into a directory, a second one started there is refused before it
    launches, naming the directory; once the first has ended, however it ended (here
    SIGKILLed, so nothing of it could clean up), a run starts there again."""
    import multiprocessing

    config = write_config(tmp_path)
    context = multiprocessing.get_context("fork")
    receive, send = context.Pipe(duplex=False)
    first = context.Process(target=fit_until_killed, args=(config, send))
    first.start()
    try:
        assert receive.poll(240), "the first run did not reach Trainer.fit"
        started = receive.recv()
        assert started == "training", started
        line = refused(capsys, tmp_path, config)
        assert f"ModelCheckpoint): {tmp_path / 'run'}: another run is writing its checkpoints there" in line
    finally:
        first.kill()
        first.join()
    assert first.exitcode == -9  # SIGKILLed inside fit, holding the directory
    with pytest.raises(AssertionError, match="Trainer.fit must not run"):  # every check passed
        main(["fit", "--config", config])


def test_a_run_in_the_same_process_holds_its_directory_until_it_ends(capsys, tmp_path, fit_calls,
                                                                      monkeypatch):
    """The nested run starts while the outer one is in Trainer.fit: refused; after it, not."""
    config = write_config(tmp_path)
    nested = []

    @functools.wraps(L.Trainer.fit)
    def fit(self, *args, **kwargs):
        if nested:
            return
        with pytest.raises(SystemExit) as exit_info:
            main(["fit", "--config", config])
        nested.append((exit_info.value.code, capsys.readouterr().err))

    monkeypatch.setattr(L.Trainer, "fit", fit)
    main(["fit", "--config", config])
    code, err = nested[0]
    assert code == 2 and "another run is writing its checkpoints there" in error_line(err)
    main(["fit", "--config", config])  # the directory is free again: fit runs (and returns)
    assert len(nested) == 1


# --------------------------------------------------------------- a directory the run cannot write
@pytest.fixture
def read_only(tmp_path):
    """`tmp_path/ro`, a directory nobody can write into: mode 0555, or for root (who may write
    there anyway) a read-only tmpfs."""
    directory = tmp_path / "ro"
    directory.mkdir()
    if os.geteuid() != 0:
        directory.chmod(0o555)
        yield directory
        directory.chmod(0o755)
        return
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(directory)]).returncode:
        pytest.skip("root here, but no read-only tmpfs can be mounted")
    yield directory
    subprocess.run(["umount", str(directory)], check=True)


@pytest.mark.parametrize("where", ["the directory", "its parent"])
def test_checkpoint_directory_not_writable(capsys, tmp_path, read_only, where):
    config = yaml.safe_load(Path(write_config(tmp_path)).read_text())
    dirpath = read_only if where == "the directory" else read_only / "run"
    config["trainer"]["callbacks"][0]["init_args"]["dirpath"] = str(dirpath)
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    line = refused(capsys, tmp_path, str(tmp_path / "config.yaml"))
    assert f"trainer.callbacks (ModelCheckpoint): {dirpath}: " in line
    assert ("Read-only file system" if os.geteuid() == 0 else "Permission denied") in line


# --------------------------------------------------------------- preprocess
def preprocessed(capsys, tmp_path: Path, *files: str) -> str:
    """`lightning-mcore preprocess` of `files` in-process: exit code 2, one error line (returned),
    nothing written."""
    before = snapshot(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        preprocess.main(["--input", *files, "--tokenizer", TOKENIZER,
                         "--output-prefix", str(tmp_path / "out" / "corpus")])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err[-3000:]
    assert snapshot(tmp_path) == before
    return error_line(err)


def test_preprocess_without_the_text_field(capsys, tmp_path):
    path = write_jsonl(tmp_path / "docs.jsonl", [{"body": f"Document {i}."} for i in range(3)])
    line = preprocessed(capsys, tmp_path, path)
    assert "--text-field text: field 'text' not found in" in line and path in line and "['body']" in line


def test_preprocess_malformed_line_past_the_first_records(capsys, tmp_path):
    path = tmp_path / "docs.jsonl"
    lines = [json.dumps({"text": f"Document {i}."}) for i in range(150)]
    lines[129] = '{"text": "cut off'
    path.write_text("\n".join(lines) + "\n")
    line = preprocessed(capsys, tmp_path, str(path))
    assert f"'{path}' line 130 is not valid JSON" in line


# --------------------------------------------------------------- faults only the workers meet
@pytest.mark.distributed
def test_nan_gradient_norm(tmp_path):
    """lr=1e30: the first update overflows the weights, the second step's gradient norm is NaN."""
    result = launch(write_config(tmp_path), "--model.init_args.optim.lr", "1e30", "--trainer.max_steps", "4")
    line = worker_error(result)
    assert line.startswith("error: non-finite ") and "the update was not applied" in line
    assert not any((tmp_path / "run").glob("*.ckpt"))  # nothing saved from the diverged run


@pytest.mark.distributed
def test_malformed_jsonl_line_past_the_first_records(tmp_path):
    """Line 120 of a chat file is cut off: past the 100 records the data module reads before
    launch, so only the ranks meet it."""
    path = tmp_path / "chat.jsonl"
    lines = [json.dumps(record) for record in sft_records() * 9]
    lines.insert(119, '{"messages": [{"role": "user", "content": "cut off')
    path.write_text("\n".join(lines) + "\n")
    data = json.loads(json.dumps(SFT_DATA))
    data["init_args"]["paths"] = str(path)
    line = worker_error(launch(write_config(tmp_path, data, "SFTModule")))
    assert f"'{path}' line 120 is not valid JSON" in line
    assert not line.startswith("error: (rank")


@pytest.fixture
def small_disk(tmp_path, request):
    """`tmp_path/run` on a tmpfs of `request.param` bytes (needs root)."""
    directory = tmp_path / "run"
    directory.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={request.param}", "tmpfs", str(directory)],
                             capture_output=True)
    if mounted.returncode:
        pytest.skip(f"cannot mount a small tmpfs here ({mounted.stderr.decode().strip()})")
    yield directory
    subprocess.run(["umount", str(directory)], check=True)


def save_checkpoint(checkpoint: dict, filepath: str, write) -> None:
    """Like Trainer.save_checkpoint, `filepath` written by `write(checkpoint)`."""
    write(checkpoint)


def write_bytes(checkpoint: dict, device: str) -> None:
    with open(device, "wb", buffering=0) as file:
        file.write(str(checkpoint).encode())


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full")
def test_full_disk_errors_without_a_mount(tmp_path):
    """Where no small disk can be mounted: /dev/full refuses every write with ENOSPC. Python's
    OSError and torch's short write ('unexpected pos', no errno) name the checkpoint being saved;
    the short write is called a full disk only where its disk has little room left."""
    from lightning_mcore.refusals import FULL_BELOW_BYTES, refusal_message

    target = str(tmp_path / "epoch=0-step=2.ckpt")
    free = shutil.disk_usage(tmp_path).free
    with pytest.raises(OSError) as full:
        save_checkpoint({"step": 2}, target, lambda c: write_bytes(c, "/dev/full"))
    assert full.value.errno == errno.ENOSPC
    assert re.fullmatch(rf"cannot write {re.escape(target)}: the disk is full \(No space left on "
                        rf"device; \d+ bytes free on it\)\. Free space there or write the "
                        rf"checkpoints elsewhere \(ModelCheckpoint's dirpath\)\.", refusal_message(full.value))
    with pytest.raises(RuntimeError, match="unexpected pos") as short:
        save_checkpoint({"x": torch.zeros(1000)}, target, lambda c: torch.save(c, "/dev/full"))
    line = refusal_message(short.value)
    assert line.startswith(f"cannot write {target}: ")
    assert ("the disk is full" in line) == (free < FULL_BELOW_BYTES)


@pytest.mark.distributed
@pytest.mark.parametrize("small_disk", [1 << 20], indirect=True)
def test_checkpoint_directory_turned_read_only_during_the_run(tmp_path, small_disk):
    """Writable at launch (so not refused there), remounted read-only once training starts."""
    config = yaml.safe_load(Path(write_config(tmp_path)).read_text())
    config["trainer"]["callbacks"].append({"class_path": "worker_faults.RemountReadOnly"})
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    line = worker_error(launch(str(tmp_path / "config.yaml")))
    assert f"cannot write {small_disk}/" in line and "Read-only file system" in line


@pytest.mark.distributed
@pytest.mark.parametrize("small_disk", [4096, 256 * 1024], indirect=True,
                         ids=["torch.save fails", "a shard fails"])
def test_checkpoint_on_a_full_disk(tmp_path, small_disk):
    """4 KiB: the first file of the checkpoint does not fit (torch's writer says only
    `unexpected pos`); 256 KiB: the weight shards do not (mcore's workers: `[Errno 28]`)."""
    line = worker_error(launch(write_config(tmp_path)))
    assert f"cannot write {small_disk}/" in line and "the disk is full" in line


@pytest.mark.parametrize("start", ["popen", "fork"])
def test_rank_zero_learns_of_another_ranks_refusal_under_either_launcher(start):
    """Lightning's subprocess launcher keeps Popen objects, its fork launcher multiprocessing
    Processes: rank 0 reads the exit code of either (a Process has no poll(), which turned
    verify --start_method fork's one-line refusal into a traceback)."""
    import multiprocessing
    import types

    from lightning_mcore.refusals import REFUSED_EXIT, _another_rank_refused

    if start == "popen":
        proc = subprocess.Popen([sys.executable, "-c", f"raise SystemExit({REFUSED_EXIT})"])
        proc.wait()
    else:
        proc = multiprocessing.get_context("fork").Process(target=os._exit, args=(REFUSED_EXIT,))
        proc.start()
        proc.join()
    assert _another_rank_refused(types.SimpleNamespace(procs=[proc]), wait_s=0.5)
