"""Acceptance (issue 43, item 1): no file of a checkpoint a user hands us runs code.

Each probe plants a payload (a pickle whose loading would create a marker directory) in one
file of a real checkpoint, then reads the checkpoint through every door a user has: `fit
--ckpt_path`, `model: CKPT_DIR`, `export --checkpoint`, and the ranks' loader. The marker must
stay absent and the refusal name the file (and the blocked global).
"""

from __future__ import annotations

import io
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from lightning_mcore.cli import main
from lightning_mcore.strategy import checkpoint_io
from lightning_mcore.strategy.safe_files import check_extra_state, read_dcp_metadata
from test_bad_inputs import error_line, no_fit, refused, write_config  # noqa: F401 (fixture)
from toy import fit_with_checkpoints, tiny_config


class Payload:
    """Unpickling this creates `marker` (os.mkdir): code a crafted file would run."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A real checkpoint of the tiny model (3 steps, one process)."""
    tmp = tmp_path_factory.mktemp("safety")
    fit_with_checkpoints(tmp, "a", devices=1, stop=3)
    return tmp / "a-ckpts" / "epoch=0-step=3.ckpt"


def copy(saved: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(saved, tmp_path / "crafted.ckpt"))


def plant_in_metadata(ckpt: Path, marker: Path) -> None:
    """The checkpoint's own dcp metadata, with the payload in one of its fields."""
    metadata = read_dcp_metadata(ckpt / "weights" / ".metadata")
    metadata.planner_data = Payload(marker)
    (ckpt / "weights" / ".metadata").write_bytes(pickle.dumps(metadata))


def plant_in_bytes_entry(ckpt: Path, value) -> str:
    """`value` pickled as the bytes of one `_extra_state` entry (appended to its shard file, the
    metadata pointing there); returns the entry's key."""
    index = ckpt / "weights" / ".metadata"
    metadata = read_dcp_metadata(index)
    where = next(k for k in metadata.storage_data if "_extra_state/shard_0_" in k.fqn)
    info = metadata.storage_data[where]
    data = pickle.dumps(value) if isinstance(value, Payload) else _torch_bytes(value)
    shard = ckpt / "weights" / info.relative_path
    offset = shard.stat().st_size
    with open(shard, "ab") as stream:
        stream.write(data)
    info.offset, info.length = offset, len(data)
    index.write_bytes(pickle.dumps(metadata))
    return where.fqn


def _torch_bytes(value) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def export_refused(capsys, ckpt: Path, tmp_path: Path) -> str:
    with pytest.raises(SystemExit) as info:
        main(["export", "--checkpoint", str(ckpt), "--output", str(tmp_path / "hf")])
    err = capsys.readouterr().err
    assert info.value.code == 2, err[-3000:]
    assert not (tmp_path / "hf").exists()
    return [line for line in err.splitlines() if "error:" in line][-1]


def test_crafted_metadata_runs_no_code_through_any_door(capsys, tmp_path, saved):
    ckpt, marker = copy(saved, tmp_path), tmp_path / "ran"
    plant_in_metadata(ckpt, marker)
    index = ckpt / "weights" / ".metadata"
    lines = [refused(capsys, tmp_path, write_config(tmp_path), "--ckpt_path", str(ckpt)),
             refused(capsys, tmp_path, write_config(tmp_path, model=str(ckpt))),
             export_refused(capsys, ckpt, tmp_path)]
    with pytest.raises(checkpoint_io.CheckpointLoadError) as info:  # a rank's loader
        checkpoint_io.load_model(ckpt, [])
    lines.append(str(info.value))
    assert not marker.exists()
    for line in lines:
        assert f"{index} holds the Python global posix.mkdir" in line, line
        assert "could run arbitrary code" in line, line


def test_payload_in_a_sharded_object_runs_no_code(capsys, tmp_path, saved):
    """dcp's planner reads a sharded object's bytes with torch.load(weights_only=False)."""
    ckpt, marker = copy(saved, tmp_path), tmp_path / "ran"
    key = plant_in_bytes_entry(ckpt, Payload(marker))
    line = export_refused(capsys, ckpt, tmp_path)
    assert not marker.exists()
    assert f"(entry {key!r}) holds Python objects other than tensors" in line, line
    assert str(ckpt / "weights") in line


def test_crafted_mcore_common_pt_is_refused_by_name(capsys, tmp_path, saved):
    ckpt, marker = copy(saved, tmp_path), tmp_path / "ran"
    (ckpt / "weights" / "common.pt").write_bytes(pickle.dumps(Payload(marker)))
    line = refused(capsys, tmp_path, write_config(tmp_path), "--ckpt_path", str(ckpt))
    assert not marker.exists()
    assert f"{ckpt / 'weights' / 'common.pt'} holds Python objects other than tensors" in line, line


def test_non_empty_extra_state_is_refused_before_transformer_engine_unpickles_it(capsys, tmp_path, saved):
    """A tensor passes torch's weights-only reader, but TE's set_extra_state would run
    pickle.loads on its bytes (FP8 state): we never save one, so it is refused."""
    ckpt = copy(saved, tmp_path)
    state = torch.frombuffer(bytearray(pickle.dumps({"scale": 1.0})), dtype=torch.uint8)
    key = plant_in_bytes_entry(ckpt, [state])  # mcore stores a list of the objects' data
    line = export_refused(capsys, ckpt, tmp_path)
    name = key.split("/")[0].split(".")[-2]  # e.g. linear_proj
    assert f"{ckpt / 'weights'} holds a non-empty " in line and f"{name}._extra_state (Tensor)" in line, line
    assert "Transformer Engine would unpickle" in line, line


def test_what_we_save_passes_the_checks(saved):
    """The checks refuse nothing our own checkpoints hold (the loads above fail only where
    planted): every door reads the untouched checkpoint."""
    checkpoint_io.read_saved_model(saved)
    check_extra_state({"layer._extra_state": None, "te._extra_state": torch.empty(0, dtype=torch.uint8),
                       "weight": torch.ones(2)}, saved / "weights")
    config = tiny_config(vocab_size=512)
    checkpoint_io.read_common(saved, config)
