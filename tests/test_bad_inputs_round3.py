"""Acceptance (issue 43, items 3, 5, 7 and 10): what must not be lost, silently accepted, misnamed
or refused where transformers computes it.

- `export --overwrite` replaces only what an earlier export wrote: a file the user put in the
  directory (also reached through a symlink) stops it, named, with everything left in place.
- KTO data of one kind, `export --source` that is not there and a `preprocess` prefix without a
  file name are refused before anything runs.
- The GRPO prompt length is named by the prompt data's own key; an MLP or expert width that
  tensor (or expert-tensor) parallelism cannot split is refused before launch, exactly where
  mcore's own layers refuse it (checked by building them on 2 ranks).
- Qwen3-VL's mrope_section is read as transformers reads it (logits against transformers'),
  and a Qwen2.5-VL section transformers cannot use is refused before launch.

In-process CLI probes as in test_bad_inputs.py (Trainer.fit forbidden, exit 2, one `error:` line,
files unchanged).
"""

from __future__ import annotations

import json
import multiprocessing
import traceback
from pathlib import Path

import pytest
import torch

from lightning_mcore.export_checkpoint import main as export_main
from lightning_mcore.hf.export_dir import MARKER, ExportTargetError, check_target
from test_bad_inputs import (  # noqa: F401 - no_fit: Trainer.fit is forbidden here too
    MODEL,
    SAMPLES,
    TOKENIZER,
    error_line,
    no_fit,
    refused,
    snapshot,
    write_config,
    write_jsonl,
)
from toy import fit_with_checkpoints, tiny_config


# ---------------------------------------------------------------- item 3: export --overwrite
@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A 3-step checkpoint of a tiny model on the sample text (set up before no_fit applies)."""
    tmp = tmp_path_factory.mktemp("run")
    fit_with_checkpoints(tmp, "x", 1, stop=3, config=tiny_config(vocab_size=512, num_layers=2))
    return tmp / "x-ckpts" / "last.ckpt"


def export(capsys, *args) -> tuple:
    """(exit code, stderr) of `lightning-mcore export ARGS` run in this process."""
    try:
        export_main([str(a) for a in args])
        code = 0
    except SystemExit as stop:
        code = stop.code
    return code, capsys.readouterr().err


def export_refused(capsys, *args) -> str:
    code, err = export(capsys, *args)
    assert code == 2, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    line = err.strip().splitlines()[-1]
    assert line.startswith("lightning-mcore export: error: "), err[-3000:]
    return line


def add_user_files(directory: Path) -> None:
    (directory / "notes.txt").write_text("my notes on this model")
    (directory / "eval").mkdir()
    (directory / "eval" / "results.json").write_text('{"accuracy": 0.71}')


def test_overwrite_refuses_files_the_export_did_not_write(checkpoint, tmp_path, capsys):
    out = tmp_path / "hf"
    assert export(capsys, "--checkpoint", checkpoint, "--output", out)[0] == 0
    written = snapshot(out)
    add_user_files(out)
    before = snapshot(out)
    line = export_refused(capsys, "--checkpoint", checkpoint, "--output", out, "--overwrite")
    assert str(out / "eval" / "results.json") in line, line  # the first one, in sorted order
    assert "did not write" in line and "move" in line, line
    assert snapshot(out) == before  # both user files intact, the export's own too
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # no temporary left

    # without them, --overwrite replaces the earlier export as before
    (out / "notes.txt").unlink()
    (out / "eval" / "results.json").unlink()
    (out / "eval").rmdir()
    assert export(capsys, "--checkpoint", checkpoint, "--output", out, "--overwrite")[0] == 0
    assert snapshot(out).keys() == written.keys()
    listed = json.loads((out / MARKER).read_text())["files"]
    assert sorted(listed) == sorted(k for k in written if k != MARKER)


def test_overwrite_through_a_symlink_refuses_the_same(checkpoint, tmp_path, capsys):
    real, link = tmp_path / "exports" / "hf", tmp_path / "hf"
    real.parent.mkdir()
    link.symlink_to(real, target_is_directory=True)
    assert export(capsys, "--checkpoint", checkpoint, "--output", link)[0] == 0
    assert link.is_symlink() and (real / MARKER).is_file()
    add_user_files(real)
    before = snapshot(real)
    line = export_refused(capsys, "--checkpoint", checkpoint, "--output", link, "--overwrite")
    assert "results.json" in line, line
    assert snapshot(real) == before and link.is_symlink()

    (real / "eval" / "results.json").unlink()
    (real / "eval").rmdir()
    (real / "notes.txt").unlink()
    assert export(capsys, "--checkpoint", checkpoint, "--output", link, "--overwrite")[0] == 0
    assert link.is_symlink() and link.resolve() == real.resolve() and (real / "config.json").is_file()


def test_an_old_marker_without_a_file_list_is_replaced_only_when_it_holds_export_files(tmp_path):
    """An export from before the list: only names an export writes (config, weights and their
    index, tokenizer and processor files), no subdirectory, may be replaced."""
    old = tmp_path / "old"
    old.mkdir()
    (old / MARKER).write_text(json.dumps({"written_by": "lightning-mcore", "format": "transformers"}))
    for name in ("config.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                 "model.safetensors.index.json", "tokenizer.json", "generation_config.json"):
        (old / name).write_text("x")
    assert check_target(old, overwrite=True) == old.resolve()
    (old / "eval").mkdir()
    (old / "eval" / "results.json").write_text("{}")
    with pytest.raises(ExportTargetError, match=f"{old / 'eval' / 'results.json'}.*did not write"):
        check_target(old, overwrite=True)
    (old / "eval" / "results.json").unlink()
    (old / "eval").rmdir()
    (old / "model-notes.md").write_text("mine")
    with pytest.raises(ExportTargetError, match="model-notes.md"):
        check_target(old, overwrite=True)


# ---------------------------------------------------------------- item 5: silent acceptance
def kto_records() -> list:
    return [json.loads(line) for line in (SAMPLES / "kto.jsonl").read_text().splitlines()]


def kto_data(path: str, seq_length: int = 32) -> dict:
    return {"class_path": "lightning_mcore.data.KTODataModule",
            "init_args": {"paths": path, "tokenizer": TOKENIZER, "seq_length": seq_length,
                          "chat_template": "chatml"}}


@pytest.mark.parametrize("desirable", [True, False])
def test_kto_data_of_one_kind_is_refused_before_launch(capsys, tmp_path, desirable):
    """trl's KTOTrainer refuses it too: with one kind only, `rewards/rejected` (or chosen) would
    be logged as 0.0 for a kind that is never seen."""
    records = [r for r in kto_records() if r["label"] is desirable]
    path = write_jsonl(tmp_path / "kto.jsonl", records)
    line = refused(capsys, tmp_path, write_config(tmp_path, kto_data(path), "KTOModule"))
    kind = "desirable" if desirable else "undesirable"
    assert path in line and f"only {kind} examples ({len(records)})" in line, line
    assert "desirable (label true) and undesirable (label false)" in line, line


@pytest.mark.parametrize("form", ["parquet", "saved", "json_array"])
def test_kto_data_of_one_kind_is_refused_in_every_file_form(tmp_path, form):
    import datasets

    from lightning_mcore.data import KTODataModule

    records = [dict(r, thumbs_up=r.pop("label")) for r in kto_records() if not r["label"]]
    table = datasets.Dataset.from_list(records)
    path = {"parquet": tmp_path / "kto.parquet", "saved": tmp_path / "kto", "json_array": tmp_path / "kto.json"}[form]
    if form == "parquet":
        table.to_parquet(str(path))
    elif form == "saved":
        table.save_to_disk(str(path))
    else:
        path.write_text(json.dumps(records))
    with pytest.raises(ValueError, match=f"{path}: .*only undesirable examples \\({len(records)}\\)"):
        KTODataModule(str(path), TOKENIZER, 256, columns={"label": "thumbs_up"}, chat_template="chatml")
    mixed = [dict(r, thumbs_up=r.pop("label")) for r in kto_records()]
    datasets.Dataset.from_list(mixed).to_parquet(str(tmp_path / "mixed.parquet"))
    KTODataModule(str(tmp_path / "mixed.parquet"), TOKENIZER, 256, columns={"label": "thumbs_up"},
                  chat_template="chatml")


def test_kto_training_split_of_one_kind_is_refused_at_setup(tmp_path):
    """Undesirable completions too long for the rows are dropped: what is left is one kind."""
    from lightning_mcore.data import KTODataModule

    good = [r for r in kto_records() if r["label"]][:3]
    long = [dict(r, completion=" ".join([r["completion"]] * 40)) for r in kto_records() if not r["label"]][:2]
    path = write_jsonl(tmp_path / "kto.jsonl", good + long)  # both kinds: __init__ accepts it
    data = KTODataModule(path, TOKENIZER, 256, chat_template="chatml", cache_dir=str(tmp_path / "cache"))
    with pytest.raises(ValueError, match=r"kto.jsonl: .*only desirable examples \(2\) are left for "
                                         r"training .*seq_length=256"):
        data.setup("fit")


def test_export_source_that_is_not_a_directory_is_refused(checkpoint, tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    for source in (tmp_path / "missing", tmp_path / "file"):
        line = export_refused(capsys, "--checkpoint", checkpoint, "--output", tmp_path / "hf",
                              "--source", source)
        assert f"--source {source}" in line and "not a directory" in line, line
    assert not (tmp_path / "hf").exists()


def test_preprocess_prefix_without_a_file_name_is_refused(tmp_path, capsys):
    from lightning_mcore.data.preprocess import main as preprocess_main

    (tmp_path / "data").mkdir()
    for prefix in (f"{tmp_path / 'data'}/", f"{tmp_path / 'data'}/.", f"{tmp_path / 'data'}/.."):
        with pytest.raises(SystemExit) as stop:
            preprocess_main(["--input", str(SAMPLES / "sample.txt"), "--tokenizer", TOKENIZER,
                             "--output-prefix", prefix])
        assert stop.value.code == 2
        line = error_line(capsys.readouterr().err)
        assert f"--output-prefix {prefix}" in line and "file name" in line, line
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == [Path("data")]


# ---------------------------------------------------------------- item 7: the right key
def test_grpo_prompt_length_names_the_prompt_data_key(capsys, tmp_path):
    from test_grpo import write_config as grpo_config

    line = refused(capsys, tmp_path, grpo_config(tmp_path, max_prompt_length=80))
    assert "data.init_args.max_prompt_length=80" in line, line
    assert "seq_length=64" in line and "data.init_args.seq_length" not in line, line


def test_mlp_width_not_divisible_by_tensor_parallel_is_refused(capsys, tmp_path):
    line = refused(capsys, tmp_path, write_config(tmp_path, model=dict(MODEL, ffn_hidden_size=129)))
    assert "invalid parallel layout" in line and "ffn_hidden_size (129)" in line, line
    assert "model.init_args.model.ffn_hidden_size=129" in line, line
    assert "trainer.strategy.init_args.tensor_model_parallel_size=2" in line, line


def test_expert_width_not_divisible_by_expert_tensor_parallel_is_refused(capsys, tmp_path):
    moe = dict(MODEL, num_moe_experts=4, moe_ffn_hidden_size=63, moe_router_topk=2)
    line = refused(capsys, tmp_path, write_config(tmp_path, model=moe),
                   "--trainer.strategy.init_args.sequence_parallel", "true")
    assert "moe_ffn_hidden_size (63)" in line, line
    assert "model.init_args.model.moe_ffn_hidden_size=63" in line, line
    assert "trainer.strategy.init_args.tensor_model_parallel_size=2" in line, line


# What mcore's own layers do with each shape on 2 ranks: (model fields, parallel sizes).
WIDTHS = {
    "dense_even": (dict(ffn_hidden_size=128), dict(tensor_model_parallel_size=2)),
    "dense_odd": (dict(ffn_hidden_size=129), dict(tensor_model_parallel_size=2)),
    "experts_even_dense_unused": (dict(ffn_hidden_size=129, num_moe_experts=4, moe_ffn_hidden_size=64),
                                  dict(tensor_model_parallel_size=2, sequence_parallel=True)),
    "experts_odd_etp_is_tp": (dict(num_moe_experts=4, moe_ffn_hidden_size=63),
                              dict(tensor_model_parallel_size=2, sequence_parallel=True)),
    "experts_odd_etp1": (dict(num_moe_experts=4, moe_ffn_hidden_size=63),
                         dict(tensor_model_parallel_size=2, sequence_parallel=True,
                              expert_tensor_parallel_size=1)),
    "experts_odd_etp2_tp1": (dict(num_moe_experts=4, moe_ffn_hidden_size=63),
                             dict(expert_tensor_parallel_size=2)),
    "first_layer_dense_odd": (dict(ffn_hidden_size=129, num_moe_experts=4, moe_ffn_hidden_size=64,
                                   moe_layer_freq=[0, 1]),
                              dict(tensor_model_parallel_size=2, sequence_parallel=True)),
    "shared_expert_odd": (dict(num_moe_experts=4, moe_ffn_hidden_size=64,
                               moe_shared_expert_intermediate_size=63),
                          dict(tensor_model_parallel_size=2, sequence_parallel=True)),
}


def width_config(fields: dict):
    return tiny_config(num_layers=2, moe_router_topk=2, **fields) if "num_moe_experts" in fields \
        else tiny_config(num_layers=2, **fields)


def _build_on_rank(rank: int, init: str, out: Path) -> None:
    """Build every WIDTHS model with mcore on this rank: None, or mcore's assertion."""
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    from lightning_mcore.model.build import build_chunks
    from lightning_mcore.model.config import to_transformer_config
    from lightning_mcore.strategy.cpu import CpuCompat, cuda_on_cpu
    from lightning_mcore.strategy.parallel import ParallelConfig
    from lightning_mcore.strategy.teardown import destroy_model_parallel

    verdicts = {}
    try:
        CpuCompat().install()
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
        for name, (fields, sizes) in WIDTHS.items():
            cfg, parallel = width_config(fields), ParallelConfig(**sizes)
            parallel_state.initialize_model_parallel(**parallel.sizes())
            tensor_parallel.model_parallel_cuda_manual_seed(0, inference_rng_tracker=True, force_reset_rng=True)
            try:
                with cuda_on_cpu():
                    tf_config = to_transformer_config(cfg, parallel, torch.float32, on_cpu=True, use_te=False)
                    build_chunks(cfg, tf_config, use_te=False)
                verdicts[name] = None
            except AssertionError as error:
                verdicts[name] = str(error) or "AssertionError"
            finally:
                destroy_model_parallel()
        out.with_suffix(f".{rank}").write_text(json.dumps(verdicts))
    except Exception:  # noqa: BLE001 - reported to the test
        out.with_suffix(f".{rank}").write_text(json.dumps({"error": traceback.format_exc()}))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.distributed
def test_width_rules_are_mcores(tmp_path):
    """The pre-launch check refuses exactly the shapes mcore's layers refuse when built."""
    from lightning_mcore.strategy.parallel import LayoutError, ParallelConfig, validate_layout

    ctx = multiprocessing.get_context("fork")
    init, out = f"file://{tmp_path / 'init'}", tmp_path / "verdicts"
    procs = [ctx.Process(target=_build_on_rank, args=(rank, init, out)) for rank in range(2)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(300)
    mcore = json.loads(out.with_suffix(".0").read_text())
    assert "error" not in mcore, mcore.get("error")
    assert mcore == json.loads(out.with_suffix(".1").read_text())
    assert mcore["dense_odd"] and not mcore["dense_even"]  # the probe tells the shapes apart

    for name, (fields, sizes) in WIDTHS.items():
        try:
            validate_layout(2, ParallelConfig(**sizes), model=width_config(fields))
            ours = None
        except LayoutError as error:
            ours = str(error)
        assert (ours is None) == (mcore[name] is None), (name, ours, mcore[name])


# ---------------------------------------------------------------- item 10: Qwen-VL mrope_section
def vlm_logits(tmp_path: Path, family: str, **rope) -> tuple:
    """(ours, transformers') logits of one row with two images, tp=1."""
    from vlm_models import batch, hf_logits, make_vlm, sample
    from test_vlm_model import run

    source = tmp_path / "source"
    hf = make_vlm(family, source, **rope)
    gen = torch.Generator().manual_seed(1)
    two = sample(hf, [[1, 4, 4], [1, 4, 6]], 48, gen)
    return run(tmp_path, source, batch(hf, [[two]]), "tp1")[0], hf_logits(hf, two)


@pytest.mark.parametrize("rope", [dict(mrope_section=[1, 3, 3]), dict(mrope_section=[2, 3, 4]),
                                  dict(mrope_interleaved=None)], ids=["sum7", "sum9", "no_interleaved_key"])
def test_qwen3_vl_reads_mrope_section_as_transformers(tmp_path, rope):
    """transformers' Qwen3-VL interleaves t h w over 3 * section[1] and 3 * section[2]
    frequencies and leaves t on the rest, whatever the sum and whether the config says
    mrope_interleaved: the same logits here."""
    ours, theirs = vlm_logits(tmp_path, "qwen3_vl", **rope)
    assert ours.shape == theirs.shape
    assert (ours - theirs).abs().max().item() <= 1e-4


def test_qwen2_5_vl_section_transformers_cannot_use_is_refused_before_launch(tmp_path):
    """Qwen2.5-VL splits the head_dim/2 frequencies by the section: transformers fails on a sum
    other than head_dim/2 in its forward; we refuse it reading config.json."""
    from vlm_models import make_vlm, sample

    from lightning_mcore.hf.config import HFCheckpointError
    from lightning_mcore.objectives.vision_language import VisionLanguageSFTModule

    hf = make_vlm("qwen2_5_vl", tmp_path / "source", mrope_section=[1, 3, 3])
    s = sample(hf, [[1, 4, 4]], 32, torch.Generator().manual_seed(1))
    with pytest.raises(RuntimeError, match="split"):
        with torch.no_grad():
            hf(input_ids=s["ids"][None], pixel_values=s["pixels"], image_grid_thw=s["grids"],
               mm_token_type_ids=(s["ids"][None] == hf.config.image_token_id).int())
    with pytest.raises(HFCheckpointError, match=r"mrope_section=\[1, 3, 3\] sums to 7.*head_dim/2 = 8"):
        VisionLanguageSFTModule(str(tmp_path / "source"))
