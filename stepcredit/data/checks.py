"""Checking step rows: each record's fields and types, and each trajectory's structure.

`canonical_records` (JSONL dicts) and `canonical_table` (Arrow tables) bring a
batch of rows to the schema's types (`stepcredit.data.schema.ARROW_SCHEMA`);
`check_values` checks what needs no other row; `check_trajectories` checks
each whole trajectory of a batch, and `check_reappearance` with a `SeenIds`
that no trajectory (or group) comes back after its rows ended.

The numbers credit reads (`FLOAT32_FIELDS`: rewards, values, scores,
entropies) must be finite in float32, the precision of the estimators'
outputs: a magnitude above `FLOAT32_MAX` (about 3.4e38), NaN or an infinity is
rejected where the rows enter, before any cast.

Every bad record raises `RecordError`, naming the row (0-based, counting
records from the start of the source) and the field.
"""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from stepcredit.data import schema
from stepcredit.keys import stable_keys


FLOAT32_MAX = float(np.finfo(np.float32).max)
"""The largest finite float32, about 3.4028235e+38."""

FLOAT32_FIELDS = ("reward", "value", "score", "bootstrap_value", "entropy", "response_entropies",
                  "response_values")
"""The number fields that must be finite in float32 (list fields: every element)."""

_NOT_FINITE = "is not finite in float32"


class RecordError(ValueError):
    """A bad record: `row` (0-based record index) and `field` say where."""

    def __init__(self, row: int, field: str, message: str):
        super().__init__(f"row {row}, field {field!r}: {message}")
        self.row = row
        self.field = field


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


def canonical_records(records: list[dict], start: int) -> pa.Table:
    """JSONL records as a table of the schema (`schema.ARROW_SCHEMA`), in record order.

    Integer ids and anchors become their decimal strings; fields outside the
    schema are dropped; missing optional fields are null.

    Args:
      records: the batch's records, as read.
      start: the source row of `records[0]`, for error messages.

    Raises:
      RecordError: the first record with a missing required field, a value
        of the wrong type or a number not finite in float32 (`check_float32`),
        naming its row and field.
    """
    rows = []
    for offset, record in enumerate(records):
        missing = [name for name in schema.REQUIRED if name not in record]
        if missing:
            raise RecordError(start + offset, missing[0], "missing field")
        row = {name: record.get(name) for name in schema.FIELDS}
        for name in schema.ID_FIELDS:
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
            if name in FLOAT32_FIELDS:
                check_float32(inferred, name, start)
            columns.append(inferred.cast(target))
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, OverflowError) as error:
            _raise_first_bad(records, name, start, error)
    return pa.Table.from_arrays(columns, schema=schema.ARROW_SCHEMA)


def _first_uncastable(column, target) -> int:
    """The first row of `column` whose value does not fit `target` (0 if each does alone;
    read as Python values, since a sliced list array still casts all its parent's items)."""
    for row in range(len(column)):
        try:
            pa.array(column.slice(row, 1).to_pylist(), target)
        except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError):
            return row
    return 0


def _raise_first_bad(records: list[dict], name: str, start: int, error: Exception):
    kind = schema.KIND[name]
    for offset, record in enumerate(records):
        value = record.get(name)
        if value is not None and not _value_ok(kind, value):
            raise RecordError(start + offset, name, f"has {type(value).__name__} "
                              f"{short_value(value)}; it must be {_EXPECTED[kind]}") from None
        if kind in ("float", "float_list") and value is not None:
            for number in value if isinstance(value, list) else [value]:
                if isinstance(number, int) and abs(number) > FLOAT32_MAX:  # too big even for int64
                    raise RecordError(start + offset, name, f"{number:.7g} {_NOT_FINITE}") from None
        if kind in ("int", "int_list") and value is not None:
            for number in value if isinstance(value, list) else [value]:
                if not -2**31 <= number < 2**31:
                    raise RecordError(start + offset, name,
                                      f"holds {number}, outside int32") from None
    raise RecordError(start, name, f"rows {start}..{start + len(records) - 1} do not fit "
                      f"{schema.ARROW_SCHEMA.field(name).type}: {error}") from None


def short_value(value) -> str:
    """`repr(value)`, cut to 60 characters for an error message."""
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


def check_float32(array: pa.Array | pa.ChunkedArray, name: str, start: int) -> None:
    """Checks that every number of a column (every element, for a list column) is finite in float32.

    Finite in float32: not NaN, not infinite, and of magnitude at most
    `FLOAT32_MAX`. Nulls, and columns that hold no floating-point numbers
    (integers always fit), pass.

    Args:
      array: the column's values as read, before any cast (a cast to float32
        would turn 1e39 into inf).
      name: the field, for the message.
      start: the source row of the column's first value.

    Raises:
      RecordError: the first row holding such a number, e.g.
        "row 12, field 'reward': 1e+39 is not finite in float32".
    """
    if isinstance(array, pa.ChunkedArray):
        array = array.combine_chunks()
    rows = None
    if pa.types.is_list(array.type) or pa.types.is_large_list(array.type):
        rows = pc.list_parent_indices(array).to_numpy(zero_copy_only=False)
        array = pc.list_flatten(array)
    if not pa.types.is_floating(array.type) or len(array) == 0:
        return
    values = array.to_numpy(zero_copy_only=False).astype(np.float64)
    valid = array.is_valid().to_numpy(zero_copy_only=False)
    bad = valid & ~(np.abs(np.where(valid, values, 0.0)) <= FLOAT32_MAX)  # NaN compares false
    if bad.any():
        k = _first(bad)
        value = float(values[k])
        hint = f" (the float32 maximum is {FLOAT32_MAX:.8g})" if np.isfinite(value) else ""
        raise RecordError(start + int(k if rows is None else rows[k]), name,
                          f"{value!r} {_NOT_FINITE}{hint}")


def canonical_table(table: pa.Table, start: int) -> pa.Table:
    """An Arrow batch cast to the schema (`schema.ARROW_SCHEMA`), in row order.

    Columns outside the schema are dropped; missing optional columns are null.

    Args:
      table: the batch's rows, as read.
      start: the source row of the table's first row, for error messages.

    Raises:
      RecordError: a missing required column (at row `start`), a column of a
        type that does not fit the field (naming the first row holding a
        value), or a number not finite in float32 (`check_float32`).
    """
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
        if name in FLOAT32_FIELDS:
            check_float32(column, name, start)
        try:
            columns.append(column.cast(target))
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as error:
            row = _first_uncastable(column, target)
            raise RecordError(start + row, name, f"cannot be read as {target}: {error}") from None
    return pa.Table.from_arrays(columns, schema=schema.ARROW_SCHEMA)


def check_values(table: pa.Table, start: int) -> None:
    """Checks each row of a canonical table on its own (no other row needed).

    Required fields are not null, `step_index >= 0`, `response_ids` is not
    empty and the per-token lists have its length, `done` and `truncated`
    are not both true, and `metadata` holds a JSON object. (Numbers were
    checked finite in float32 by `canonical_records` and `canonical_table`,
    before their cast.)

    Args:
      table: a batch in the schema's types (`canonical_records`, `canonical_table`).
      start: the source row of the table's first row.

    Raises:
      RecordError: the first bad row, naming it and the field.
    """
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
    both = (table.column("done").to_numpy(zero_copy_only=False)
            & table.column("truncated").to_numpy(zero_copy_only=False))
    if both.any():
        raise RecordError(start + _first(both), "truncated",
                          "done and truncated are both true; a step ends an episode one way")
    for row, text in enumerate(table.column("metadata").to_pylist()):
        if text is not None and not _json_object(text):
            raise RecordError(start + row, "metadata", f"is {short_value(text)}; it must be a JSON "
                              "object encoded as a string")


def _json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


# ---------------------------------------------------------------- structure


class SeenIds:
    """A set of ids, held as their 64-bit keys (`stepcredit.keys.stable_keys`): 8 bytes per id.

    The keys sit in sorted runs, each at most half the size of the one before
    it (merged when not), so a lookup searches O(log n) runs and adding n keys
    costs O(n log n) in all. Two ids that share a key (odds about n**2 / 2**65)
    count as one.
    """

    def __init__(self):
        self._runs: list[np.ndarray] = []

    def __len__(self) -> int:
        """The number of distinct keys added."""
        return sum(len(run) for run in self._runs)

    def seen(self, keys: np.ndarray) -> np.ndarray:
        """`[N]` bool: which of the `[N]` uint64 `keys` were added before."""
        found = np.zeros(len(keys), bool)
        for run in self._runs:
            position = np.minimum(np.searchsorted(run, keys), len(run) - 1)
            found |= run[position] == keys
        return found

    def add(self, keys: np.ndarray) -> None:
        """Adds `[N]` uint64 `keys` not added before (repeats among them are fine)."""
        if not len(keys):
            return
        self._runs.append(np.unique(keys))
        while len(self._runs) > 1 and 2 * len(self._runs[-1]) > len(self._runs[-2]):
            last = self._runs.pop()
            self._runs[-1] = np.union1d(self._runs[-1], last)


def block_starts(ids: np.ndarray) -> np.ndarray:
    """`[K + 1]` int64 offsets of the K runs of equal consecutive values of `ids` `[N]`, ending with N.

    Example: ids ["a", "a", "b", "a"] give [0, 2, 3, 4].
    """
    change = np.flatnonzero(ids[1:] != ids[:-1]) + 1
    return np.concatenate([[0], change, [len(ids)]]).astype(np.int64)


def check_reappearance(kind: str, ids: np.ndarray, starts: np.ndarray, seen: SeenIds,
                       start: int) -> None:
    """Checks that the rows of each trajectory (or group) are contiguous, and records its id.

    Args:
      kind: "trajectory" or "group"; the field checked is `{kind}_id`.
      ids: `[N]` the batch's `{kind}_id` column.
      starts: `[K + 1]` offsets of the batch's K blocks of equal ids (`block_starts`).
      seen: the ids of the blocks of earlier batches; this batch's are added.
      start: the source row of the batch's first row.

    Raises:
      RecordError: an id whose block follows another block of the same id, in
        this batch or an earlier one, naming the block's first row.
    """
    first_rows = starts[:-1]
    block_ids = ids[first_rows]
    keys = stable_keys(block_ids)
    again = seen.seen(keys)
    _, first_index = np.unique(keys, return_index=True)
    repeated = np.ones(len(keys), bool)
    repeated[first_index] = False
    bad = again | repeated
    if bad.any():
        block = _first(bad)
        field = f"{kind}_id"
        raise RecordError(start + int(first_rows[block]), field,
                          f"{kind} {block_ids[block]!r} appears again after other {kind}s' rows; "
                          f"the rows of one {kind} must be contiguous (sort the rows by group_id, "
                          f"trajectory_id, step_index first)")
    seen.add(keys)


def _first_change_within(values: np.ndarray, block: np.ndarray) -> int | None:
    """The first row whose value differs from the previous row of the same block, or None."""
    changes = np.flatnonzero(values[1:] != values[:-1]) + 1
    changes = changes[block[changes] == block[changes - 1]]
    return int(changes[0]) if len(changes) else None


def check_trajectories(table: pa.Table, starts: np.ndarray, start: int) -> None:
    """Checks each whole trajectory of a canonical table.

    A trajectory stays in one group, its step indices run 0, 1, ..., n - 1
    (each once, in any row order), `done`, `truncated` and `bootstrap_value`
    appear only on its last step, and its rows share one score.

    Args:
      table: a batch in the schema's types whose trajectories are complete.
      starts: `[K + 1]` offsets of its K trajectories (`block_starts` of
        `trajectory_id`).
      start: the source row of the table's first row.

    Raises:
      RecordError: the first bad row, naming it and the field.
    """
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
