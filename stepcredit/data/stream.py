"""Streaming a log of step rows in validated batches of whole trajectories (or groups).

Rows are read `batch_rows` at a time (`stepcredit.data.read`), checked
(`stepcredit.data.checks`) and re-cut at trajectory boundaries (or group
boundaries, with `by="group"`), so memory stays bounded however many steps the
source holds. `validate` and `load` are whole-source passes built on
`iter_batches`.

Ordering requirement: the rows of one trajectory are contiguous (in any step
order); with `by="group"` (group estimators), the rows of one group are
contiguous too. A log that interleaves them is sorted first, e.g.
`dataset.sort(["group_id", "trajectory_id", "step_index"])`.

Every bad record raises `stepcredit.data.checks.RecordError`, naming the row
(0-based, counting records) and the field.
"""

from __future__ import annotations

import os
from typing import Any, Iterable, Iterator, Literal, NamedTuple

import numpy as np
import pyarrow as pa

from stepcredit.data import schema
from stepcredit.data.checks import (SeenIds, block_starts, canonical_records, canonical_table,
                                    check_reappearance, check_trajectories, check_values)
from stepcredit.data.read import BATCH_ROWS, is_jsonl, read_arrow, read_jsonl, source_kind
from stepcredit.keys import stable_keys

By = Literal["trajectory", "group"]


class LogBatch(NamedTuple):
    """A validated batch of a log's rows: whole trajectories (or whole groups), in source order.

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


def iter_batches(source, *, by: By = "trajectory", batch_rows: int = BATCH_ROWS) -> Iterator[LogBatch]:
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
      `LogBatch`, in source order, covering every row once.

    Raises:
      RecordError: a missing field, a wrong type, a number not finite in
        float32, a null required field, a step index gap or duplicate, a
        trajectory split across groups, or a trajectory (or group) whose rows
        are not contiguous; naming the row and the field. A JSONL line that
        is not UTF-8 or not JSON is named by its line number too.
    """
    if by not in ("trajectory", "group"):
        raise ValueError(f"iter_batches: by={by!r}; it must be 'trajectory' or 'group'")
    whole = isinstance(batch_rows, (int, np.integer)) and not isinstance(batch_rows, bool)
    if not whole or batch_rows < 1:
        raise ValueError(f"iter_batches: batch_rows={batch_rows!r}; it must be a positive int")
    jsonl = is_jsonl(source)
    raw_batches: Iterable = (read_jsonl(os.fspath(source), batch_rows) if jsonl
                             else read_arrow(source, batch_rows))
    seen = {"trajectory": SeenIds(), "group": SeenIds()}
    pending_table = pending_raw = None
    start = read = 0
    for raw in _chain_end(raw_batches):
        final = raw is None
        if not final:
            table = canonical_records(raw, read) if jsonl else canonical_table(raw, read)
            check_values(table, read)
            read += len(table)
            if pending_table is not None:
                table = pa.concat_tables([pending_table, table])
                raw = pending_raw + raw if jsonl else pa.concat_tables([pending_raw, raw])
        elif pending_table is None:
            return
        else:
            table, raw = pending_table, pending_raw
        unit = table.column(f"{by}_id").to_numpy(zero_copy_only=False)
        unit_starts = block_starts(unit)
        cut = len(table) if final else int(unit_starts[-2])
        if cut == 0:
            pending_table, pending_raw = table, raw
            continue
        done_table = table.slice(0, cut)
        trajectories = done_table.column("trajectory_id").to_numpy(zero_copy_only=False)
        starts = block_starts(trajectories)
        check_reappearance("trajectory", trajectories, starts, seen["trajectory"], start)
        if by == "group":
            check_reappearance("group", unit[:cut], unit_starts[unit_starts <= cut], seen["group"],
                               start)
        check_trajectories(done_table, starts, start)
        yield LogBatch(start, done_table, raw[:cut] if jsonl else raw.slice(0, cut), starts)
        start += cut
        pending_table = table.slice(cut) if cut < len(table) else None
        pending_raw = (raw[cut:] if jsonl else raw.slice(cut)) if cut < len(table) else None
        if final:
            return


def _chain_end(batches: Iterable) -> Iterator:
    yield from batches
    yield None


def validate(source, *, by: By = "trajectory", batch_rows: int = BATCH_ROWS) -> Summary:
    """Validates every row of `source` (see `iter_batches`) and counts what it holds.

    Returns:
      `Summary(rows, trajectories, groups)`; groups are counted by distinct
      `group_id`, wherever their rows sit.
    """
    rows = trajectories = 0
    groups = SeenIds()
    for batch in iter_batches(source, by=by, batch_rows=batch_rows):
        rows += len(batch.table)
        trajectories += len(batch.trajectory_starts) - 1
        group_ids = batch.table.column("group_id").unique().to_numpy(zero_copy_only=False)
        keys = np.unique(stable_keys(group_ids))
        groups.add(keys[~groups.seen(keys)])
    return Summary(rows, trajectories, len(groups))


def load(source, *, batch_rows: int = BATCH_ROWS):
    """Validates `source` and returns it as a `datasets.Dataset` with the schema's features.

    Columns outside the schema are kept; schema columns are cast to their
    types (integer ids and anchors become their decimal strings, also in a
    JSONL column that mixes them with string ids).
    """
    import datasets

    validate(source, batch_rows=batch_rows)
    if isinstance(source, datasets.Dataset):
        dataset = source
    elif source_kind(os.fspath(source)) == "folder":
        dataset = datasets.load_from_disk(os.fspath(source))
    else:
        builder = "json" if is_jsonl(source) else "parquet"
        dataset = datasets.load_dataset(builder, data_files=os.fspath(source), split="train")
    # `datasets` reads a JSONL column that mixes integers and strings as JSON text (the
    # `Json` feature of datasets >= 5), which a cast to strings would leave quoted ('"a"'):
    # such id columns are decoded and given the ids' strings, as `iter_batches` reads the
    # file. (A dataset or Parquet file that stores JSON text is read as that text by both.)
    jsonl = is_jsonl(source)
    mixed = [name for name in schema.ID_FIELDS
             if jsonl and isinstance(dataset.features.get(name), getattr(datasets, "Json", ()))]
    if mixed:
        dataset = dataset.map(
            lambda batch: {name: [None if v is None else str(v) for v in batch[name]]
                           for name in mixed},
            batched=True, batch_size=batch_rows,
            features=datasets.Features({**dataset.features,
                                        **{name: schema.FEATURES[name] for name in mixed}}))
    features = dataset.features.copy()
    for name in dataset.column_names:
        if name in schema.FEATURES:
            features[name] = schema.FEATURES[name]
    return dataset.cast(features)
