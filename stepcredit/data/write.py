"""Writing rows: atomically, as JSONL or Parquet by the output's extension."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from typing import Iterator, Literal, Sequence

import pyarrow as pa

OutputFormat = Literal["jsonl", "parquet"]


@contextlib.contextmanager
def atomic_path(path: str) -> Iterator[str]:
    """Yields a temporary path beside `path`; on success fsyncs it and renames it to `path`.

    On any exception the temporary file is removed and `path` (if it existed)
    is left as it was.
    """
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    handle, temporary = tempfile.mkstemp(dir=directory, prefix=f".{os.path.basename(path)}.",
                                         suffix=".tmp")
    os.close(handle)
    try:
        yield temporary
        with open(temporary, "rb+") as written:
            os.fsync(written.fileno())
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def output_format(path: str) -> OutputFormat:
    """'jsonl' or 'parquet' from the file extension, or a ValueError."""
    lower = os.fspath(path).lower()
    if lower.endswith((".jsonl", ".json")):
        return "jsonl"
    if lower.endswith(".parquet"):
        return "parquet"
    raise ValueError(f"{path}: the output must end in .jsonl, .json or .parquet")


class RowWriter:
    """Writes rows to `path` in `fmt` ("jsonl" or "parquet", see `output_format`), batch by batch.

    `path` is usually the temporary path of `atomic_path`; `close` the writer
    before leaving it. Parquet rows take the schema of the first table written;
    later tables are cast to it.
    """

    def __init__(self, path: str, fmt: OutputFormat):
        self._format = fmt
        self._path = path
        self._parquet = None
        self._jsonl = open(path, "w", encoding="utf-8") if fmt == "jsonl" else None

    def write_table(self, table: pa.Table) -> None:
        """Appends the rows of `table` (one JSON object per row for JSONL).

        Raises:
          ValueError: a Parquet table whose schema cannot be cast to the first one's.
        """
        if self._format == "jsonl":
            self.write_records(table.to_pylist())
            return
        import pyarrow.parquet as pq

        if self._parquet is None:
            self._parquet = pq.ParquetWriter(self._path, table.schema)
        elif table.schema != self._parquet.schema:
            try:
                table = table.cast(self._parquet.schema)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError, ValueError) as error:
                raise ValueError(f"rows do not share one Parquet schema ({error}); every row needs "
                                 f"the same fields of the same types (or write JSONL)") from None
        self._parquet.write_table(table)

    def write_records(self, records: Sequence[dict]) -> None:
        """Appends dict rows as JSON lines (JSONL only; NaN and infinity are refused)."""
        self._jsonl.write("".join(json.dumps(record, allow_nan=False) + "\n" for record in records))

    def close(self) -> None:
        """Flushes and closes the file."""
        if self._jsonl is not None:
            self._jsonl.close()
        if self._parquet is not None:
            self._parquet.close()
