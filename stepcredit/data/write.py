"""Writing rows: atomically, as JSONL or Parquet by the output's extension."""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import socket
from typing import Iterator, Literal, Sequence

import pyarrow as pa

OutputFormat = Literal["jsonl", "parquet"]


def _host() -> str:
    """This machine's name, with '_' for every character other than [A-Za-z0-9.]."""
    return re.sub(r"[^A-Za-z0-9.]", "_", socket.gethostname()) or "_"


def _temporary_name(path: str) -> re.Pattern:
    """The names of `path`'s temporary files: `.NAME.tmp-HOST-PID-RANDOM` (8 hex digits)."""
    return re.compile(rf"\.{re.escape(os.path.basename(path))}\.tmp-(?P<host>[A-Za-z0-9._]+)"
                      rf"-(?P<pid>[0-9]+)-[0-9a-f]{{8}}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):  # another user's process; no pid of this system
        return True
    return True


def remove_stale_temporaries(path: str) -> list[str]:
    """Removes the temporary files that killed runs of `atomic_path(path)` left behind.

    A temporary file of `path` is named `.NAME.tmp-HOST-PID-RANDOM` beside it
    (NAME: `path`'s file name); it is stale when HOST is this machine and no
    process PID is running. Files of other machines (a shared folder), of
    running processes and of other names are left alone. Nothing is done
    outside POSIX systems.

    Returns:
      The paths removed.
    """
    if os.name != "posix":
        return []
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    pattern, host = _temporary_name(path), _host()
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    removed = []
    for name in names:
        match = pattern.fullmatch(name)
        if match is None or match["host"] != host or _alive(int(match["pid"])):
            continue
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(directory, name))
            removed.append(os.path.join(directory, name))
    return removed


@contextlib.contextmanager
def atomic_path(path: str) -> Iterator[str]:
    """Yields a temporary path beside `path`; on success fsyncs it and renames it to `path`.

    The temporary file is `.NAME.tmp-HOST-PID-RANDOM` in `path`'s folder,
    created with the mode of a new file (0o666 minus the umask), which `path`
    keeps. On any exception it is removed and `path` (if it existed) is left as
    it was; a killed process leaves it behind, and the next `atomic_path` on
    the same `path` removes it (`remove_stale_temporaries`).
    """
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    remove_stale_temporaries(path)
    prefix = os.path.join(directory, f".{os.path.basename(path)}.tmp-{_host()}-{os.getpid()}-")
    while True:
        temporary = prefix + secrets.token_hex(4)
        try:
            os.close(os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
            break
        except FileExistsError:
            continue
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
