"""DPO data: one row per pair, loss on the last reply only, formats, drop counts, clear errors.

Expected tokens come from transformers' ``apply_chat_template`` (the prompt rendered with
``add_generation_prompt=True`` is a prefix of the whole conversation; the reply is the rest) or
from the conversation text by hand, never from this library's output.
"""

import json
import logging
from pathlib import Path
from types import SimpleNamespace

import datasets
import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from lightning_mcore.data import DPODataModule
from lightning_mcore.data.chat import CHATML, tokenize_conversation
from lightning_mcore.data.two_rows import fit_pairs

SAMPLE_DIR = Path(__file__).resolve().parents[1] / "configs" / "sample_data"
TOKENIZER = str(SAMPLE_DIR / "tokenizer")
DPO = SAMPLE_DIR / "dpo.jsonl"
S = 256

HISTORY = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2 plus 3?"},
    {"role": "assistant", "content": "5."},
    {"role": "user", "content": "And times 4?"},
]


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(TOKENIZER)


def render(tok, messages, prompt=False):
    return tok.apply_chat_template(
        messages,
        chat_template=CHATML,
        tokenize=True,
        return_dict=False,
        add_generation_prompt=prompt,
    )


def encode(tok, text):
    return tok.encode(text, add_special_tokens=False)


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def pairs_of(path=DPO):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def make(tmp_path, paths=str(DPO), seq_length=S, **kwargs):
    kwargs.setdefault("chat_template", "chatml")
    return DPODataModule(paths, TOKENIZER, seq_length, cache_dir=str(tmp_path / "cache"), **kwargs)


def ready(dm):
    dm.prepare_data()
    dm.setup("fit")
    return dm


def all_rows(dataset):
    return [dataset[i] for i in range(len(dataset))]


def sides(row):
    """(tokens, tokens with loss) of segment 1 (chosen) and segment 2 (rejected)."""
    out = []
    for segment in (1, 2):
        where = row["segment_ids"] == segment
        targets = row["labels"][where][row["loss_mask"][where] > 0]
        out.append((row["tokens"][where].tolist(), targets.tolist()))
    return out


def expected_pair(tok, prompt_turns, chosen, rejected):
    """Both conversations by apply_chat_template, the reply being what follows the prompt."""
    head = render(tok, prompt_turns, prompt=True)
    out = []
    for reply in (chosen, rejected):
        full = render(tok, prompt_turns + [{"role": "assistant", "content": reply}])
        assert full[: len(head)] == head  # the prompt's rendering is a prefix
        out.append((full, full[len(head) :]))
    return out


def as_lists(record):
    return {
        side: [
            {"role": "user", "content": record["prompt"]},
            {"role": "assistant", "content": record[side]},
        ]
        for side in ("chosen", "rejected")
    }


def equal_rows(a, b):
    return len(a) == len(b) and all(torch.equal(x[k], y[k]) for x, y in zip(a, b) for k in x)


# --- the loss falls on the last reply only ---------------------------------------------------


def test_loss_is_exactly_each_reply_after_the_generation_prompt(tmp_path, tok):
    dm = ready(make(tmp_path))
    records = pairs_of()
    rows = all_rows(dm.train_dataset)
    assert len(rows) == len(records) == 24
    for row, r in zip(rows, records, strict=True):
        user = [{"role": "user", "content": r["prompt"]}]
        assert sides(row) == expected_pair(tok, user, r["chosen"], r["rejected"])
    # By hand for ChatML: the reply is its content and end-of-turn marker.
    first = sides(rows[0])
    assert first[0][1] == encode(tok, records[0]["chosen"] + "<|im_end|>\n")
    assert first[1][1] == encode(tok, records[0]["rejected"] + "<|im_end|>\n")


def test_earlier_assistant_turns_are_prompt_without_loss(tmp_path, tok):
    record = {
        "chosen": HISTORY + [{"role": "assistant", "content": "20."}],
        "rejected": HISTORY + [{"role": "assistant", "content": "Figure it out."}],
    }
    dm = ready(make(tmp_path, write_jsonl(tmp_path / "multi.jsonl", [record]), seq_length=512))
    (row,) = all_rows(dm.train_dataset)
    assert sides(row) == expected_pair(tok, HISTORY, "20.", "Figure it out.")
    assert sides(row)[0][1] == encode(tok, "20.<|im_end|>\n")
    # SFT's mask would also cover the earlier reply "5.": last_only is what removes it.
    _, every = tokenize_conversation(tok, record["chosen"], CHATML)
    _, last = tokenize_conversation(tok, record["chosen"], CHATML, last_only=True)
    assert sum(every) - sum(last) == len(encode(tok, "5.<|im_end|>\n"))


def test_row_layout_by_hand(tmp_path, tok):
    r = pairs_of()[0]
    (chosen, _), (rejected, _) = expected_pair(
        tok, [{"role": "user", "content": r["prompt"]}], r["chosen"], r["rejected"]
    )
    dm = ready(make(tmp_path, write_jsonl(tmp_path / "one.jsonl", [r])))
    (row,) = all_rows(dm.train_dataset)
    n1, n2, pad = len(chosen), len(rejected), dm.pad_token_id
    assert pad == tok.eos_token_id if tok.pad_token_id is None else tok.pad_token_id
    n0 = S - n1 - n2
    assert set(row) == {"tokens", "labels", "loss_mask", "position_ids", "segment_ids"}
    assert all(v.shape == (S,) for v in row.values()) and row["loss_mask"].dtype == torch.float32
    assert row["tokens"].tolist() == chosen + rejected + [pad] * n0
    assert row["segment_ids"].tolist() == [1] * n1 + [2] * n2 + [0] * n0
    assert row["position_ids"].tolist() == [*range(n1), *range(n2)] + [0] * n0
    # Labels: the next token of the same conversation; pad at each end and on padding.
    assert row["labels"].tolist() == chosen[1:] + [pad] + rejected[1:] + [pad] + [pad] * n0
    mask = row["loss_mask"]
    assert mask[n1 - 1] == 0 and mask[n1 + n2 - 1] == 0 and not mask[n1 + n2 :].any()
    assert mask[:n1].sum() > 0 and mask[n1 : n1 + n2].sum() > 0


def test_string_and_message_list_formats_give_the_same_rows(tmp_path):
    records = pairs_of()
    whole = [as_lists(r) for r in records]
    split = [
        {
            "prompt": [{"role": "user", "content": r["prompt"]}],
            "chosen": [{"role": "assistant", "content": r["chosen"]}],
            "rejected": [{"role": "assistant", "content": r["rejected"]}],
        }
        for r in records
    ]
    strings = ready(make(tmp_path))
    for name, variant in (("whole", whole), ("split", split)):
        lists = ready(make(tmp_path, write_jsonl(tmp_path / f"{name}.jsonl", variant)))
        assert lists.stats == strings.stats
        assert equal_rows(all_rows(lists.train_dataset), all_rows(strings.train_dataset))


def test_column_and_role_mapping(tmp_path):
    names = {"user": "human", "assistant": "gpt"}
    renamed = [
        {
            side: [{"from": names[m["role"]], "value": m["content"]} for m in turns]
            for side, turns in zip(("good", "bad"), as_lists(r).values())
        }
        for r in pairs_of()
    ]
    columns = {"chosen": "good", "rejected": "bad", "role": "from", "content": "value"}
    path = write_jsonl(tmp_path / "renamed.jsonl", renamed)
    mapped = ready(
        make(tmp_path, path, columns=columns, roles={"human": "user", "gpt": "assistant"})
    )
    plain = ready(make(tmp_path))
    assert equal_rows(all_rows(mapped.train_dataset), all_rows(plain.train_dataset))


def test_string_prompt_with_whole_conversations_is_refused_or_ignored(tmp_path):
    """Conversations that already hold the prompt, beside a string copy of it (as in
    HuggingFaceH4/ultrafeedback_binarized), would put the prompt in twice: refused, unless the
    prompt column is ignored."""
    records = [{"prompt": r["prompt"], **as_lists(r)} for r in pairs_of()]
    path = write_jsonl(tmp_path / "h4.jsonl", records)
    with pytest.raises(ValueError, match=r"sample 0: .*prompt must be a message list.*None"):
        make(tmp_path, path).prepare_data()
    ignored = ready(make(tmp_path, path, columns={"prompt": None}))
    assert equal_rows(
        all_rows(ignored.train_dataset), all_rows(ready(make(tmp_path)).train_dataset)
    )


# --- errors ----------------------------------------------------------------------------------


@pytest.mark.parametrize("missing", ["chosen", "rejected"])
def test_missing_reply_column_is_named_before_tokenizing(tmp_path, missing):
    records = [{k: v for k, v in r.items() if k != missing} | {"id": 1} for r in pairs_of()]
    path = write_jsonl(tmp_path / "x.jsonl", records)
    with pytest.raises(
        ValueError, match=rf"column '{missing}' .*not found; columns found: \[.*'id'"
    ):
        make(tmp_path, path).prepare_data()
    assert not list((tmp_path / "cache").glob("dpo-*.arrow"))  # failed before any map


def test_conversations_with_different_prompts_are_refused_with_the_sample(tmp_path):
    records = [as_lists(r) for r in pairs_of()]
    records[5]["rejected"][0]["content"] = "Something else?"
    path = write_jsonl(tmp_path / "d.jsonl", records)
    with pytest.raises(ValueError, match=r"sample 5: chosen and rejected differ at message 0"):
        make(tmp_path, path).prepare_data()


@pytest.mark.parametrize(
    "change, error",
    [
        (
            lambda r: r["chosen"].append({"role": "user", "content": "Hm?"}),
            "sample 3: chosen must end with the assistant's reply, but ends with user",
        ),
        (
            lambda r: r.update(rejected="Rome."),
            "sample 3: .* must both be strings or both message lists, got list and str",
        ),
    ],
)
def test_malformed_pairs_are_refused_with_the_sample(tmp_path, change, error):
    records = [as_lists(r) for r in pairs_of()]
    change(records[3])
    with pytest.raises(ValueError, match=error):
        make(tmp_path, write_jsonl(tmp_path / "m.jsonl", records)).prepare_data()


def test_string_replies_without_a_prompt_column_are_refused(tmp_path):
    records = [{"chosen": r["chosen"], "rejected": r["rejected"]} for r in pairs_of()]
    with pytest.raises(ValueError, match=r"sample 0: .*need a string prompt: there is no prompt"):
        make(tmp_path, write_jsonl(tmp_path / "p.jsonl", records)).prepare_data()


# --- drops, counted --------------------------------------------------------------------------


def test_identical_and_empty_replies_are_dropped_and_counted(tmp_path, caplog):
    records = pairs_of()
    records[1]["rejected"] = records[1]["chosen"]
    records[2]["chosen"] = ""
    records[4]["rejected"] = "  \n"
    with caplog.at_level(logging.WARNING, logger="lightning_mcore.data.dpo"):
        dm = ready(make(tmp_path, write_jsonl(tmp_path / "e.jsonl", records)))
    assert dm.stats["dropped"] == {"chosen and rejected identical": 1, "empty response": 2}
    assert dm.stats["pairs"] == 24 and dm.stats["train"]["pairs"] == 21
    assert "dropped" in caplog.text and "empty response" in caplog.text
    kept = {tuple(sides(row)[0][0]) for row in all_rows(dm.train_dataset)}
    plain = ready(make(tmp_path))
    every = [tuple(sides(row)[0][0]) for row in all_rows(plain.train_dataset)]
    assert kept == set(every) - {every[1], every[2], every[4]}


def test_long_prompts_and_long_pairs_are_dropped_under_their_own_reasons(tmp_path, tok):
    short = {"prompt": "Hi", "chosen": "Hello.", "rejected": "Go away."}
    long_pair = {"prompt": "Hi", "chosen": "Hello. " * 12, "rejected": "Go away."}
    long_prompt = {"prompt": "la " * 60, "chosen": "Ok.", "rejected": "No."}
    records = [short, long_pair, long_prompt, short]
    sizes = []
    for r in records:
        user = [{"role": "user", "content": r["prompt"]}]
        pair = expected_pair(tok, user, r["chosen"], r["rejected"])
        sizes.append((len(render(tok, user, prompt=True)), sum(len(full) for full, _ in pair)))
    seq = 150
    assert sizes[0][1] <= seq and sizes[1][0] <= seq < sizes[1][1] and sizes[2][0] > seq
    dm = ready(make(tmp_path, write_jsonl(tmp_path / "long.jsonl", records), seq))
    assert dm.stats["dropped"] == {
        "pair longer than seq_length": 1,
        "prompt longer than seq_length": 1,
    }
    assert dm.stats["train"] == {
        "pairs": 2,
        "tokens": 2 * sizes[0][1],
        "fill": sizes[0][1] / seq,
    }


def test_fit_pairs_by_hand():
    # Pair 1 was dropped when tokenizing (zero lengths): not counted again. Pair 3 fills the row
    # exactly; pair 4's prompt alone is too long, which is its only reason.
    lengths = np.array([[5, 4], [0, 0], [9, 9], [6, 4], [11, 12]])
    prompts = np.array([3, 0, 8, 3, 11])
    keep, dropped = fit_pairs(lengths, prompts, seq_length=10)
    assert keep.tolist() == [0, 3]
    assert dropped == {"pair longer than seq_length": 1, "prompt longer than seq_length": 1}


def test_nothing_left_is_an_error_with_the_counts(tmp_path):
    records = [{"prompt": "Hi", "chosen": "Same.", "rejected": "Same."}]
    with pytest.raises(ValueError, match=r"no pair left .* of 1: .*identical': 1"):
        ready(make(tmp_path, write_jsonl(tmp_path / "none.jsonl", records)))


# --- inputs, splits, feeding -----------------------------------------------------------------


@pytest.mark.parametrize("as_dict", [False, True])
def test_saved_dataset_directory_reads_like_the_jsonl(tmp_path, as_dict):
    saved = datasets.Dataset.from_list(pairs_of())
    saved = datasets.DatasetDict(train=saved) if as_dict else saved
    saved.save_to_disk(str(tmp_path / "saved"))
    from_disk = ready(make(tmp_path, str(tmp_path / "saved")))
    from_jsonl = ready(make(tmp_path))
    assert from_disk.stats == from_jsonl.stats
    assert equal_rows(all_rows(from_disk.train_dataset), all_rows(from_jsonl.train_dataset))


def test_tokenized_once_then_reused_from_the_cache(tmp_path):
    dm = make(tmp_path)
    dm.prepare_data()
    cached = sorted((tmp_path / "cache").glob("dpo-*.arrow"))
    assert len(cached) == 1
    dm.setup("fit")
    assert sorted((tmp_path / "cache").glob("dpo-*.arrow")) == cached
    assert dm.train_dataset.tokenized.cache_files[0]["filename"] == str(cached[0])


def test_val_split_holds_out_whole_pairs(tmp_path):
    dm = ready(make(tmp_path, val_split=0.25))
    assert (dm.stats["train"]["pairs"], dm.stats["val"]["pairs"]) == (18, 6)
    held = {tuple(sides(row)[0][0]) for row in all_rows(dm.val_dataset)}
    trained = {tuple(sides(row)[0][0]) for row in all_rows(dm.train_dataset)}
    assert len(held) == 6 and len(trained) == 18 and not held & trained


def test_each_rank_gets_whole_pairs_and_different_ones(tmp_path):
    def first_batch(rank):
        dm = ready(make(tmp_path))
        strategy = SimpleNamespace(
            data_parallel_batch_size=4, distributed_sampler_kwargs={"num_replicas": 2, "rank": rank}
        )
        dm.trainer = SimpleNamespace(strategy=strategy, global_step=0)
        return next(iter(dm.train_dataloader()))

    b0, b1 = first_batch(0), first_batch(1)
    assert b0["tokens"].shape == b0["segment_ids"].shape == (4, S)
    for batch in (b0, b1):
        for segments, mask in zip(batch["segment_ids"], batch["loss_mask"]):
            assert mask[segments == 1].sum() > 0 and mask[segments == 2].sum() > 0
    assert not {tuple(r) for r in b0["tokens"].tolist()} & {tuple(r) for r in b1["tokens"].tolist()}


def test_sample_data_prefers_polite_correct_answers(tmp_path, tok):
    records = pairs_of()
    assert len(records) == 24 and len({r["prompt"] for r in records}) == 24
    assert all(r["rejected"].startswith("Ugh, who cares?") for r in records)
    assert not any("Ugh" in r["chosen"] for r in records)
    for r in records:
        user = [{"role": "user", "content": r["prompt"]}]
        assert (
            sum(len(full) for full, _ in expected_pair(tok, user, r["chosen"], r["rejected"])) < 200
        )


def test_missing_file_fails_at_construction(tmp_path):
    with pytest.raises(FileNotFoundError, match="no file matches .*pairs.jsonl"):
        make(tmp_path, paths=str(tmp_path / "pairs.jsonl"))
