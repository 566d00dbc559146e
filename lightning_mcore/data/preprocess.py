"""Turn text, jsonl or parquet files into token ids, and write mcore indexed .bin/.idx files.

The in-memory path (``PretrainDataModule(paths=...)``) and this command share the loading and
tokenizing below, so both see the same documents and the same ids::

    lightning-mcore preprocess --input data/*.jsonl --tokenizer tok/ \\
        --output-prefix data/corpus --append-eos

(``python -m lightning_mcore.data.preprocess`` runs the same.) Existing PREFIX.bin/.idx files
are refused unless ``--overwrite``; both are written under temporary names and renamed when
complete, so a run that stops midway leaves no half-written dataset under PREFIX.

A ``.txt`` file holds one document per blank-line-separated paragraph; ``.jsonl``/``.json``
and ``.parquet`` hold one document per row in ``text_field``. Documents are stripped of
surrounding whitespace and empty ones are skipped.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import uuid
from typing import Any, Iterable, NoReturn, Optional, Sequence

import numpy as np
from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder
from transformers import AutoTokenizer

from lightning_mcore.data import peek
from lightning_mcore.data.files import BUILDERS, relative_to, resolve_files
from lightning_mcore.refusals import deliberate

def tokenizer_dir(path: str) -> str:
    """The expanded tokenizer directory, or an error naming it if it does not exist."""
    if not os.path.isdir(os.path.expanduser(path)):
        raise FileNotFoundError(f"tokenizer directory {path!r} does not exist{relative_to(path)}")
    return os.path.expanduser(path)


def load_tokenizer(path: str) -> Any:
    """Load an HF tokenizer from a local directory (never from the Hub)."""
    return AutoTokenizer.from_pretrained(tokenizer_dir(path))


def load_documents(files: Sequence[str], text_field: str = "text", cache_dir: Optional[str] = None):
    """Load the files with ``datasets`` (cached) as one dataset with a single ``text`` column."""
    import datasets  # lazy: datasets' import takes ~0.4 s, which `import lightning_mcore` and `--help` skip

    parts = []
    for builder, group in _runs_of_same_builder(files):
        if builder == "text":
            part = load_files("text", group, cache_dir, sample_by="paragraph")
        else:
            part = load_files(builder, group, cache_dir)
            if text_field not in part.column_names:
                raise ValueError(
                    f"field {text_field!r} not found in {', '.join(group)}; "
                    f"columns found: {part.column_names}"
                )
            part = part.select_columns([text_field])
            if text_field != "text":
                part = part.rename_column(text_field, "text")
        parts.append(part)
    return parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)


def load_files(builder: str, files: Sequence[str], cache_dir: Optional[str] = None, **options):
    """``datasets.load_dataset`` of files of one builder as one split. A JSON-lines file it
    cannot parse is refused naming the file and the line, which datasets' error does not."""
    import datasets  # lazy: datasets' import takes ~0.4 s, which `import lightning_mcore` and `--help` skip

    try:
        return datasets.load_dataset(builder, data_files=list(files), split="train",
                                     cache_dir=cache_dir, **options)
    except Exception:  # noqa: BLE001 - re-raised unless a line of the file is at fault
        if builder == "json":
            for file in files:
                if file.lower().endswith(".jsonl"):
                    peek.check_json_lines(file)
        raise


def _runs_of_same_builder(files: Sequence[str]) -> Iterable[tuple[str, list[str]]]:
    """Group consecutive files that load with the same ``datasets`` builder, keeping order."""
    runs: list[tuple[str, list[str]]] = []
    for file in files:
        builder = BUILDERS[os.path.splitext(file)[1].lower()]
        if runs and runs[-1][0] == builder:
            runs[-1][1].append(file)
        else:
            runs.append((builder, [file]))
    return runs


def tokenize_documents(
    documents, tokenizer: Any, add_eos: bool = True, num_proc: Optional[int] = None
):
    """Tokenize with ``datasets.map`` into an ``input_ids`` column (int32), EOS after each document.

    The cache fingerprint is computed from the data and the tokenizer's content rather than by
    pickling the tokenizer, which is not stable across processes: ranks other than the one that
    ran this first then load the cached result instead of tokenizing again.
    """
    import datasets  # lazy: datasets' import takes ~0.4 s, which `import lightning_mcore` and `--help` skip

    eos = tokenizer.eos_token_id if add_eos else None
    if add_eos and eos is None:
        raise ValueError("the tokenizer has no eos_token: set add_eos=False or add one")
    content = _tokenizer_content(tokenizer)
    key = f"lightning_mcore-tokenize-v1|{documents._fingerprint}|{content}|{eos}"
    return documents.map(
        _tokenize_batch,
        batched=True,
        remove_columns=documents.column_names,
        fn_kwargs={"tokenizer": tokenizer, "eos_token_id": eos},
        features=datasets.Features({"input_ids": datasets.Sequence(datasets.Value("int32"))}),
        num_proc=num_proc,
        new_fingerprint=hashlib.sha256(key.encode()).hexdigest()[:32],
        desc="Tokenizing",
    )


def _tokenizer_content(tokenizer: Any) -> str:
    """What decides the ids: the backend's serialized model, less the truncation/padding state
    that calling the tokenizer may change."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return f"{type(tokenizer).__name__}|{sorted(tokenizer.get_vocab().items())}"
    state = json.loads(backend.to_str())
    state.pop("truncation", None)
    state.pop("padding", None)
    return f"{type(tokenizer).__name__}|{json.dumps(state, sort_keys=True)}"


def _tokenize_batch(batch: dict, tokenizer: Any, eos_token_id: Optional[int]) -> dict:
    texts = [text.strip() for text in batch["text"] if text and text.strip()]
    if not texts:
        return {"input_ids": []}
    ids = tokenizer(texts, add_special_tokens=False, return_attention_mask=False, verbose=False)
    extra = [] if eos_token_id is None else [eos_token_id]
    return {"input_ids": [doc + extra for doc in ids["input_ids"]]}


def token_chunks(tokenized) -> list[np.ndarray]:
    """The ``input_ids`` column as flat numpy views of its Arrow chunks (no copy, memory-mapped)."""
    if tokenized._indices is not None:
        tokenized = tokenized.flatten_indices()
    column = tokenized.data.column("input_ids")
    return [chunk.flatten().to_numpy(zero_copy_only=False) for chunk in column.chunks]


def indexed_files(output_prefix: str) -> tuple[str, str]:
    return output_prefix + ".bin", output_prefix + ".idx"


def write_indexed(tokenized, output_prefix: str, vocab_size: int) -> tuple[int, int]:
    """Write one mcore indexed document per row; return (documents, tokens) written. Written
    under temporary names, then renamed: .idx (which a reader opens first) goes last, and an
    .idx being replaced is removed first, so no moment pairs a new .bin with an old .idx."""
    os.makedirs(os.path.dirname(os.path.abspath(output_prefix)), exist_ok=True)
    final = indexed_files(output_prefix)
    tmp = tuple(f"{path}.tmp-{uuid.uuid4().hex[:8]}" for path in final)
    try:
        builder = IndexedDatasetBuilder(tmp[0], dtype=DType.optimal_dtype(vocab_size))
        documents = tokens = 0
        for batch in tokenized.with_format("numpy").iter(batch_size=1024):
            for doc in batch["input_ids"]:
                builder.add_document(doc, [len(doc)])
                documents, tokens = documents + 1, tokens + len(doc)
        builder.finalize(tmp[1])
        if os.path.exists(final[1]):
            os.remove(final[1])
        os.replace(tmp[0], final[0])
        os.replace(tmp[1], final[1])
    finally:
        for path in tmp:
            if os.path.exists(path):
                os.remove(path)
    return documents, tokens


def refuse_nameless(output_prefix: str) -> None:
    """Raise ValueError for a prefix without a file name (`data/`, `data/.`): it would write
    hidden files `data/.bin` and `data/.idx`."""
    if os.path.basename(output_prefix) in ("", ".", ".."):
        raise ValueError(f"--output-prefix {output_prefix} has no file name, so it would write hidden "
                         f"files {output_prefix}.bin and .idx; name them, e.g. --output-prefix "
                         f"{os.path.join(output_prefix, 'corpus')}")


def refuse_existing(output_prefix: str, overwrite: bool) -> None:
    """Raise FileExistsError naming an existing PREFIX.bin/.idx, unless `overwrite`."""
    existing = [path for path in indexed_files(output_prefix) if os.path.exists(path)]
    if existing and not overwrite:
        raise FileExistsError(f"--output-prefix {output_prefix}: {existing[0]} exists; pass --overwrite "
                              f"to replace {' and '.join(existing)}, or choose another prefix.")


def _check_text_fields(files: Sequence[str], text_field: str) -> None:
    """Refuse a jsonl/json/parquet file whose first records lack `text_field`, before any work."""
    for file in files:
        if BUILDERS[os.path.splitext(file)[1].lower()] != "text":
            try:
                peek.check_text_field(file, text_field)
            except ValueError as error:
                raise ValueError(f"--text-field {text_field}: {error}") from None


def _refuse(error: Exception) -> NoReturn:
    """`error: ...` for a mistake in the command or its files (exit code 2); a bug keeps its
    traceback."""
    if isinstance(error, ValueError) and not deliberate(error):
        raise error
    sys.stderr.write(f"error: {error}\n")
    raise SystemExit(2) from None


def main(argv: Optional[Sequence[str]] = None, prog: str = "python -m lightning_mcore.data.preprocess") -> None:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Tokenize text/jsonl/parquet files into mcore indexed PREFIX.bin/.idx files.",
    )
    parser.add_argument("--input", nargs="+", required=True, help="files or globs")
    parser.add_argument("--tokenizer", required=True, help="HF tokenizer directory")
    parser.add_argument("--output-prefix", required=True, help="writes PREFIX.bin and PREFIX.idx")
    parser.add_argument("--text-field", default="text", help="document column of jsonl/parquet")
    parser.add_argument("--append-eos", action="store_true", help="end every document with EOS")
    parser.add_argument("--workers", type=int, default=None, help="tokenizing processes")
    parser.add_argument("--cache-dir", default=None, help="datasets cache directory")
    parser.add_argument("--overwrite", action="store_true", help="replace existing PREFIX.bin/.idx")
    args = parser.parse_args(argv)

    try:  # the mistakes found before any tokenizing: one line naming the file and the fix
        refuse_nameless(args.output_prefix)
        refuse_existing(args.output_prefix, args.overwrite)
        files = resolve_files(args.input)
        _check_text_fields(files, args.text_field)
    except (FileExistsError, FileNotFoundError, ValueError) as error:
        _refuse(error)
    tokenizer = load_tokenizer(args.tokenizer)
    try:
        documents = load_documents(files, args.text_field, args.cache_dir)
    except ValueError as error:  # a bad line further down a file
        _refuse(error)
    tokenized = tokenize_documents(documents, tokenizer, args.append_eos, args.workers)
    n_docs, n_tokens = write_indexed(tokenized, args.output_prefix, len(tokenizer))
    print(f"wrote {n_docs} documents, {n_tokens} tokens to {args.output_prefix}.bin/.idx")


if __name__ == "__main__":
    main()
