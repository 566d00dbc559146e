"""PretrainDataModule on text files: packing, the batch contract, ranks, resume, clear errors."""

import itertools
import json
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from lightning.pytorch.strategies import SingleDeviceStrategy
from transformers import AutoTokenizer

from lightning_mcore.data import PretrainDataModule

SAMPLE_DIR = Path(__file__).resolve().parents[1] / "configs" / "sample_data"
SAMPLE = str(SAMPLE_DIR / "sample.txt")
TOKENIZER = str(SAMPLE_DIR / "tokenizer")


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(TOKENIZER)


def reference_ids(tok, documents):
    """The tokenizer's own encoding of the documents, each followed by EOS."""
    ids = []
    for doc in documents:
        ids += tok.encode(doc, add_special_tokens=False) + [tok.eos_token_id]
    return ids


def paragraphs(path):
    return [p.strip() for p in Path(path).read_text().split("\n\n") if p.strip()]


def attach(dm, batch_size, dp_size=1, rank=0, global_step=0):
    strategy = SimpleNamespace(
        data_parallel_batch_size=batch_size,
        distributed_sampler_kwargs={"num_replicas": dp_size, "rank": rank},
        barrier=lambda *args, **kwargs: None,
    )
    dm.trainer = SimpleNamespace(strategy=strategy, global_step=global_step)
    return dm


def make(tmp_path, paths=SAMPLE, seq_length=32, **kwargs):
    return PretrainDataModule(
        paths, TOKENIZER, seq_length, cache_dir=str(tmp_path / "cache"), **kwargs
    )


def take(loader, n):
    return list(itertools.islice(loader, n))


def sequences(batches):
    """Each row's S + 1 tokens: the inputs plus the final label."""
    return [
        row for b in batches for row in torch.cat([b["tokens"], b["labels"][:, -1:]], 1).tolist()
    ]


def test_batches_follow_the_contract(tmp_path):
    dm = attach(make(tmp_path, seq_length=32), batch_size=3, dp_size=2, rank=1)
    dm.prepare_data()
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    assert set(batch) == {"tokens", "labels", "loss_mask", "position_ids"}
    assert all(v.shape == (3, 32) for v in batch.values())
    assert (
        batch["tokens"].dtype == batch["labels"].dtype == batch["position_ids"].dtype == torch.int64
    )
    assert batch["loss_mask"].dtype == torch.float32 and bool((batch["loss_mask"] == 1).all())
    assert torch.equal(batch["labels"][:, :-1], batch["tokens"][:, 1:])
    assert torch.equal(batch["position_ids"], torch.arange(32).expand(3, 32))


def test_packing_reproduces_the_encoding_of_documents_joined_with_eos(tmp_path, tok):
    reference = reference_ids(tok, paragraphs(SAMPLE))
    dm = attach(make(tmp_path, seq_length=32, shuffle=False), batch_size=2)
    dm.setup("fit")
    assert len(dm.train_dataset) == len(reference) // 33
    packed = sequences(dm.train_dataloader())
    steps = len(reference) // 33 // 2  # the loader drops the odd last sequence
    assert [t for row in packed for t in row] == reference[: steps * 2 * 33]


def test_jsonl_and_parquet_read_the_text_field_in_order(tmp_path, tok):
    docs_a = ["The owl sat on the old mill.", "  ", "Rosa bought eggs.\n"]
    docs_b = ["Snow lay on the hills.", "", "Tom walked to the station."]
    (tmp_path / "a.jsonl").write_text(
        "".join(json.dumps({"body": d, "id": i}) + "\n" for i, d in enumerate(docs_a))
    )
    pq.write_table(pa.table({"body": docs_b}), tmp_path / "b.parquet")
    dm = make(
        tmp_path,
        paths=[str(tmp_path / "a.jsonl"), str(tmp_path / "b.parquet")],
        seq_length=4,
        text_field="body",
    )
    dm.setup("fit")
    reference = reference_ids(tok, [d.strip() for d in docs_a + docs_b if d.strip()])
    packed = [t for i in range(len(dm.train_dataset)) for t in dm.train_dataset.window(i).tolist()]
    assert packed == reference[: len(reference) // 5 * 5]


def test_globs_expand_in_sorted_order(tmp_path, tok):
    (tmp_path / "b.txt").write_text("Second file text about a red kite.\n")
    (tmp_path / "a.txt").write_text("First file text.\n\nAnother paragraph here.\n")
    dm = make(tmp_path, paths=str(tmp_path / "*.txt"), seq_length=2)
    dm.setup("fit")
    reference = reference_ids(
        tok, ["First file text.", "Another paragraph here.", "Second file text about a red kite."]
    )
    packed = [t for i in range(len(dm.train_dataset)) for t in dm.train_dataset.window(i).tolist()]
    assert packed == reference[: len(reference) // 3 * 3]


def test_ranks_read_their_slice_of_each_global_batch(tmp_path):
    whole = attach(make(tmp_path), batch_size=6)  # one rank holding the global batch
    parts = [attach(make(tmp_path), batch_size=3, dp_size=2, rank=r) for r in range(2)]
    for dm in [whole, *parts]:
        dm.setup("fit")
    global_batches = sequences(take(whole.train_dataloader(), 4))
    rank_batches = [sequences(take(dm.train_dataloader(), 4)) for dm in parts]
    for step in range(4):
        combined = (
            rank_batches[0][step * 3 : step * 3 + 3] + rank_batches[1][step * 3 : step * 3 + 3]
        )
        assert combined == global_batches[step * 6 : step * 6 + 6]


def test_resume_continues_the_uninterrupted_order(tmp_path):
    first = attach(make(tmp_path), batch_size=4)
    first.setup("fit")
    full = sequences(take(first.train_dataloader(), 12))
    resumed = attach(make(tmp_path), batch_size=4, global_step=5)
    resumed.setup("fit")
    assert sequences(take(resumed.train_dataloader(), 7)) == full[5 * 4 :]
    # a checkpoint taken at step 5 with 4 samples per step, resumed with 2 per step
    halved = attach(make(tmp_path), batch_size=2, global_step=5)
    halved.load_state_dict({"consumed_samples": 20, "global_step": 5})
    halved.setup("fit")
    assert sequences(take(halved.train_dataloader(), 8)) == full[20:36]
    halved.trainer.global_step = 9
    assert halved.state_dict() == {"consumed_samples": 20 + 4 * 2, "global_step": 9}


def test_val_split_holds_out_sequences_and_reads_them_in_order(tmp_path):
    dm = attach(make(tmp_path, val_split=0.1), batch_size=2)
    dm.setup("fit")
    n = len(dm.train_dataset) + len(dm.val_dataset)
    assert len(dm.val_dataset) == round(n * 0.1)
    train = {tuple(dm.train_dataset[i]["tokens"].tolist()) for i in range(len(dm.train_dataset))}
    val = [tuple(dm.val_dataset[i]["tokens"].tolist()) for i in range(len(dm.val_dataset))]
    assert not train & set(val)
    loader = dm.val_dataloader()
    once, twice = sequences(loader), sequences(loader)
    assert once == twice and [tuple(row[:-1]) for row in once] == val[: len(once)]
    assert len(once) == len(val) // 2 * 2


def test_no_validation_without_val_split(tmp_path):
    dm = attach(make(tmp_path), batch_size=2)
    dm.setup("fit")
    assert dm.val_dataloader() == []


def test_vocab_size_and_eos_come_from_the_tokenizer(tmp_path, tok):
    dm = make(tmp_path)
    assert dm.vocab_size == 512
    assert dm.eos_token_id == tok.convert_tokens_to_ids("</s>")


def test_tokenization_is_cached_across_instances(tmp_path):
    a, b = make(tmp_path), make(tmp_path)
    files_a = [f["filename"] for f in a._tokenize().cache_files]
    assert files_a == [f["filename"] for f in b._tokenize().cache_files]


def test_path_matching_nothing_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="no file matches .*nothing-here"):
        make(tmp_path, paths=[SAMPLE, str(tmp_path / "nothing-here*.txt")])


def test_unknown_extension(tmp_path):
    (tmp_path / "data.csv").write_text("text\nhello\n")
    with pytest.raises(ValueError, match=r"unsupported file type .*data\.csv"):
        make(tmp_path, paths=str(tmp_path / "data.csv"))


def test_missing_tokenizer_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer directory .*no-tokenizer"):
        PretrainDataModule(SAMPLE, str(tmp_path / "no-tokenizer"), 32)


def test_text_shorter_than_one_sequence(tmp_path, tok):
    (tmp_path / "short.txt").write_text("Hello world.\n")
    found = len(tok.encode("Hello world.", add_special_tokens=False)) + 1
    dm = make(tmp_path, paths=str(tmp_path / "short.txt"), seq_length=64)
    with pytest.raises(
        ValueError, match=f"has {found} tokens but one sequence needs seq_length \\+ 1 = 65"
    ):
        dm.setup("fit")


def test_missing_text_field_names_field_and_columns(tmp_path):
    (tmp_path / "d.jsonl").write_text(json.dumps({"body": "x", "id": 1}) + "\n")
    with pytest.raises(  # at construction: the first record shows it
        ValueError, match=r"field 'text' not found.*columns found: \['body', 'id'\]"
    ):
        make(tmp_path, paths=str(tmp_path / "d.jsonl"))


def test_paths_and_indexed_prefixes_exclude_each_other(tmp_path):
    with pytest.raises(ValueError, match="exactly one of paths"):
        PretrainDataModule(SAMPLE, TOKENIZER, 32, indexed_prefixes=[str(tmp_path / "x")])
    with pytest.raises(ValueError, match="exactly one of paths"):
        PretrainDataModule(None, TOKENIZER, 32)


def test_other_strategies_are_refused(tmp_path):
    dm = make(tmp_path)
    dm.trainer = SimpleNamespace(
        strategy=SimpleNamespace(distributed_sampler_kwargs={}), global_step=0
    )
    dm.setup("fit")
    with pytest.raises(TypeError, match="needs lightning_mcore.MegatronStrategy"):
        dm.train_dataloader()


def test_too_few_sequences_for_a_global_batch(tmp_path):
    dm = attach(make(tmp_path, seq_length=512), batch_size=16, dp_size=4)
    dm.setup("fit")
    with pytest.raises(
        ValueError, match=r"training data of seq_length=512: \d+ samples cannot fill .* 64"
    ):
        dm.train_dataloader()


class _OneRankStrategy(SingleDeviceStrategy):
    """Stands in for MegatronStrategy: distributed, with the attributes the data module reads."""

    data_parallel_batch_size = 4
    is_distributed = True  # Lightning would swap in its own sampler for any non-distributed one

    @property
    def distributed_sampler_kwargs(self):
        return {"num_replicas": 1, "rank": 0}


class _Recorder(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.embedding, self.seen = torch.nn.Embedding(512, 1), []

    def training_step(self, batch, batch_idx):
        self.seen += sequences([batch])
        return self.embedding(batch["tokens"]).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_lightning_resumes_a_mid_epoch_checkpoint_with_the_same_batches(tmp_path):
    def fit(max_steps, ckpt_path=None):
        trainer = L.Trainer(
            strategy=_OneRankStrategy(torch.device("cpu")),
            max_steps=max_steps,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        model = _Recorder()
        trainer.fit(model, make(tmp_path, seq_length=128), ckpt_path=ckpt_path)
        return trainer, model.seen

    _, uninterrupted = fit(50)  # about 38 steps per epoch: crosses into the second epoch
    trainer, before = fit(13)
    trainer.save_checkpoint(tmp_path / "step13.ckpt")
    _, after = fit(50, ckpt_path=tmp_path / "step13.ckpt")
    assert len(uninterrupted) == 50 * 4
    assert before + after == uninterrupted
