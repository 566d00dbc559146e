"""The first records of data files, read cheaply and without tokenizing.

Data modules check them in ``__init__``, so that an empty file, a missing field or an unknown
role is refused where the run is configured (the CLI, before any worker starts), not after every
rank has tokenized the whole dataset. Only a few records are read: a mistake further down the
file still surfaces when tokenizing, naming the sample.
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable, Optional, Sequence

from lightning_mcore.data import preprocess

PEEK_RECORDS = 100
# A JSON array must be parsed whole to reach its first record: only below this size.
MAX_ARRAY_BYTES = 64 * 2**20


def first_records(path: str, count: int = PEEK_RECORDS) -> Optional[tuple[list[str], list[dict]]]:
    """(column names, the first ``count`` records) of a jsonl/json/parquet file or a
    ``save_to_disk`` directory; None where that cannot be read cheaply (a large JSON array).
    An empty file gives ([], [])."""
    if os.path.isdir(os.path.expanduser(path)):
        return _saved_records(os.path.expanduser(path), count)
    builder = preprocess.BUILDERS[os.path.splitext(path)[1].lower()]
    if builder == "parquet":
        return _parquet_records(path, count)
    if builder == "json":
        return _json_records(path, count)
    raise ValueError(f"{path!r}: no records in a {builder} file")


def check_has_text(path: str) -> None:
    """Refuse a .txt file that holds nothing but whitespace (reads up to its first text)."""
    with open(path, "rb") as file:
        while True:
            block = file.read(1 << 20)
            if not block:
                raise ValueError(f"{path!r} holds no text (it is empty or only whitespace)")
            if block.strip():
                return


def check_text_field(path: str, text_field: str) -> None:
    """Refuse a jsonl/json/parquet pretraining file that is empty or lacks ``text_field``."""
    found = first_records(path, 1)
    if found is None:
        return
    columns, records = found
    if not records:
        raise ValueError(f"{path!r} holds no records (it is empty)")
    if text_field not in columns:
        raise ValueError(
            f"field {text_field!r} not found in {path}; columns found: {columns}; "
            f"set text_field to the column that holds the documents"
        )


def _columns(records: list[dict]) -> list[str]:
    seen: dict[str, None] = {}
    for record in records:
        seen.update(dict.fromkeys(record))
    return list(seen)


def _json_records(path: str, count: int) -> Optional[tuple[list[str], list[dict]]]:
    try:
        records = _read_json(path, count)
    except UnicodeDecodeError as err:
        raise ValueError(f"{path!r} is not UTF-8 text ({err})") from None
    if records is None:
        return None
    bad = next((i for i, r in enumerate(records) if not isinstance(r, dict)), None)
    if bad is not None:
        raise ValueError(
            f"{path!r}: record {bad} is a {type(records[bad]).__name__}, not a JSON object"
        )
    return _columns(records), records


def _read_json(path: str, count: int) -> Optional[list]:
    with open(path, encoding="utf-8") as file:
        head = file.read(4096).lstrip()
        if head.startswith("["):
            if os.path.getsize(path) > MAX_ARRAY_BYTES:
                return None
            file.seek(0)
            try:
                records = json.load(file)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path!r} is not valid JSON: {err}") from None
            records = records[:count]
        else:
            file.seek(0)
            records = []
            for number, line in enumerate(file, 1):
                if len(records) >= count:
                    break
                if not line.strip():
                    continue
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError as err:
                    if not path.lower().endswith(".jsonl"):
                        return None  # a .json file may hold one object over many lines
                    raise ValueError(
                        f"{path!r} line {number} is not valid JSON ({err}); a .jsonl file holds "
                        "one JSON object per line"
                    ) from None
    return records


def _parquet_records(path: str, count: int) -> tuple[list[str], list[dict]]:
    import pyarrow.parquet as pq

    try:
        file = pq.ParquetFile(path)
    except Exception as err:  # noqa: BLE001 - pyarrow's errors differ by version
        raise ValueError(f"{path!r} is not a readable parquet file: {err}") from None
    columns = list(file.schema_arrow.names)
    if file.metadata.num_rows == 0:
        return columns, []
    batch = next(file.iter_batches(batch_size=count))
    return columns, batch.to_pylist()


def _saved_records(path: str, count: int) -> Optional[tuple[list[str], list[dict]]]:
    import datasets

    try:
        loaded = datasets.load_from_disk(path)
    except Exception:  # noqa: BLE001 - not ours to judge here: load_records says why
        return None
    if isinstance(loaded, datasets.DatasetDict):
        if "train" not in loaded:
            return None
        loaded = loaded["train"]
    rows = loaded.select(range(min(count, len(loaded))))
    return list(loaded.column_names), [dict(row) for row in rows]


def records_of(paths: Sequence[str]) -> list[tuple[str, list[str], list[dict]]]:
    """(file, columns, first records) for each data path (globs expanded), leaving out what
    cannot be read cheaply; an empty file is refused here, naming it."""
    out = []
    for path in paths:
        files = [path] if os.path.isdir(os.path.expanduser(path)) else preprocess.resolve_files(path)
        for file in files:
            found = first_records(file)
            if found is None:
                continue
            columns, records = found
            if not records:
                raise ValueError(f"{file!r} holds no records (it is empty)")
            out.append((file, columns, records))
    return out


def check_records(paths: Sequence[str], reader: Callable[[list[str]], Callable[[dict, int], Any]]) -> None:
    """Read the first records of every file with ``reader(columns)(record, index)`` (a format's
    ``detect(...).read``); its ValueError comes back naming the file."""
    for file, columns, records in records_of(paths):
        try:
            read = reader(columns)
            for index, record in enumerate(records):
                read(record, index)
        except ValueError as err:
            raise ValueError(f"{file}: {err}") from None
