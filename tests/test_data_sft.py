"""SFT data: assistant-only loss, packed rows, truncation and drop counts, formats, clear errors.

Expected tokens and masks come from transformers (``apply_chat_template`` with ``{% generation %}``
blocks) or are built by hand from the conversation text, never from this library's output.
"""

import copy
import itertools
import json
import logging
import random
from pathlib import Path
from types import SimpleNamespace

import datasets
import pytest
import torch
from transformers import AutoTokenizer

from lightning_mcore.data import SFTDataModule
from lightning_mcore.data.chat import CHATML, ChatFormat, resolve_template, tokenize_conversation
from lightning_mcore.data.packing import build_row, efficiency, fit_samples, pack

SAMPLE_DIR = Path(__file__).resolve().parents[1] / "configs" / "sample_data"
TOKENIZER = str(SAMPLE_DIR / "tokenizer")
SFT = SAMPLE_DIR / "sft.jsonl"
ALPACA = SAMPLE_DIR / "alpaca.jsonl"

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "The capital of France is Paris."},
    {"role": "user", "content": "And of Italy?"},
    {"role": "assistant", "content": "Rome."},
    {"role": "user", "content": "Thanks!"},
    {"role": "assistant", "content": "You are welcome."},
]

# Zephyr-style, with transformers' generation markers around each reply and its end of turn.
GENERATION_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'assistant' %}<|assistant|>\n"
    "{% generation %}{{ m['content'] }}{{ eos_token }}\n{% endgeneration %}"
    "{% else %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(TOKENIZER)


def encode(tok, text):
    return tok.encode(text, add_special_tokens=False)


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def rows_of(records):
    return [json.loads(line) for line in Path(records).read_text().splitlines()]


def make(tmp_path, paths=str(SFT), seq_length=256, **kwargs):
    kwargs.setdefault("chat_template", "chatml")
    return SFTDataModule(paths, TOKENIZER, seq_length, cache_dir=str(tmp_path / "cache"), **kwargs)


def ready(dm):
    dm.prepare_data()
    dm.setup("fit")
    return dm


def attach(dm, batch_size, dp_size=1, rank=0, global_step=0):
    strategy = SimpleNamespace(
        data_parallel_batch_size=batch_size,
        distributed_sampler_kwargs={"num_replicas": dp_size, "rank": rank},
    )
    dm.trainer = SimpleNamespace(strategy=strategy, global_step=global_step)
    return dm


def samples_in(row):
    """Each sample of a row as (tokens, tokens that have loss), split by segment_ids."""
    out = []
    for segment in range(1, int(row["segment_ids"].max()) + 1):
        where = row["segment_ids"] == segment
        targets = row["labels"][where][row["loss_mask"][where] > 0]
        out.append((row["tokens"][where].tolist(), targets.tolist()))
    return out


def all_rows(dataset):
    return [dataset[i] for i in range(len(dataset))]


# --- assistant-only labels -------------------------------------------------------------------


def test_assistant_mask_matches_transformers_generation_blocks(tok):
    gen_tok = copy.deepcopy(tok)
    gen_tok.chat_template = GENERATION_TEMPLATE
    ids, mask = tokenize_conversation(gen_tok, CONVERSATION, resolve_template(gen_tok))
    ref = gen_tok.apply_chat_template(
        CONVERSATION, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    assert ids == list(ref["input_ids"])
    assert mask == list(ref["assistant_masks"])
    # Three replies, each ending with its end-of-turn token.
    runs = [list(g) for k, g in itertools.groupby(zip(ids, mask), key=lambda x: x[1]) if k]
    assert len(runs) == 3 and all((tok.eos_token_id, 1) in run for run in runs)


def test_chatml_labels_exactly_the_replies_and_their_end_of_turn(tok):
    expected_ids, expected_mask = [], []
    for m in CONVERSATION:
        head = encode(tok, f"<|im_start|>{m['role']}\n")
        body = encode(tok, m["content"] + "<|im_end|>\n")
        expected_ids += head + body
        expected_mask += [0] * len(head) + [int(m["role"] == "assistant")] * len(body)
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in CONVERSATION)
    assert expected_ids == encode(tok, text)  # the hand-built list is the plain encoding
    assert tokenize_conversation(tok, CONVERSATION, CHATML) == (expected_ids, expected_mask)


def test_chatml_markers_split_into_pieces_but_round_trip(tok):
    """The bundled tokenizer has no ChatML special tokens: the markers are several byte-level
    pieces each, which still decode to the exact text."""
    ids, _ = tokenize_conversation(tok, CONVERSATION, CHATML)
    assert tok.decode(ids) == tok.apply_chat_template(
        CONVERSATION, chat_template=CHATML, tokenize=False
    )
    assert len(encode(tok, "<|im_end|>")) > 1


def test_template_that_rewrites_earlier_turns_is_refused(tok):
    marks_last = (
        "{% for m in messages %}{% if loop.last %}LAST {% endif %}{{ m['content'] }}\n{% endfor %}"
    )
    with pytest.raises(ValueError, match="sample 7: the chat template renders .* differently"):
        tokenize_conversation(tok, CONVERSATION, marks_last, index=7)


def test_tokenizer_without_template_needs_an_explicit_choice(tmp_path, tok):
    assert tok.chat_template is None
    with pytest.raises(ValueError, match="no chat template: pass chat_template='chatml'"):
        resolve_template(tok)
    with pytest.raises(ValueError, match="no chat template"):
        make(tmp_path, chat_template=None).prepare_data()
    assert resolve_template(tok, "chatml") == CHATML
    assert resolve_template(tok, "{{ 'x' }}") == "{{ 'x' }}"


# --- packing ---------------------------------------------------------------------------------


def test_packed_row_by_hand():
    row = build_row([([10, 11, 12], [0, 1, 1]), ([20, 21], [0, 1])], seq_length=7, pad_id=0)
    assert row["tokens"].tolist() == [10, 11, 12, 20, 21, 0, 0]
    assert row["labels"].tolist() == [11, 12, 0, 21, 0, 0, 0]
    assert row["loss_mask"].tolist() == [1, 1, 0, 1, 0, 0, 0]
    assert row["position_ids"].tolist() == [0, 1, 2, 0, 1, 0, 0]
    assert row["segment_ids"].tolist() == [1, 1, 1, 2, 2, 0, 0]
    dtypes = {k: v.dtype for k, v in row.items()}
    assert dtypes == {
        "tokens": torch.int64,
        "labels": torch.int64,
        "loss_mask": torch.float32,
        "position_ids": torch.int64,
        "segment_ids": torch.int64,
    }


def test_best_fit_decreasing_fills_rows_exactly_when_possible():
    rows = pack([5, 3, 2, 4, 1, 5], seq_length=10)  # 20 tokens: 2 rows is the minimum
    assert rows == [[0, 5], [1, 2, 3, 4]]
    assert efficiency([5, 3, 2, 4, 1, 5], rows, 10) == 1.0


def test_packing_keeps_every_sample_once_and_no_label_crosses_a_boundary():
    rng = random.Random(0)
    S = 32
    samples = []
    for _ in range(60):
        n = rng.randint(2, S)
        samples.append(
            ([rng.randint(5, 500) for _ in range(n)], [rng.randint(0, 1) for _ in range(n)])
        )
    rows = pack([len(ids) for ids, _ in samples], S)
    assert sorted(i for row in rows for i in row) == list(range(len(samples)))
    assert len(rows) < len(samples)
    seen = []
    for row in rows:
        built = build_row([samples[i] for i in row], S, pad_id=1)
        seg = built["segment_ids"]
        same = (seg[:-1] == seg[1:]) & (seg[:-1] > 0)
        assert torch.equal(built["labels"][:-1][same], built["tokens"][1:][same])
        assert not built["loss_mask"][:-1][~same].any() and built["loss_mask"][-1] == 0
        for i, (tokens, targets) in zip(row, samples_in(built)):
            ids, mask = samples[i]
            assert tokens == ids
            assert targets == [t for t, m in zip(ids[1:], mask[1:]) if m]
            seen.append(i)
    assert sorted(seen) == list(range(len(samples)))


def test_fit_samples_drops_or_truncates_and_counts():
    lengths, first = [5, 12, 12, 3], [2, 4, 11, 3]  # sample 3 has no assistant token
    keep, fitted, dropped, truncated = fit_samples(lengths, first, 10, "drop")
    assert keep.tolist() == [0] and fitted.tolist() == [5] and truncated == 0
    assert dropped == {"longer than seq_length=10": 2, "no assistant token": 1}
    keep, fitted, dropped, truncated = fit_samples(lengths, first, 10, "truncate")
    assert keep.tolist() == [0, 1] and fitted.tolist() == [5, 10] and truncated == 1
    assert dropped == {
        "no assistant token in the first seq_length=10 tokens": 1,
        "no assistant token": 1,
    }


# --- the data module -------------------------------------------------------------------------


@pytest.mark.parametrize("packing", [True, False])
def test_rows_hold_each_conversation_once_with_loss_on_replies_only(tmp_path, tok, packing):
    dm = ready(make(tmp_path, packing=packing))
    conversations = [r["messages"] for r in rows_of(SFT)]
    expected = sorted(
        (
            encode(tok, "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in c)),
            [
                t
                for m in c
                if m["role"] == "assistant"
                for t in encode(tok, m["content"] + "<|im_end|>\n")
            ],
        )
        for c in conversations
    )
    rows = all_rows(dm.train_dataset)
    assert sorted(s for row in rows for s in samples_in(row)) == expected
    assert all(
        set(row) == {"tokens", "labels", "loss_mask", "position_ids", "segment_ids"}
        and all(v.shape == (256,) for v in row.values())
        for row in rows
    )
    stats = dm.stats["train"]
    tokens = sum(len(ids) for ids, _ in expected)
    assert stats == {
        "samples": 16,
        "rows": len(rows),
        "tokens": tokens,
        "packing_efficiency": tokens / (len(rows) * 256),
    }
    assert dm.stats["dropped"] == {} and dm.stats["truncated"] == 0
    assert (len(rows) < 16) if packing else (len(rows) == 16)


def test_long_samples_are_dropped_or_truncated_and_counted(tmp_path, tok, caplog):
    records = [
        {
            "messages": [
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello."},
            ]
        },
        {
            "messages": [
                {"role": "user", "content": "Talk."},
                {"role": "assistant", "content": "la " * 80},
            ]
        },
        {
            "messages": [
                {"role": "user", "content": "la " * 80},
                {"role": "assistant", "content": "Ok."},
            ]
        },
    ]
    path = write_jsonl(tmp_path / "long.jsonl", records)
    S = 64
    full = [
        tok.apply_chat_template(
            r["messages"], chat_template=CHATML, tokenize=True, return_dict=False
        )
        for r in records
    ]
    assert len(full[0]) <= S < min(len(full[1]), len(full[2]))
    with caplog.at_level(logging.WARNING, logger="lightning_mcore.data.sft"):
        dropped = ready(make(tmp_path, path, S, truncation="drop"))
    assert dropped.stats["dropped"] == {f"longer than seq_length={S}": 2}
    assert dropped.stats["train"]["samples"] == 1 and "dropped" in caplog.text
    cut = ready(make(tmp_path, path, S, truncation="truncate", packing=False))
    assert cut.stats["truncated"] == 1 and cut.stats["train"]["samples"] == 2
    assert cut.stats["dropped"] == {f"no assistant token in the first seq_length={S} tokens": 1}
    rows = all_rows(cut.train_dataset)
    assert sorted(row["tokens"][row["segment_ids"] > 0].tolist() for row in rows) == sorted(
        [full[0], full[1][:S]]
    )


def test_empty_assistant_turns_drop_the_sample_and_are_counted(tmp_path):
    records = rows_of(SFT)
    records[3]["messages"][1]["content"] = ""
    records[5]["messages"][-1]["content"] = "  "
    records[6]["messages"] = records[6]["messages"][:1]  # a lone user turn
    dm = ready(make(tmp_path, write_jsonl(tmp_path / "e.jsonl", records)))
    assert dm.stats["dropped"] == {"empty assistant turn": 2, "no assistant turn": 1}
    assert dm.stats["train"]["samples"] == 13


def test_missing_column_names_field_and_columns(tmp_path):
    path = write_jsonl(tmp_path / "x.jsonl", [{"conversations": [], "id": 1}])
    with pytest.raises(ValueError, match=r"cannot tell the format .*'conversations', 'id'"):
        make(tmp_path, path).prepare_data()
    with pytest.raises(ValueError, match=r"field 'messages' of the messages format not found"):
        make(tmp_path, path, format="messages").prepare_data()
    with pytest.raises(ValueError, match=r"field 'instruction' of the alpaca format not found"):
        make(tmp_path, str(SFT), format="alpaca").prepare_data()


def test_missing_message_field_names_the_sample(tmp_path):
    records = rows_of(SFT)
    del records[2]["messages"][1]["content"]
    with pytest.raises(ValueError, match=r"sample 2, message 1: field 'content' is missing"):
        make(tmp_path, write_jsonl(tmp_path / "m.jsonl", records)).prepare_data()


def test_null_alpaca_field_names_the_sample(tmp_path):
    records = rows_of(ALPACA)
    records[1]["output"] = None
    with pytest.raises(ValueError, match=r"sample 1: field 'output' is missing or null"):
        make(tmp_path, write_jsonl(tmp_path / "a.jsonl", records)).prepare_data()


def test_unknown_role_names_it_and_the_allowed_ones(tmp_path):
    records = rows_of(SFT)
    records[4]["messages"][0]["role"] = "narrator"
    with pytest.raises(ValueError, match=r"sample 4, message 0: unknown role 'narrator'.*'system'"):
        make(tmp_path, write_jsonl(tmp_path / "r.jsonl", records)).prepare_data()


def test_alpaca_rows_read_as_one_user_and_one_assistant_turn(tmp_path, tok):
    dm = ready(make(tmp_path, str(ALPACA), packing=False))
    expected = []
    for r in rows_of(ALPACA):
        user = r["instruction"] + (f"\n\n{r['input']}" if r["input"] else "")
        text = f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"
        expected.append(
            (
                encode(tok, text + r["output"] + "<|im_end|>\n"),
                encode(tok, r["output"] + "<|im_end|>\n"),
            )
        )
    got = [s for row in all_rows(dm.train_dataset) for s in samples_in(row)]
    assert sorted(got) == sorted(expected)


def test_column_and_role_mapping_reads_sharegpt_records(tmp_path):
    names = {"user": "human", "assistant": "gpt", "system": "system"}
    shared = [
        {
            "conversations": [
                {"from": names[m["role"]], "value": m["content"]} for m in r["messages"]
            ]
        }
        for r in rows_of(SFT)
    ]
    path = write_jsonl(tmp_path / "sharegpt.jsonl", shared)
    mapped = ready(
        make(
            tmp_path,
            path,
            columns={"messages": "conversations", "role": "from", "content": "value"},
            roles={"human": "user", "gpt": "assistant"},
        )
    )
    plain = ready(make(tmp_path))
    for a, b in zip(all_rows(mapped.train_dataset), all_rows(plain.train_dataset), strict=True):
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_unknown_column_mapping_is_refused():
    with pytest.raises(ValueError, match=r"columns maps unknown fields \['text'\]"):
        ChatFormat.detect(["messages"], columns={"text": "body"})


def test_saved_dataset_directory_reads_like_the_jsonl(tmp_path):
    saved = tmp_path / "saved"
    datasets.Dataset.from_list(rows_of(SFT)).save_to_disk(str(saved))
    from_disk = ready(make(tmp_path, str(saved)))
    from_jsonl = ready(make(tmp_path))
    assert from_disk.stats == from_jsonl.stats
    for a, b in zip(
        all_rows(from_disk.train_dataset), all_rows(from_jsonl.train_dataset), strict=True
    ):
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_val_split_holds_out_whole_conversations(tmp_path):
    dm = ready(make(tmp_path, val_split=0.25))
    train, val = dm.stats["train"], dm.stats["val"]
    assert (train["samples"], val["samples"]) == (12, 4)
    held = {tuple(t) for row in all_rows(dm.val_dataset) for t, _ in samples_in(row)}
    trained = {tuple(t) for row in all_rows(dm.train_dataset) for t, _ in samples_in(row)}
    assert len(held) == 4 and not held & trained


def test_ranks_read_disjoint_rows_and_resume_from_the_step(tmp_path):
    def first_batch(rank, step=0, state=None):
        dm = attach(ready(make(tmp_path, packing=False)), 2, dp_size=2, rank=rank, global_step=step)
        if state:
            dm.load_state_dict(state)
        return dm, next(iter(dm.train_dataloader()))

    dm0, b0 = first_batch(0)
    _, b1 = first_batch(1)
    assert b0["tokens"].shape == (2, 256)
    assert not {tuple(r) for r in b0["tokens"].tolist()} & {tuple(r) for r in b1["tokens"].tolist()}
    loader = dm0.train_dataloader()
    straight = [b["tokens"] for b in itertools.islice(loader, 3)]
    dm0.trainer.global_step = 2
    _, resumed = first_batch(0, step=2, state=dm0.state_dict())
    assert torch.equal(resumed["tokens"], straight[2])


def test_missing_or_text_files_fail_at_construction(tmp_path):
    # before any trainer starts: the path is checked in __init__, not when tokenizing
    with pytest.raises(FileNotFoundError, match="no file matches .*missing.jsonl"):
        make(tmp_path, paths=str(tmp_path / "missing.jsonl"))
    text = tmp_path / "notes.txt"
    text.write_text("plain text\n")
    with pytest.raises(ValueError, match="text files hold no conversations"):
        make(tmp_path, paths=[str(SFT), str(text)])
