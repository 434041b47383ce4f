"""Loading, validating and saving step rows, streamed in batches of whole trajectories.

Sources: a JSONL file (`.jsonl`, `.json`), a Parquet file (`.parquet`), a folder
written by `datasets.Dataset.save_to_disk`, or any `datasets.Dataset`. They are
read in batches of `batch_rows` rows and re-cut at trajectory boundaries (or
group boundaries, with `by="group"`), so memory stays bounded however many
steps the source holds.

Ordering requirement: the rows of one trajectory are contiguous (in any step
order); with `by="group"` (group estimators), the rows of one group are
contiguous too. A log that interleaves them is sorted first, e.g.
`dataset.sort(["group_id", "trajectory_id", "step_index"])`.

Every bad record raises `RecordError`, naming the row (0-based, counting
records) and the field.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from typing import Any, Iterable, Iterator, Literal, NamedTuple, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from stepcredit.data import schema

By = Literal["trajectory", "group"]
BATCH_ROWS = 16384


class RecordError(ValueError):
    """A bad record: `row` (0-based record index) and `field` say where."""

    def __init__(self, row: int, field: str, message: str):
        super().__init__(f"row {row}, field {field!r}: {message}")
        self.row = row
        self.field = field


class StepRows(NamedTuple):
    """A validated batch of whole trajectories (or whole groups) of step rows.

    Attributes:
      start: index of the first row in the source.
      table: the rows in the schema's types (`schema.ARROW_SCHEMA`), in source order.
      source_rows: the same rows as read (a `pyarrow.Table`, or a list of dicts
        for JSONL), untouched.
      trajectory_starts: `[num_trajectories + 1]` offsets of each trajectory's
        first row within `table`, ending with `len(table)`.
    """

    start: int
    table: pa.Table
    source_rows: Any
    trajectory_starts: np.ndarray


class Summary(NamedTuple):
    """Counts of a validated source."""

    rows: int
    trajectories: int
    groups: int


# ---------------------------------------------------------------- sources


def _kind_of_path(path: str) -> str:
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
    kind = _kind_of_path(os.fspath(source))
    if kind == "parquet":
        import pyarrow.parquet as pq

        return pq.ParquetFile(source).metadata.num_rows
    if kind == "folder":
        return len(datasets.load_from_disk(os.fspath(source)))
    return None


def _read_jsonl(path: str, batch_rows: int) -> Iterator[list[dict]]:
    batch: list[dict] = []
    row = 0
    with open(path, encoding="utf-8") as handle:
        for line_number, line in enumerate(handle, 1):
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


def _read_arrow(source, batch_rows: int) -> Iterator[pa.Table]:
    import datasets

    if isinstance(source, datasets.DatasetDict):
        raise TypeError(f"a DatasetDict holds several splits ({', '.join(source)}); pass one of them")
    if not isinstance(source, datasets.Dataset):
        path = os.fspath(source)
        if _kind_of_path(path) == "parquet":
            import pyarrow.parquet as pq

            # pre_buffer would keep every row group read so far in memory
            for record_batch in pq.ParquetFile(path, pre_buffer=False).iter_batches(batch_size=batch_rows):
                yield pa.Table.from_batches([record_batch])
            return
        source = datasets.load_from_disk(path)
        if isinstance(source, datasets.DatasetDict):
            raise TypeError(f"{path} holds a DatasetDict ({', '.join(source)}); pass one split's folder")
    yield from source.with_format("arrow").iter(batch_size=batch_rows)


def _is_jsonl(source) -> bool:
    import datasets

    return not isinstance(source, (datasets.Dataset, datasets.DatasetDict)) and \
        _kind_of_path(os.fspath(source)) == "jsonl"


# ---------------------------------------------------------------- types


def _value_ok(kind: str, value) -> bool:
    number = (int, float)
    if kind == "id":
        return isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool))
    if kind == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "float":
        return isinstance(value, number) and not isinstance(value, bool)
    if kind == "bool":
        return isinstance(value, bool)
    if kind == "json":
        return isinstance(value, str)
    if not isinstance(value, list):
        return False
    element = int if kind == "int_list" else number
    return all(isinstance(v, element) and not isinstance(v, bool) for v in value)


_EXPECTED = {"id": "a string or an integer", "int": "an integer", "float": "a number",
             "bool": "a boolean", "json": "a JSON string", "int_list": "a list of integers",
             "float_list": "a list of numbers"}


def _canonical_records(records: list[dict], start: int) -> pa.Table:
    """The records in the schema's types; raises `RecordError` at the first bad record."""
    rows = []
    for offset, record in enumerate(records):
        missing = [name for name in schema.REQUIRED if name not in record]
        if missing:
            raise RecordError(start + offset, missing[0], "missing field")
        row = {name: record.get(name) for name in schema.FIELDS}
        for name in ("trajectory_id", "group_id", "anchor"):
            value = row[name]
            if isinstance(value, int) and not isinstance(value, bool):
                row[name] = str(value)
        rows.append(row)
    columns = []
    for name in schema.FIELDS:
        target = schema.ARROW_SCHEMA.field(name).type
        try:
            inferred = pa.array([row[name] for row in rows])  # inferred first: no silent truncation
            if not _arrow_type_ok(schema.KIND[name], inferred.type):
                raise TypeError(inferred.type)
            columns.append(inferred.cast(target))
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, OverflowError) as error:
            _raise_first_bad(records, name, start, error)
    return pa.Table.from_arrays(columns, schema=schema.ARROW_SCHEMA)


def _raise_first_bad(records: list[dict], name: str, start: int, error: Exception):
    kind = schema.KIND[name]
    for offset, record in enumerate(records):
        value = record.get(name)
        if value is not None and not _value_ok(kind, value):
            raise RecordError(start + offset, name, f"has {type(value).__name__} {_short(value)}; "
                              f"it must be {_EXPECTED[kind]}") from None
    raise RecordError(start, name, f"rows {start}..{start + len(records) - 1} do not fit "
                      f"{schema.ARROW_SCHEMA.field(name).type}: {error}") from None


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _arrow_type_ok(kind: str, arrow_type: pa.DataType) -> bool:
    if pa.types.is_null(arrow_type):
        return True
    integer = pa.types.is_integer(arrow_type)
    if kind == "id":
        return integer or pa.types.is_string(arrow_type) or pa.types.is_large_string(arrow_type)
    if kind == "int":
        return integer
    if kind == "float":
        return integer or pa.types.is_floating(arrow_type)
    if kind == "bool":
        return pa.types.is_boolean(arrow_type)
    if kind == "json":
        return pa.types.is_string(arrow_type) or pa.types.is_large_string(arrow_type)
    if not (pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type)):
        return False
    item = arrow_type.value_type
    return pa.types.is_null(item) or pa.types.is_integer(item) or (
        kind == "float_list" and pa.types.is_floating(item))


def _first(mask) -> int:
    return int(np.flatnonzero(np.asarray(mask))[0])


def _canonical_table(table: pa.Table, start: int) -> pa.Table:
    """An Arrow batch in the schema's types; raises `RecordError` naming row and field."""
    columns = []
    for name in schema.FIELDS:
        target = schema.ARROW_SCHEMA.field(name).type
        if name not in table.column_names:
            if name in schema.REQUIRED:
                raise RecordError(start, name, "missing field")
            columns.append(pa.nulls(len(table), target))
            continue
        column = table.column(name)
        if not _arrow_type_ok(schema.KIND[name], column.type):
            valid = column.is_valid().to_numpy(zero_copy_only=False)
            row = start + (_first(valid) if valid.any() else 0)
            raise RecordError(row, name, f"has type {column.type}; it must be "
                              f"{_EXPECTED[schema.KIND[name]]}")
        try:
            columns.append(column.cast(target))
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as error:
            raise RecordError(start, name, f"cannot be read as {target} in rows {start}.."
                              f"{start + len(table) - 1}: {error}") from None
    return pa.Table.from_arrays(columns, schema=schema.ARROW_SCHEMA)


def _check_values(table: pa.Table, start: int) -> None:
    """Row-wise checks that need no other row."""
    for name in schema.REQUIRED:
        column = table.column(name)
        if column.null_count:
            raise RecordError(start + _first(column.is_null().to_numpy(zero_copy_only=False)), name,
                              "is null; the field is required")
    steps = table.column("step_index").to_numpy()
    if (steps < 0).any():
        row = _first(steps < 0)
        raise RecordError(start + row, "step_index", f"is {steps[row]}; it must be >= 0")
    lengths = pc.list_value_length(table.column("response_ids")).to_numpy(zero_copy_only=False)
    if (lengths == 0).any():
        raise RecordError(start + _first(lengths == 0), "response_ids",
                          "is empty; every step has at least one response token")
    for name in ("response_logprobs", "response_entropies", "response_values"):
        other = pc.list_value_length(table.column(name)).to_numpy(zero_copy_only=False)
        bad = ~np.isnan(other.astype(np.float64)) & (other != lengths)
        if bad.any():
            row = _first(bad)
            raise RecordError(start + row, name, f"has length {int(other[row])} but response_ids "
                              f"has length {int(lengths[row])}; they must be equal")
    for name in ("reward", "value", "score", "bootstrap_value", "entropy"):
        values = table.column(name).to_numpy(zero_copy_only=False).astype(np.float64)
        valid = table.column(name).is_valid().to_numpy(zero_copy_only=False)
        bad = valid & ~np.isfinite(np.where(valid, values, 0.0))
        if bad.any():
            row = _first(bad)
            raise RecordError(start + row, name, f"is {values[row]}; it must be finite")
    both = (table.column("done").to_numpy(zero_copy_only=False)
            & table.column("truncated").to_numpy(zero_copy_only=False))
    if both.any():
        raise RecordError(start + _first(both), "truncated",
                          "done and truncated are both true; a step ends an episode one way")


# ---------------------------------------------------------------- structure


class _SeenKeys:
    """Ids already finished, as 64-bit hashes (8 bytes per id) in sorted runs of doubling size.

    Each run is at most half the size of the one before it (merged when not),
    so a lookup searches O(log n) runs and adding n ids costs O(n log n) in all.
    """

    def __init__(self):
        self._runs: list[np.ndarray] = []

    @staticmethod
    def hashes(ids: np.ndarray) -> np.ndarray:
        import pandas as pd

        return pd.util.hash_array(ids.astype(object), categorize=False).astype(np.uint64)

    def __len__(self) -> int:
        return sum(len(run) for run in self._runs)

    def seen(self, hashes: np.ndarray) -> np.ndarray:
        found = np.zeros(len(hashes), bool)
        for run in self._runs:
            position = np.minimum(np.searchsorted(run, hashes), len(run) - 1)
            found |= run[position] == hashes
        return found

    def add(self, hashes: np.ndarray) -> None:
        if not len(hashes):
            return
        self._runs.append(np.unique(hashes))
        while len(self._runs) > 1 and 2 * len(self._runs[-1]) > len(self._runs[-2]):
            last = self._runs.pop()
            self._runs[-1] = np.union1d(self._runs[-1], last)


def _block_starts(ids: np.ndarray) -> np.ndarray:
    change = np.flatnonzero(ids[1:] != ids[:-1]) + 1
    return np.concatenate([[0], change, [len(ids)]]).astype(np.int64)


def _check_reappearance(kind: str, ids: np.ndarray, starts: np.ndarray, seen: _SeenKeys,
                        start: int) -> None:
    first_rows = starts[:-1]
    block_ids = ids[first_rows]
    hashes = _SeenKeys.hashes(block_ids)
    again = seen.seen(hashes)
    _, first_index = np.unique(hashes, return_index=True)
    repeated = np.ones(len(hashes), bool)
    repeated[first_index] = False
    bad = again | repeated
    if bad.any():
        block = _first(bad)
        field = f"{kind}_id"
        raise RecordError(start + int(first_rows[block]), field,
                          f"{kind} {block_ids[block]!r} appears again after other {kind}s' rows; "
                          f"the rows of one {kind} must be contiguous (sort the rows by group_id, "
                          f"trajectory_id, step_index first)")
    seen.add(hashes)


def _first_change_within(values: np.ndarray, block: np.ndarray) -> int | None:
    """The first row whose value differs from the previous row of the same block, or None."""
    changes = np.flatnonzero(values[1:] != values[:-1]) + 1
    changes = changes[block[changes] == block[changes - 1]]
    return int(changes[0]) if len(changes) else None


def _check_trajectories(table: pa.Table, starts: np.ndarray, start: int) -> None:
    """Checks every (complete) trajectory block of `table` delimited by `starts`."""
    trajectories = table.column("trajectory_id").to_numpy(zero_copy_only=False)
    groups = table.column("group_id").to_numpy(zero_copy_only=False)
    steps = table.column("step_index").to_numpy()
    count = len(steps)
    lengths = np.diff(starts)
    block = np.repeat(np.arange(len(lengths)), lengths)

    row = _first_change_within(groups, block)
    if row is not None:
        raise RecordError(start + row, "group_id", f"trajectory {trajectories[row]!r} is split across "
                          f"groups {groups[row - 1]!r} and {groups[row]!r}; a trajectory belongs "
                          f"to one group")

    order = np.lexsort((steps, block))
    ordered = steps[order]
    expected = np.arange(count) - starts[block]
    wrong = ordered != expected
    if wrong.any():
        k = _first(wrong)
        row = int(order[k])
        name = trajectories[row]
        if k > 0 and block[k] == block[k - 1] and ordered[k] == ordered[k - 1]:
            raise RecordError(start + row, "step_index", f"duplicate step: trajectory {name!r} has "
                              f"step_index {ordered[k]} twice (rows {start + int(order[k - 1])} and "
                              f"{start + row})")
        raise RecordError(start + row, "step_index", f"step indices of trajectory {name!r} are not "
                          f"contiguous: step_index {ordered[k]} where {expected[k]} is missing "
                          f"(steps run 0, 1, ..., n - 1)")

    last = steps == (lengths - 1)[block]
    for name in ("done", "truncated"):
        early = table.column(name).to_numpy(zero_copy_only=False) & ~last
        if early.any():
            row = _first(early)
            raise RecordError(start + row, name, f"is true on step {steps[row]} but trajectory "
                              f"{trajectories[row]!r} continues to step {lengths[block[row]] - 1}")
    bootstrap = table.column("bootstrap_value").is_valid().to_numpy(zero_copy_only=False) & ~last
    if bootstrap.any():
        row = _first(bootstrap)
        raise RecordError(start + row, "bootstrap_value", f"is set on step {steps[row]}, not the last "
                          f"step of trajectory {trajectories[row]!r}; it is the value after the last step")
    score_column = table.column("score")
    scores = np.where(score_column.is_valid().to_numpy(zero_copy_only=False),
                      score_column.to_numpy(zero_copy_only=False).astype(np.float64), np.inf)
    row = _first_change_within(scores, block)
    if row is not None:
        raise RecordError(start + row, "score", f"trajectory {trajectories[row]!r} has score "
                          f"{_null_or(scores[row - 1])} on one row and {_null_or(scores[row])} on "
                          f"another; a trajectory has one score")


def _null_or(x: float):
    return None if x == np.inf else x


def iter_batches(source, *, by: By = "trajectory", batch_rows: int = BATCH_ROWS) -> Iterator[StepRows]:
    """Reads, validates and yields the rows of `source` in batches of whole trajectories.

    Each batch holds about `batch_rows` rows (more when one trajectory or group
    is longer). With `by="group"`, batches hold whole groups and the rows of a
    group must be contiguous. Memory is bounded by the batch size plus 8 bytes
    per trajectory (and per group) already read, kept to detect an id that
    comes back after its rows ended.

    Args:
      source: a path (JSONL, Parquet, save_to_disk folder) or a `datasets.Dataset`.
      by: the unit never split across batches: "trajectory" or "group".
      batch_rows: rows read at a time.

    Yields:
      `StepRows`, in source order, covering every row once.

    Raises:
      RecordError: a missing field, a wrong type, a null required field, a
        step index gap or duplicate, a trajectory split across groups, or a
        trajectory (or group) whose rows are not contiguous; naming the row
        and the field.
    """
    if by not in ("trajectory", "group"):
        raise ValueError(f"iter_batches: by={by!r}; it must be 'trajectory' or 'group'")
    if batch_rows < 1:
        raise ValueError(f"iter_batches: batch_rows={batch_rows}; it must be positive")
    jsonl = _is_jsonl(source)
    raw_batches: Iterable = (_read_jsonl(os.fspath(source), batch_rows) if jsonl
                             else _read_arrow(source, batch_rows))
    seen = {"trajectory": _SeenKeys(), "group": _SeenKeys()}
    pending_table = pending_raw = None
    start = read = 0
    for raw in _chain_end(raw_batches):
        final = raw is None
        if not final:
            table = _canonical_records(raw, read) if jsonl else _canonical_table(raw, read)
            _check_values(table, read)
            read += len(table)
            if pending_table is not None:
                table = pa.concat_tables([pending_table, table])
                raw = pending_raw + raw if jsonl else pa.concat_tables([pending_raw, raw])
        elif pending_table is None:
            return
        else:
            table, raw = pending_table, pending_raw
        unit = table.column(f"{by}_id").to_numpy(zero_copy_only=False)
        unit_starts = _block_starts(unit)
        cut = len(table) if final else int(unit_starts[-2])
        if cut == 0:
            pending_table, pending_raw = table, raw
            continue
        done_table = table.slice(0, cut)
        trajectories = done_table.column("trajectory_id").to_numpy(zero_copy_only=False)
        starts = _block_starts(trajectories)
        _check_reappearance("trajectory", trajectories, starts, seen["trajectory"], start)
        if by == "group":
            _check_reappearance("group", unit[:cut], unit_starts[unit_starts <= cut], seen["group"],
                                start)
        _check_trajectories(done_table, starts, start)
        yield StepRows(start, done_table, raw[:cut] if jsonl else raw.slice(0, cut), starts)
        start += cut
        pending_table = table.slice(cut) if cut < len(table) else None
        pending_raw = (raw[cut:] if jsonl else raw.slice(cut)) if cut < len(table) else None
        if final:
            return


def _chain_end(batches: Iterable) -> Iterator:
    yield from batches
    yield None


def validate(source, *, by: By = "trajectory", batch_rows: int = BATCH_ROWS) -> Summary:
    """Validates every row of `source` (see `iter_batches`) and counts what it holds."""
    rows = trajectories = 0
    groups = _SeenKeys()
    for batch in iter_batches(source, by=by, batch_rows=batch_rows):
        rows += len(batch.table)
        trajectories += len(batch.trajectory_starts) - 1
        group_ids = batch.table.column("group_id").to_numpy(zero_copy_only=False)
        hashes = np.unique(_SeenKeys.hashes(group_ids))
        groups.add(hashes[~groups.seen(hashes)])
    return Summary(rows, trajectories, len(groups))


def load(source, *, batch_rows: int = BATCH_ROWS):
    """Validates `source` and returns it as a `datasets.Dataset` with the schema's features.

    Columns outside the schema are kept; schema columns are cast to their
    types (integer ids and anchors become their decimal strings).
    """
    import datasets

    validate(source, batch_rows=batch_rows)
    if isinstance(source, datasets.Dataset):
        dataset = source
    elif _kind_of_path(os.fspath(source)) == "folder":
        dataset = datasets.load_from_disk(os.fspath(source))
    else:
        builder = "json" if _is_jsonl(source) else "parquet"
        dataset = datasets.load_dataset(builder, data_files=os.fspath(source), split="train")
    features = dataset.features.copy()
    for name in dataset.column_names:
        if name in schema.FEATURES:
            features[name] = schema.FEATURES[name]
    return dataset.cast(features)


# ---------------------------------------------------------------- writing


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


def output_format(path: str) -> str:
    """'jsonl' or 'parquet' from the file extension, or a ValueError."""
    lower = os.fspath(path).lower()
    if lower.endswith((".jsonl", ".json")):
        return "jsonl"
    if lower.endswith(".parquet"):
        return "parquet"
    raise ValueError(f"{path}: the output must end in .jsonl, .json or .parquet")


class RowWriter:
    """Writes tables (Parquet) or dict rows (JSONL) to an open temporary path."""

    def __init__(self, path: str, fmt: str):
        self._format = fmt
        self._path = path
        self._parquet = None
        self._jsonl = open(path, "w", encoding="utf-8") if fmt == "jsonl" else None

    def write_table(self, table: pa.Table) -> None:
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
        self._jsonl.write("".join(json.dumps(record, allow_nan=False) + "\n" for record in records))

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
        if self._parquet is not None:
            self._parquet.close()


# ---------------------------------------------------------------- trajectories


def _trajectory_rows(trajectory, trajectory_id: str) -> list[dict]:
    rows = []
    last = len(trajectory.steps) - 1
    for t, step in enumerate(trajectory.steps):
        entropies = None if step.action_entropy is None else [float(x) for x in step.action_entropy]
        bootstrap = None
        if t == last and (step.truncated or trajectory.bootstrap_value != 0.0):
            bootstrap = float(trajectory.bootstrap_value)
        rows.append({
            "trajectory_id": trajectory_id,
            "group_id": str(int(trajectory.group_id)),
            "step_index": t,
            "prompt_ids": [int(x) for x in (step.observation_ids if step.prompt_ids is None
                                            else step.prompt_ids)],
            "observation_ids": (None if step.prompt_ids is None
                                else [int(x) for x in step.observation_ids]),
            "response_ids": [int(x) for x in step.action_ids],
            "response_logprobs": [float(x) for x in step.action_logp],
            "reward": float(step.reward),
            "done": bool(step.done),
            "truncated": bool(step.truncated),
            "entropy": None if entropies is None else float(np.mean(np.asarray(entropies, np.float32))),
            "anchor": None if step.anchor is None else str(int(step.anchor)),
            "value": None if step.value is None else float(step.value),
            "score": None if trajectory.score is None else float(trajectory.score),
            "metadata": json.dumps(dict(step.info), sort_keys=True) if step.info else None,
            "response_entropies": entropies,
            "response_values": None,
            "bootstrap_value": bootstrap,
        })
    return rows


def save_trajectories(trajectories: Sequence, path: str, *, trajectory_ids: Sequence[str] | None = None,
                      batch_rows: int = BATCH_ROWS) -> int:
    """Writes `stepcredit.batch.Trajectory`s as step rows of the schema, atomically.

    Mapping: `prompt_ids` (the step's full prompt, or `observation_ids` when
    there is none) -> `prompt_ids`, and then `observation_ids` -> `observation_ids`;
    `action_ids` -> `response_ids`,
    `action_logp` -> `response_logprobs`, `action_entropy` ->
    `response_entropies` (and their mean -> `entropy`), the integer `anchor` and
    `group_id` -> their decimal strings, `info` -> `metadata` (JSON, so its
    values must be JSON-serialisable), the trajectory's `score` -> `score` on
    each of its rows, its `bootstrap_value` -> `bootstrap_value` on its last
    row when that step was truncated or the value is not 0.

    Args:
      trajectories: the episodes, each with at least one step.
      path: a `.jsonl`/`.json` or `.parquet` file; written through a temporary
        file in the same folder, then renamed.
      trajectory_ids: one id per trajectory; default "0", "1", ...
      batch_rows: rows per written batch.

    Returns:
      The number of rows written.
    """
    fmt = output_format(path)
    if trajectory_ids is None:
        trajectory_ids = [str(i) for i in range(len(trajectories))]
    if len(trajectory_ids) != len(trajectories):
        raise ValueError(f"save_trajectories: {len(trajectory_ids)} trajectory_ids for "
                         f"{len(trajectories)} trajectories")
    written = 0
    with atomic_path(path) as temporary:
        writer = RowWriter(temporary, fmt)
        try:
            rows: list[dict] = []
            for i, (trajectory, name) in enumerate(zip(trajectories, trajectory_ids)):
                if not trajectory.steps:
                    raise ValueError(f"save_trajectories: trajectories[{i}] has no steps")
                rows.extend(_trajectory_rows(trajectory, str(name)))
                if len(rows) >= batch_rows:
                    writer.write_table(pa.Table.from_pylist(rows, schema=schema.ARROW_SCHEMA))
                    written, rows = written + len(rows), []
            if rows or written == 0:
                writer.write_table(pa.Table.from_pylist(rows, schema=schema.ARROW_SCHEMA))
                written += len(rows)
        finally:
            writer.close()
    return written


def _parse_int(text: str | None, kind: str, field: str, row: int) -> int | None:
    if text is None:
        return None
    try:
        return int(text)
    except ValueError:
        if kind == "anchor":
            from stepcredit.anchors import observation_key

            return observation_key(text)
        raise RecordError(row, field, f"is {text!r}; load_trajectories needs integer group ids "
                          f"(stepcredit.batch.Trajectory.group_id is an int)") from None


def iter_trajectories(source, *, batch_rows: int = BATCH_ROWS) -> Iterator:
    """Yields `stepcredit.batch.Trajectory`s from step rows, one at a time (see `load_trajectories`)."""
    from stepcredit.batch import StepRecord, Trajectory

    for batch in iter_batches(source, batch_rows=batch_rows):
        columns = batch.table.to_pydict()
        bounds = batch.trajectory_starts
        for b in range(len(bounds) - 1):
            rows = sorted(range(bounds[b], bounds[b + 1]), key=columns["step_index"].__getitem__)
            steps = []
            for r in rows:
                entropies = columns["response_entropies"][r]
                metadata = columns["metadata"][r]
                observation = columns["observation_ids"][r]
                steps.append(StepRecord(
                    observation_ids=columns["prompt_ids"][r] if observation is None else observation,
                    prompt_ids=None if observation is None else columns["prompt_ids"][r],
                    action_ids=columns["response_ids"][r],
                    action_logp=columns["response_logprobs"][r], reward=columns["reward"][r],
                    done=columns["done"][r], truncated=columns["truncated"][r],
                    action_entropy=entropies, value=columns["value"][r],
                    anchor=_parse_int(columns["anchor"][r], "anchor", "anchor", batch.start + r),
                    info=json.loads(metadata) if metadata else {}))
            last = rows[-1]
            bootstrap = columns["bootstrap_value"][last]
            yield Trajectory(
                steps=steps, score=columns["score"][last],
                group_id=_parse_int(columns["group_id"][last], "group", "group_id", batch.start + last),
                bootstrap_value=0.0 if bootstrap is None else bootstrap)


def load_trajectories(source, *, batch_rows: int = BATCH_ROWS) -> list:
    """Reads step rows back into `stepcredit.batch.Trajectory`s (the inverse of `save_trajectories`).

    Steps are ordered by `step_index`. Group ids must be decimal integers.
    Anchors that are decimal integers come back as those ints; other anchor
    strings (raw observations) come back as `stepcredit.anchors.observation_key`
    of the string. Log-probs and entropies come back as the float32 values stored.
    `response_values` (token-level critic values) have no place in a
    `StepRecord` and are not read.
    """
    return list(iter_trajectories(source, batch_rows=batch_rows))
