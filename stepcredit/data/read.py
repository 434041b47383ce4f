"""Reading a log of step rows: its sources, read in batches of rows as stored.

Sources: a JSONL file (`.jsonl`, `.json`), a Parquet file (`.parquet`), a folder
written by `datasets.Dataset.save_to_disk`, or any `datasets.Dataset`. The
readers yield the rows untouched (dicts for JSONL, `pyarrow.Table`s otherwise),
`batch_rows` at a time, so memory stays bounded however many steps the source
holds; `stepcredit.data.checks` validates them and `stepcredit.data.stream`
re-cuts them at trajectory boundaries.
"""

from __future__ import annotations

import json
import os
from typing import Iterator, Literal

import pyarrow as pa

from stepcredit.data.checks import RecordError

BATCH_ROWS = 16384
"""Rows read at a time by default."""

SourceKind = Literal["jsonl", "parquet", "folder"]


def source_kind(path: str) -> SourceKind:
    """The kind of a source path: "folder" (save_to_disk), "jsonl" or "parquet", or a ValueError."""
    if os.path.isdir(path):
        return "folder"
    lower = path.lower()
    if lower.endswith((".jsonl", ".json")):
        return "jsonl"
    if lower.endswith(".parquet"):
        return "parquet"
    raise ValueError(f"{path}: unknown format; use a .jsonl/.json or .parquet file, a "
                     f"save_to_disk folder or a datasets.Dataset")


def source_rows(source) -> int | None:
    """The number of rows of `source` when known without reading it (None for JSONL)."""
    import datasets

    if isinstance(source, datasets.Dataset):
        return len(source)
    kind = source_kind(os.fspath(source))
    if kind == "parquet":
        import pyarrow.parquet as pq

        return pq.ParquetFile(source).metadata.num_rows
    if kind == "folder":
        return len(datasets.load_from_disk(os.fspath(source)))
    return None


def is_jsonl(source) -> bool:
    """Whether `source` is a JSONL path (read by `read_jsonl`; all others by `read_arrow`)."""
    import datasets

    return not isinstance(source, (datasets.Dataset, datasets.DatasetDict)) and \
        source_kind(os.fspath(source)) == "jsonl"


def read_jsonl(path: str, batch_rows: int) -> Iterator[list[dict]]:
    """The records of a UTF-8 JSONL file, `batch_rows` dicts at a time (blank lines skipped).

    A UTF-8 byte order mark before the first line is skipped.

    Raises:
      RecordError: a line that is not UTF-8, not valid JSON or not a JSON
        object, naming its row (0-based, counting records) and its line number
        (1-based, counting every line), e.g.
        "row 5, field '<line>': input line 7 is not UTF-8: invalid start byte at byte 12 ...".
    """
    batch: list[dict] = []
    row = 0
    with open(path, "rb") as handle:
        for line_number, data in enumerate(handle, 1):
            try:
                line = data.decode("utf-8-sig" if line_number == 1 else "utf-8")
            except UnicodeDecodeError as error:
                raise RecordError(row, "<line>", f"input line {line_number} is not UTF-8: "
                                  f"{error.reason} at byte {error.start} of the line "
                                  f"({data[error.start:error.start + 4]!r}); save the log as UTF-8"
                                  ) from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise RecordError(row, "<line>", f"line {line_number} is not valid JSON ({error})") from None
            if not isinstance(record, dict):
                raise RecordError(row, "<line>", f"line {line_number} is a JSON "
                                  f"{type(record).__name__}, not an object")
            batch.append(record)
            row += 1
            if len(batch) == batch_rows:
                yield batch
                batch = []
    if batch:
        yield batch


def read_arrow(source, batch_rows: int) -> Iterator[pa.Table]:
    """The rows of a Parquet file, save_to_disk folder or `datasets.Dataset`, as tables.

    Each table holds `batch_rows` rows (the last fewer), with the source's own
    columns and types; a Parquet file is streamed, never read whole.

    Raises:
      TypeError: a `datasets.DatasetDict` (several splits), or a folder holding one.
    """
    import datasets

    if isinstance(source, datasets.DatasetDict):
        raise TypeError(f"a DatasetDict holds several splits ({', '.join(source)}); pass one of them")
    if not isinstance(source, datasets.Dataset):
        path = os.fspath(source)
        if source_kind(path) == "parquet":
            import pyarrow.parquet as pq

            # pre_buffer would keep every row group read so far in memory
            for record_batch in pq.ParquetFile(path, pre_buffer=False).iter_batches(batch_size=batch_rows):
                yield pa.Table.from_batches([record_batch])
            return
        source = datasets.load_from_disk(path)
        if isinstance(source, datasets.DatasetDict):
            raise TypeError(f"{path} holds a DatasetDict ({', '.join(source)}); pass one split's folder")
    yield from source.with_format("arrow").iter(batch_size=batch_rows)
