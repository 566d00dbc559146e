"""Indexed datasets: preprocess writes the tokenizer's ids; mcore's GPTDataset reads them back."""

import runpy
import sys
from pathlib import Path

import pytest
import torch
from megatron.core.datasets.indexed_dataset import IndexedDataset
from test_data_pretrain import SAMPLE, TOKENIZER, attach, paragraphs, tok  # noqa: F401 (fixture)

from lightning_mcore.data import PretrainDataModule
from lightning_mcore.data.preprocess import main as preprocess


@pytest.fixture(scope="module")
def documents(tok):  # noqa: F811 (the imported fixture)
    """Reference: each paragraph of the sample encoded by the tokenizer itself, then EOS."""
    eos = [tok.eos_token_id]
    return [tuple(tok.encode(p, add_special_tokens=False) + eos) for p in paragraphs(SAMPLE)]


@pytest.fixture(scope="module")
def prefix(tmp_path_factory):
    out = tmp_path_factory.mktemp("indexed")
    args = ["--input", SAMPLE, "--tokenizer", TOKENIZER, "--output-prefix", str(out / "sample")]
    preprocess(args + ["--append-eos", "--cache-dir", str(out / "cache")])
    return str(out / "sample")


def indexed_module(prefixes, seq_length=32, **kwargs):
    return PretrainDataModule(
        indexed_prefixes=prefixes, tokenizer=TOKENIZER, seq_length=seq_length, **kwargs
    )


def test_preprocess_writes_one_document_per_paragraph(prefix, documents):
    written = IndexedDataset(prefix)
    assert [tuple(written[i].tolist()) for i in range(len(written))] == documents


def test_preprocess_without_eos_writes_bare_encodings(tmp_path, documents):
    preprocess(
        [
            "--input",
            SAMPLE,
            "--tokenizer",
            TOKENIZER,
            "--output-prefix",
            str(tmp_path / "bare"),
            "--cache-dir",
            str(tmp_path / "cache"),
        ]
    )
    written = IndexedDataset(str(tmp_path / "bare"))
    assert [tuple(written[i].tolist()) for i in range(len(written))] == [d[:-1] for d in documents]


def is_run_of(window, documents):
    """Whether the window is a doc suffix, whole docs, then a doc prefix (docs in any order)."""
    eos = documents[0][-1]
    pieces, start = [], 0
    for i, token in enumerate(window):
        if token == eos:
            pieces.append(window[start : i + 1])
            start = i + 1
    pieces.append(window[start:])
    if len(pieces) == 1 or (len(pieces) == 2 and not pieces[1]):
        return any(_contains(doc, pieces[0]) for doc in documents)
    head, middle, tail = pieces[0], pieces[1:-1], pieces[-1]
    whole = set(documents)
    return (
        any(doc[-len(head) :] == head for doc in documents)
        and all(piece in whole for piece in middle)
        and (not tail or any(doc[: len(tail)] == tail for doc in documents))
    )


def _contains(doc, piece):
    return any(doc[i : i + len(piece)] == piece for i in range(len(doc) - len(piece) + 1))


def test_datamodule_reads_indexed_sequences_of_the_tokenizer_encoding(prefix, documents):
    dm = attach(indexed_module([prefix], seq_length=32, shuffle=False), batch_size=4)
    dm.setup("fit")
    total = sum(len(d) for d in documents)
    assert len(dm.train_dataset) == (total - 1) // 32  # mcore: windows of S + 1 overlapping by one
    batches = list(dm.train_dataloader())
    assert len(batches) == len(dm.train_dataset) // 4
    for batch in batches:
        assert all(v.shape == (4, 32) for v in batch.values())
        assert batch["loss_mask"].dtype == torch.float32 and bool((batch["loss_mask"] == 1).all())
        assert torch.equal(batch["labels"][:, :-1], batch["tokens"][:, 1:])
        assert torch.equal(batch["position_ids"], torch.arange(32).expand(4, 32))
        for row in torch.cat([batch["tokens"], batch["labels"][:, -1:]], 1).tolist():
            assert is_run_of(tuple(row), documents)


def test_indexed_val_split_and_blend(prefix, tmp_path):
    alone = indexed_module([prefix])
    alone.setup("fit")
    dm = attach(
        indexed_module([prefix, prefix], val_split=0.2, cache_dir=str(tmp_path)), batch_size=2
    )
    dm.setup("fit")
    assert 0 < len(dm.val_dataset) < len(dm.train_dataset) < 2 * len(alone.train_dataset)
    batch = next(iter(dm.val_dataloader()))
    assert set(batch) == {"tokens", "labels", "loss_mask", "position_ids"}


def test_missing_prefix_is_named(tmp_path):
    dm = indexed_module([str(tmp_path / "absent")])
    with pytest.raises(FileNotFoundError, match=r"indexed dataset .*absent.* lacks .*absent\.bin"):
        dm.setup("fit")


def test_module_runs_as_a_command(tmp_path, monkeypatch, capsys):
    """What ``python -m lightning_mcore.data.preprocess ...`` runs, without a new interpreter."""
    out = str(tmp_path / "cli")
    argv = [
        "preprocess",
        "--input",
        SAMPLE,
        "--tokenizer",
        TOKENIZER,
        "--output-prefix",
        out,
        "--append-eos",
        "--cache-dir",
        str(tmp_path / "cache"),
    ]
    monkeypatch.setattr(sys, "argv", argv)
    runpy.run_module("lightning_mcore.data.preprocess", run_name="__main__", alter_sys=True)
    assert capsys.readouterr().out.startswith("wrote ")
    assert Path(out + ".bin").is_file() and Path(out + ".idx").is_file()


def test_readme_preprocess_command(tmp_path, tok):  # noqa: F811 (the imported fixture)
    """docs/pretraining.md's command as shown (its placeholders: a corpus and the bundled tokenizer),
    through `lightning-mcore`: it prints no warning (python -m of a module its package imports
    makes runpy warn) and writes each jsonl row as one document."""
    import json

    from readme import commands, run, section, user_dir, warnings_in

    (argv,) = [a for a in commands(section("Data", "pretraining.md")) if a[1] == "preprocess"]
    work = user_dir(tmp_path / "user")
    rows = ["The first document.", "A second one, longer than the first."]
    (work / "corpus.jsonl").write_text("".join(json.dumps({"text": r}) + "\n" for r in rows))
    argv = [str(Path(TOKENIZER).resolve()) if a == "TOKENIZER_DIR" else a for a in argv]
    proc = run(argv, work)
    assert warnings_in(proc.stderr) == [] and "RuntimeWarning" not in proc.stderr, proc.stderr
    written = IndexedDataset(str(work / "data" / "corpus"))
    expected = [tuple(tok.encode(r, add_special_tokens=False) + [tok.eos_token_id]) for r in rows]
    assert [tuple(written[i].tolist()) for i in range(len(written))] == expected


def test_existing_dataset_is_refused_unless_overwrite(tmp_path, capsys):
    first = tmp_path / "first.txt"
    first.write_text("one document\n\nand another\n")
    args = ["--tokenizer", TOKENIZER, "--output-prefix", str(tmp_path / "corpus"), "--cache-dir", str(tmp_path / "c")]
    preprocess(["--input", str(first)] + args)
    before = {p: (tmp_path / p).read_bytes() for p in ("corpus.bin", "corpus.idx")}
    capsys.readouterr()

    with pytest.raises(SystemExit) as exit_info:
        preprocess(["--input", SAMPLE] + args)
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(err) == 1, err
    assert err[0].startswith("error: --output-prefix") and "corpus.bin exists" in err[0] and "--overwrite" in err[0]
    assert {p: (tmp_path / p).read_bytes() for p in before} == before

    preprocess(["--input", SAMPLE, "--overwrite"] + args)
    assert len(IndexedDataset(str(tmp_path / "corpus"))) == len(paragraphs(SAMPLE))
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("corpus")) == ["corpus.bin", "corpus.idx"]


def test_a_run_that_fails_midway_leaves_the_old_dataset(tmp_path, monkeypatch):
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    args = ["--tokenizer", TOKENIZER, "--output-prefix", str(tmp_path / "corpus"), "--cache-dir", str(tmp_path / "c")]
    preprocess(["--input", SAMPLE] + args)
    before = {p: (tmp_path / p).read_bytes() for p in ("corpus.bin", "corpus.idx")}
    written = []

    def add_document(self, tensor, lengths, modes=None):
        if len(written) == 2:
            raise OSError("disk full")
        written.append(tensor)

    monkeypatch.setattr(IndexedDatasetBuilder, "add_document", add_document)
    with pytest.raises(OSError, match="disk full"):
        preprocess(["--input", SAMPLE, "--overwrite"] + args)
    assert {p.name for p in tmp_path.iterdir() if p.name.startswith("corpus")} == set(before)
    assert {p: (tmp_path / p).read_bytes() for p in before} == before
