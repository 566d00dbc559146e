"""The first records of data files, read cheaply and without tokenizing.

Data modules check them in ``__init__``, so that an empty file, a missing field or an unknown
role is refused where the run is configured (the CLI, before any worker starts), not after every
rank has tokenized the whole dataset. Only a few records are read: a mistake further down the
file still surfaces when tokenizing, naming the sample.
"""

from __future__ import annotations

import json
import os
from typing import IO, Any, Callable, Iterator, Optional, Sequence

from lightning_mcore.data.files import BUILDERS, resolve_files

PEEK_RECORDS = 100
# A JSON array must be parsed whole to reach its first record: only below this size.
MAX_ARRAY_BYTES = 64 * 2**20


def first_records(path: str, count: int = PEEK_RECORDS) -> Optional[tuple[list[str], list[dict]]]:
    """(column names, the first ``count`` records) of a jsonl/json/parquet file or a
    ``save_to_disk`` directory; None where that cannot be read cheaply (a large JSON array).
    An empty file gives ([], [])."""
    if os.path.isdir(os.path.expanduser(path)):
        return _saved_records(os.path.expanduser(path), count)
    builder = BUILDERS[os.path.splitext(path)[1].lower()]
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
            try:
                for _, record in json_lines(path, file):
                    records.append(record)
                    if len(records) >= count:
                        break
            except ValueError:
                if not path.lower().endswith(".jsonl"):
                    return None  # a .json file may hold one object over many lines
                raise
    return records


def json_lines(path: str, file: Optional[IO[str]] = None) -> Iterator[tuple[int, Any]]:
    """(line number, record) of each line of a JSON-lines file (blank lines skipped), one at a
    time; a line that is not JSON refused naming the file and its line number."""
    if file is None:
        with open(path, encoding="utf-8") as opened:
            yield from json_lines(path, opened)
        return
    for number, line in enumerate(file, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(
                f"{path!r} line {number} is not valid JSON ({err}); a .jsonl file holds "
                "one JSON object per line"
            ) from None
        yield number, record


def check_json_lines(path: str) -> None:
    """Read a whole JSON-lines file (not only its first records), refusing its first line that
    is not JSON (json_lines) or not a JSON object."""
    for number, record in json_lines(path):
        if not isinstance(record, dict):
            raise ValueError(f"{path!r} line {number} is a JSON {type(record).__name__}, not an "
                             "object; a .jsonl file holds one JSON object per line")


def _parquet_records(path: str, count: int) -> tuple[list[str], list[dict]]:
    import pyarrow.parquet as pq  # lazy: pyarrow.parquet (~30 ms) only for a .parquet file

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
    loaded = _saved_dataset(path)
    if loaded is None:
        return None
    rows = loaded.select(range(min(count, len(loaded))))
    return list(loaded.column_names), [dict(row) for row in rows]


def _saved_dataset(path: str) -> Any:
    """The (train split of the) ``save_to_disk`` dataset at `path`, memory-mapped; None where
    it cannot be loaded (load_records says why)."""
    import datasets  # lazy: datasets' import takes ~0.4 s, which `import lightning_mcore` and `--help` skip

    try:
        loaded = datasets.load_from_disk(path)
    except Exception:  # noqa: BLE001 - not ours to judge here: load_records says why
        return None
    if isinstance(loaded, datasets.DatasetDict):
        return loaded["train"] if "train" in loaded else None
    return loaded


def records_of(paths: Sequence[str]) -> list[tuple[str, list[str], list[dict]]]:
    """(file, columns, first records) for each data path (globs expanded), leaving out what
    cannot be read cheaply; an empty file is refused here, naming it."""
    out = []
    for file in data_files(paths):
        found = first_records(file)
        if found is None:
            continue
        columns, records = found
        if not records:
            raise ValueError(f"{file!r} holds no records (it is empty)")
        out.append((file, columns, records))
    return out


def data_files(paths: Sequence[str]) -> list[str]:
    """The files (globs expanded) and saved dataset directories of data paths, in order."""
    return [file for path in paths for file in
            ([path] if os.path.isdir(os.path.expanduser(path)) else resolve_files(path))]


def column_values(path: str, column: str) -> Optional[Iterator[Any]]:
    """Every record's `column` value (None where a record lacks it) of a data file or saved
    dataset directory, read as they are taken: a caller that stops early reads no further.
    None where that cannot be done cheaply (a large JSON array, a missing column)."""
    if os.path.isdir(os.path.expanduser(path)):
        loaded = _saved_dataset(os.path.expanduser(path))
        return iter(loaded[column]) if loaded is not None and column in loaded.column_names else None
    if BUILDERS[os.path.splitext(path)[1].lower()] == "parquet":
        import pyarrow.parquet as pq  # lazy: pyarrow.parquet (~30 ms) only for a .parquet file

        file = pq.ParquetFile(path)
        if column not in file.schema_arrow.names:
            return None
        return (v for batch in file.iter_batches(columns=[column]) for v in batch.column(0).to_pylist())
    with open(path, encoding="utf-8") as file:
        array = file.read(4096).lstrip().startswith("[")
    if array:  # every record (there are fewer than bytes), if the array is small enough
        records = _read_json(path, os.path.getsize(path))
        return None if records is None else (r.get(column) if isinstance(r, dict) else None for r in records)
    return (r.get(column) if isinstance(r, dict) else None for _, r in json_lines(path))


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
