"""Offline credit: any registered estimator over a log of step rows, written beside it.

`compute_credit` reads the log in batches of whole trajectories (whole groups
for estimators that need groups), builds the inputs the registry entry asks
for, runs the estimator (jitted, shapes padded to powers of two so that a few
compilations serve the whole log), and writes the input rows, untouched, with
new columns (a JSONL log written as Parquet takes the schema's types for its
schema fields, every column of the log in each row, null where a row lacks one):

  advantage          float32    per row, for step- and trajectory-level estimators
  return             float32    per row, where the estimator defines returns
  token_advantages   [float32]  per response token, for token-level estimators
  token_returns      [float32]  per response token, where defined

Each estimator reads what its registry entry names (`Estimator.fields`), built
from the rows as these `CreditInputs` fields:

  mask, step_rewards   a trajectory's rows in `step_index` order, `reward`
  step_values          `value` (required for every row)
  bootstrap_value      `bootstrap_value` of a truncated last step (0 after a
                       terminated one)
  entropy              `entropy`, or the mean of `response_entropies`
  anchors              `anchor` mapped to dense ids per batch (equal strings,
                       equal ids; a null anchor is its own state)
  scores               `score`, or the sum of the trajectory's rewards where null
  group_ids            `group_id` mapped to dense ids
  step_index           a trajectory's response tokens in step order, each
                       labelled with its row's step (token-level estimators;
                       a step's reward sits on its last response token)
  token_values         `response_values`

Estimators reading an implicit PRM's log-probs are not available offline.

The estimators run in float32, as in the trainer (the inputs are finite in
float32, checked as the rows enter; group statistics scale each group by a
power of two, so rewards of 1e20 give the credit of rescaled ones). An output
that is not finite in float32 (returns summing rewards near 3.4e38, say) is a
`RecordError` naming its first row, raised before anything is written.

Whitening is never inside an estimator; it follows the entry's `whiten`
default, or `whiten=`: "steps" over all rows, "tokens" over all response tokens (a row's
scalar advantage counts once per token), (x - mean) / sqrt(var + 1e-8) with
the unbiased variance, as `masked_whiten`. Its statistics run over the whole
input (two passes), so they do not depend on `batch_rows`. Estimators whose
statistics span their batch (EMPG's entropy range and centring) see one batch
of `batch_rows` rows (whole groups) at a time; all others give the same
result for any batch size.
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any, Mapping, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from stepcredit.advantages.inputs import CreditInputs, raw_fields
from stepcredit.data import schema
from stepcredit.data.checks import FLOAT32_MAX, RecordError, canonical_records, short_value
from stepcredit.data.read import BATCH_ROWS, is_jsonl, read_arrow, read_jsonl, source_rows
from stepcredit.data.stream import LogBatch, iter_batches
from stepcredit.data.write import RowWriter, atomic_path, output_format
from stepcredit.keys import dense_ids

ADVANTAGE, RETURN = "advantage", "return"
TOKEN_ADVANTAGES, TOKEN_RETURNS = "token_advantages", "token_returns"
WHITEN_EPS = 1e-8
_FLOAT = np.float32  # the estimators' inputs and arithmetic, as in the trainer

# The CreditInputs fields that step rows hold.
_OFFLINE_FIELDS = frozenset({"mask", "step_rewards", "step_values", "bootstrap_value", "entropy",
                             "anchors", "group_ids", "scores", "step_index", "token_values"})
_TOKEN_FIELDS = frozenset({"step_index", "token_values"})


class CreditSummary(NamedTuple):
    """What `compute_credit` did."""

    rows: int
    trajectories: int
    estimator: str
    whiten: str
    columns: tuple[str, ...]
    output: str


class _Plan(NamedTuple):
    entry: Any
    config: dict
    whiten: str
    token_output: bool


def _plan(name: str, overrides: Mapping[str, Any], whiten: str | None) -> _Plan:
    from stepcredit.advantages import registry

    entry = registry.get(name)
    # Fields of optional arguments may be absent (the estimator then does without them).
    optional = {raw for argument in entry.optional for raw in raw_fields(entry.reads[argument])}
    unavailable = sorted(entry.fields - _OFFLINE_FIELDS - optional)
    if unavailable:
        raise ValueError(f"estimator {name!r} reads {', '.join(unavailable)}, which step rows do "
                         "not hold" + ("; an implicit PRM's log-probs exist only in the trainer"
                                       if entry.needs_prm else ""))
    config = entry.resolve(overrides)
    whiten = entry.whiten if whiten in (None, "default") else whiten
    if whiten not in ("none", "steps", "tokens"):
        raise ValueError(f"whiten={whiten!r}; it must be 'none', 'steps', 'tokens' or 'default'")
    token_output = entry.output_level == "token"
    if token_output and whiten == "steps":
        raise ValueError(f"estimator {name!r} gives token advantages; whiten them over 'tokens'")
    return _Plan(entry, config, whiten, token_output)


def _bucket(n: int) -> int:
    return max(8, 1 << (max(n, 1) - 1).bit_length())


def _dense(strings: np.ndarray) -> tuple[np.ndarray, int]:
    return dense_ids(strings.astype(str), order="sorted")


class _Views(NamedTuple):
    row_traj: np.ndarray
    row_step: np.ndarray
    lengths: np.ndarray      # response tokens per row
    token_start: np.ndarray  # offset of each row's first token in its trajectory's token view


def _views(batch: LogBatch) -> _Views:
    table = batch.table
    starts = batch.trajectory_starts
    row_traj = np.repeat(np.arange(len(starts) - 1), np.diff(starts))
    row_step = table.column("step_index").to_numpy().astype(np.int64)
    lengths = pc.list_value_length(table.column("response_ids")).to_numpy().astype(np.int64)
    order = np.lexsort((row_step, row_traj))
    before = np.cumsum(lengths[order]) - lengths[order]
    first = before[starts[:-1]]  # rows are grouped by trajectory, so order keeps blocks in place
    token_start = np.empty_like(lengths)
    token_start[order] = before - first[row_traj[order]]
    return _Views(row_traj, row_step, lengths, token_start)


def _column(table: pa.Table, name: str) -> tuple[np.ndarray, np.ndarray]:
    column = table.column(name)
    valid = column.is_valid().to_numpy(zero_copy_only=False)
    values = column.to_numpy(zero_copy_only=False)
    return values, valid


def _require(valid: np.ndarray, start: int, field: str, why: str) -> None:
    if not valid.all():
        raise RecordError(start + int(np.flatnonzero(~valid)[0]), field, f"is null; {why}")


def _inputs(plan: _Plan, batch: LogBatch, views: _Views) -> tuple[CreditInputs, int]:
    """The fields the estimator reads, padded to [B', T'] / [B', N'] / [B']."""
    table, start = batch.table, batch.start
    num = len(batch.trajectory_starts) - 1
    b_pad = _bucket(num)
    t_pad = _bucket(int(views.row_step.max()) + 1)
    totals = np.bincount(views.row_traj, weights=views.lengths, minlength=num).astype(np.int64)
    fields = plan.entry.fields & _OFFLINE_FIELDS  # an optional field logs cannot hold stays None
    n_pad = _bucket(int(totals.max())) if fields & _TOKEN_FIELDS or plan.token_output else 0
    name = plan.entry.name
    rows = (views.row_traj, views.row_step)
    reward = table.column("reward").to_numpy().astype(_FLOAT)
    last = views.row_step == (np.diff(batch.trajectory_starts) - 1)[views.row_traj]
    truncated = table.column("truncated").to_numpy(zero_copy_only=False)
    out: dict[str, np.ndarray] = {}
    for field in fields:
        if field == "scores":
            score, has = _column(table, "score")
            sums = np.bincount(views.row_traj, weights=reward.astype(np.float64), minlength=num)
            given = np.zeros(num, bool)
            given[views.row_traj] = has
            value = np.zeros(num, np.float64)
            value[views.row_traj[has]] = score[has]
            out[field] = _pad1(np.where(given, value, sums), b_pad)
        elif field == "group_ids":
            ids, count = _dense(table.column("group_id").to_numpy(zero_copy_only=False)[
                batch.trajectory_starts[:-1]])
            out[field] = np.concatenate([ids, count + np.arange(b_pad - num)]).astype(np.int32)
        elif field == "bootstrap_value":
            value, has = _column(table, "bootstrap_value")
            needs = last & truncated
            if plan.entry.needs_critic:
                _require(has | ~needs, start, "bootstrap_value",
                         f"{name} bootstraps a truncated trajectory from V(s_next)")
            boot = np.zeros(b_pad, _FLOAT)
            boot[views.row_traj[needs & has]] = value[needs & has]
            out[field] = boot
        elif field in _TOKEN_FIELDS:
            out[field] = _token_input(field, table, views, b_pad, n_pad, start, name)
        else:
            out[field] = _step_input(field, table, rows, reward, b_pad, t_pad, start, name)
    return CreditInputs(**out), b_pad


def _pad1(x: np.ndarray, size: int) -> np.ndarray:
    out = np.zeros(size, _FLOAT)
    out[:len(x)] = x
    return out


def _step_input(field, table, rows, reward, b_pad, t_pad, start, name) -> np.ndarray:
    if field == "mask":
        out = np.zeros((b_pad, t_pad), bool)
        out[rows] = True
        return out
    if field == "anchors":
        anchors, has = _column(table, "anchor")
        ids, count = _dense(anchors[has])
        dense = np.empty(len(anchors), np.int32)
        dense[has] = ids
        dense[~has] = count + np.arange(int((~has).sum()))
        out = np.full((b_pad, t_pad), -1, np.int32)
        out[rows] = dense
        return out
    if field == "step_rewards":
        values = reward
    elif field == "step_values":
        values, has = _column(table, "value")
        _require(has, start, "value", f"{name} needs the critic value of every step")
    elif field == "entropy":
        values, has = _column(table, "entropy")
        values = values.astype(np.float64)
        if not has.all():
            tokens = table.column("response_entropies")
            values = np.where(has, np.nan_to_num(values), _token_means(tokens))
            has = has | tokens.is_valid().to_numpy(zero_copy_only=False)
        _require(has, start, "entropy", f"{name} needs each step's entropy (entropy or "
                 f"response_entropies)")
    out = np.zeros((b_pad, t_pad), _FLOAT)
    out[rows] = values
    return out


def _token_means(lists: pa.ChunkedArray) -> np.ndarray:
    """Mean of each list (NaN for a null or empty list)."""
    lengths = pc.list_value_length(lists).to_numpy(zero_copy_only=False).astype(np.float64)
    counts = np.where(np.isnan(lengths), 0, lengths).astype(np.int64)
    flat = pc.list_flatten(lists).to_numpy(zero_copy_only=False).astype(np.float64)
    sums = np.bincount(np.repeat(np.arange(len(counts)), counts), weights=flat, minlength=len(counts))
    return np.where(counts > 0, sums / np.maximum(counts, 1), np.nan)


def _token_positions(views: _Views) -> tuple[np.ndarray, np.ndarray]:
    """(trajectory, token position) of every response token, in row order."""
    traj = np.repeat(views.row_traj, views.lengths)
    first = np.repeat(views.token_start, views.lengths)
    within = np.arange(int(views.lengths.sum())) - np.repeat(np.cumsum(views.lengths) - views.lengths,
                                                             views.lengths)
    return traj, first + within


def _token_input(field, table, views, b_pad, n_pad, start, name) -> np.ndarray:
    if field == "step_index":
        out = np.full((b_pad, n_pad), -1, np.int32)
        out[_token_positions(views)] = np.repeat(views.row_step, views.lengths)
        return out
    column = table.column("response_values")
    _require(column.is_valid().to_numpy(zero_copy_only=False), start, "response_values",
             f"{name} needs the critic value before every response token")
    out = np.zeros((b_pad, n_pad), _FLOAT)
    out[_token_positions(views)] = pc.list_flatten(column).to_numpy(zero_copy_only=False)
    return out


class _Moments:
    """Weighted count, mean and sum of squared deviations, merged batch by batch (Chan et al.)."""

    def __init__(self):
        self.count, self.mean, self.m2 = 0.0, 0.0, 0.0

    def add(self, x: np.ndarray, weight: np.ndarray) -> None:
        n = float(weight.sum())
        if n == 0:
            return
        x = x.astype(np.float64)
        mean = float((x * weight).sum() / n)
        m2 = float((weight * (x - mean) ** 2).sum())
        total = self.count + n
        delta = mean - self.mean
        self.m2 += m2 + delta * delta * self.count * n / total
        self.mean += delta * n / total
        self.count = total

    def whiten(self, x: np.ndarray) -> np.ndarray:
        var = self.m2 / (self.count - 1.0) if self.count >= 2 else 0.0
        return ((x.astype(np.float64) - self.mean) / np.sqrt(var + WHITEN_EPS)).astype(np.float32)


def _compiled(plan: _Plan):
    """The estimator through its registry binding, compiled once per padded shape."""
    import jax

    from stepcredit.advantages import registry

    def run(inputs: CreditInputs, num_groups):
        config = plan.config if num_groups is None else {**plan.config, "num_groups": num_groups}
        out = registry.apply(plan.entry, inputs, config)
        return out.advantages, out.returns

    return jax.jit(run, static_argnames=("num_groups",))


def _num_groups(plan: _Plan, b_pad: int) -> int | None:
    """The static group count: the padded batch size where the entry counts groups per batch."""
    return b_pad if "num_groups" in plan.config and plan.config["num_groups"] is None else None


def _run_batch(plan: _Plan, jitted, batch: LogBatch) -> tuple[np.ndarray, np.ndarray | None, _Views]:
    """Per-row (or per-token, in row order) float32 advantages and returns of one batch.

    Raises:
      RecordError: an advantage or return not finite in float32, naming its row.
    """
    views = _views(batch)
    inputs, b_pad = _inputs(plan, batch, views)
    advantages, returns = jitted(inputs, _num_groups(plan, b_pad))
    if plan.token_output:
        where = _token_positions(views)
    elif plan.entry.output_level == "trajectory":
        where = (views.row_traj,)
    else:
        where = (views.row_traj, views.row_step)
    names = (TOKEN_ADVANTAGES, TOKEN_RETURNS) if plan.token_output else (ADVANTAGE, RETURN)
    out = []
    for name, x in zip(names, (advantages, returns)):
        if x is not None:
            x = np.asarray(x)[where]
            _check_finite(plan.entry.name, name, x, batch.start,
                          views.lengths if plan.token_output else None)
            x = x.astype(np.float32)
        out.append(x)
    return out[0], out[1], views


def _check_finite(estimator: str, name: str, x: np.ndarray, start: int, lengths) -> None:
    """Raises `RecordError` at the first row whose output `x` (per row, or per token with the
    rows' token `lengths`) is not finite in float32."""
    bad = ~(np.abs(x) <= FLOAT32_MAX)  # NaN compares false
    if not bad.any():
        return
    k = int(np.flatnonzero(bad)[0])
    row = k if lengths is None else int(np.searchsorted(np.cumsum(lengths), k, side="right"))
    raise RecordError(start + row, name, f"{estimator} gives {float(x[k])!r}, which is not finite in "
                      f"float32; the log's rewards, values or scores are too large for float32 "
                      f"credit: rescale them (e.g. divide by 1e6) and run again")


def compute_credit(source, output: str, estimator: str, *, overrides: Mapping[str, Any] | None = None,
                   whiten: str | None = None, batch_rows: int = BATCH_ROWS,
                   allow_empty: bool = False, progress: bool = True) -> CreditSummary:
    """Computes `estimator`'s advantages over a log of step rows and writes them beside its rows.

    Args:
      source: the input: a JSONL or Parquet path, a save_to_disk folder or a
        `datasets.Dataset`; never modified.
      output: a `.jsonl`/`.json` or `.parquet` path (the format follows the
        extension); written to a temporary file in the same folder, fsynced,
        then renamed over `output`, so a failure leaves a previous `output`
        intact.
      estimator: a registry name (`stepcredit.advantages.names()`); estimators
        that need an implicit PRM are not available offline.
      overrides: hyperparameters replacing the registry defaults.
      whiten: None or "default" (the entry's default), "none", "steps" or "tokens".
      batch_rows: rows per batch (whole trajectories, whole groups for group
        estimators); see the module docstring for what depends on it.
      allow_empty: write an empty output (for Parquet: no rows, the input's
        columns and the new ones) for an input without rows, instead of
        raising.
      progress: show progress bars (they appear after a second).

    Returns:
      `CreditSummary(rows, trajectories, estimator, whiten, columns, output)`.

    Raises:
      RecordError: a bad record (naming its row and field), including a
        missing `value` for critic estimators, a missing entropy for EMPG and
        a number not finite in float32; or an advantage or return not finite
        in float32 (naming its row and the column). Nothing is written then.
      ValueError: an unknown estimator or hyperparameter, an output path equal
        to the input or in a folder that does not exist, a column name already
        in a row of the input (naming the row), an input without rows (unless
        `allow_empty`).
    """
    import datasets
    from tqdm.auto import tqdm

    plan = _plan(estimator, dict(overrides or {}), whiten)
    fmt = output_format(output)
    folder = os.path.dirname(os.path.abspath(os.fspath(output)))
    if not os.path.isdir(folder):
        raise ValueError(f"--output {output}: the folder {folder} does not exist")
    if not isinstance(source, datasets.Dataset) and os.path.exists(output) and \
            os.path.samefile(os.fspath(source), output):
        raise ValueError(f"--output {output} is the input; the input is never modified")
    by = "group" if plan.entry.needs_groups else "trajectory"
    total = source_rows(source)
    jitted = _compiled(plan)
    moments = _Moments()
    first_row: dict[str, int] = {}  # each input column and the first row that holds it
    extra_types: dict[str, pa.DataType] = {}  # JSONL columns outside the schema, typed
    rows = trajectories = 0
    with tempfile.TemporaryFile() as advantage_file, tempfile.TemporaryFile() as return_file:
        has_returns = False
        bar = tqdm(total=total, unit="rows", desc=f"credit {estimator}", delay=1.0, disable=not progress)
        for batch in iter_batches(source, by=by, batch_rows=batch_rows):
            _note_columns(first_row, extra_types, batch)
            advantages, returns, views = _run_batch(plan, jitted, batch)
            if plan.whiten != "none":
                weight = np.ones(len(advantages)) if plan.token_output or plan.whiten == "steps" \
                    else views.lengths.astype(np.float64)
                moments.add(advantages, weight)
            advantages.tofile(advantage_file)
            if returns is not None:
                has_returns = True
                returns.tofile(return_file)
            rows += len(batch.table)
            trajectories += len(batch.trajectory_starts) - 1
            bar.update(len(batch.table))
        bar.close()
        if rows == 0:
            if not allow_empty:
                raise ValueError(f"{_name(source)} has no rows, so there is nothing to credit; "
                                 f"--allow-empty (allow_empty=True) writes an empty output")
            has_returns = _has_returns(plan, jitted)
        advantage_file.seek(0)
        return_file.seek(0)
        names = (TOKEN_ADVANTAGES, TOKEN_RETURNS) if plan.token_output else (ADVANTAGE, RETURN)
        columns = names if has_returns else names[:1]
        clash = [name for name in columns if name in first_row]
        if clash:
            raise ValueError(f"row {first_row[clash[0]]} of the input already has a column "
                             f"{clash[0]!r}; offline credit adds it")
        with atomic_path(output) as temporary:
            writer = RowWriter(temporary, fmt)
            try:
                if rows == 0 and fmt == "parquet":
                    writer.write_table(_empty_table(source, columns, plan.token_output))
                bar = tqdm(total=rows, unit="rows", desc="write", delay=1.0, disable=not progress)
                written = 0
                for raw, lengths in _raw_batches(source, batch_rows):
                    count = int(lengths.sum()) if plan.token_output else len(lengths)
                    new = {columns[0]: np.fromfile(advantage_file, np.float32, count)}
                    if plan.whiten != "none":
                        new[columns[0]] = moments.whiten(new[columns[0]])
                    if has_returns:
                        new[columns[1]] = np.fromfile(return_file, np.float32, count)
                    _write(writer, fmt, raw, new, lengths if plan.token_output else None,
                           tuple(first_row), extra_types, written)
                    written += len(lengths)
                    bar.update(len(lengths))
                bar.close()
            finally:
                writer.close()
    return CreditSummary(rows, trajectories, estimator, plan.whiten, columns, os.fspath(output))


def _name(source) -> str:
    return f"--input {os.fspath(source)}" if isinstance(source, (str, os.PathLike)) else "the dataset"


def _has_returns(plan: _Plan, jitted) -> bool:
    """Whether the estimator gives returns, from its output shapes on a one-row log (not run)."""
    row = {"trajectory_id": "0", "group_id": "0", "step_index": 0, "prompt_ids": [0],
           "response_ids": [0], "response_logprobs": [0.0], "reward": 0.0, "done": True,
           "truncated": False, "entropy": 0.0, "value": 0.0, "anchor": "0",
           "response_values": [0.0], "response_entropies": [0.0]}
    batch = LogBatch(0, canonical_records([row], 0), [row], np.asarray([0, 1]))
    inputs, b_pad = _inputs(plan, batch, _views(batch))
    _, returns = jitted.eval_shape(inputs, _num_groups(plan, b_pad))
    return returns is not None


def _empty_table(source, columns: tuple[str, ...], token_output: bool) -> pa.Table:
    """No rows: the input's columns in their types (the schema's, for JSONL) and the new ones."""
    import datasets
    import pyarrow.parquet as pq

    if isinstance(source, datasets.Dataset):
        fields = source.features.arrow_schema
    elif is_jsonl(source):
        fields = schema.ARROW_SCHEMA
    elif os.path.isdir(os.fspath(source)):
        fields = datasets.load_from_disk(os.fspath(source)).features.arrow_schema
    else:
        fields = pq.read_schema(os.fspath(source))
    clash = [name for name in columns if name in fields.names]
    if clash:
        raise ValueError(f"the input already has a column {clash[0]!r}; offline credit adds it")
    new = pa.list_(pa.float32()) if token_output else pa.float32()
    fields = pa.schema(list(fields) + [pa.field(name, new) for name in columns])
    return fields.empty_table()


def _raw_batches(source, batch_rows: int):
    """The source's rows as read (dicts for JSONL, tables otherwise) with their response lengths."""
    if is_jsonl(source):
        for records in read_jsonl(os.fspath(source), batch_rows):
            yield records, np.asarray([len(r["response_ids"]) for r in records], np.int64)
        return
    for table in read_arrow(source, batch_rows):
        yield table, pc.list_value_length(table.column("response_ids")).to_numpy().astype(np.int64)


_SCHEMA_NAMES = frozenset(schema.ARROW_SCHEMA.names)


def _note_columns(first_row: dict[str, int], extra_types: dict[str, pa.DataType],
                  batch: LogBatch) -> None:
    """Adds the batch's input columns not seen before, with the row each first appears in,
    and for a JSONL column outside the schema the Arrow type of its first value not null."""
    if isinstance(batch.source_rows, list):
        for offset, record in enumerate(batch.source_rows):
            for name in record.keys() - first_row.keys():
                first_row[name] = batch.start + offset
            for name in record.keys() - extra_types.keys() - _SCHEMA_NAMES:
                if record[name] is not None:
                    extra_types[name] = pa.array([record[name]]).type
    else:
        for name in batch.source_rows.column_names:
            first_row.setdefault(name, batch.start)


def _write(writer: RowWriter, fmt: str, raw, new: dict[str, np.ndarray], lengths,
           input_columns: tuple[str, ...], extra_types: Mapping[str, pa.DataType],
           start: int) -> None:
    """Writes a batch of input rows as read, with the new columns beside them. JSONL records
    become a table over every column of the input (null where a record lacks one), each in
    one type, so that all batches of a Parquet output share one schema."""
    if lengths is not None:
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        arrays = {k: pa.ListArray.from_arrays(pa.array(offsets), pa.array(v)) for k, v in new.items()}
    else:
        arrays = {k: pa.array(v) for k, v in new.items()}
    if fmt == "jsonl":
        if isinstance(raw, list):
            lists = {k: a.to_pylist() for k, a in arrays.items()}
            records = [{**record, **{k: lists[k][i] for k in lists}}
                       for i, record in enumerate(raw)]
            try:
                writer.write_records(records)
            except ValueError:  # NaN or infinity, which JSON cannot hold
                _raise_not_json(records, start)
            return
        table = raw
    else:
        table = raw if not isinstance(raw, list) else _records_table(raw, input_columns,
                                                                     extra_types)
    for name, array in arrays.items():
        table = table.append_column(name, array)
    writer.write_table(table)


def _raise_not_json(records: list[dict], start: int):
    """Names the first value of `records` (rows from `start`) that JSON cannot hold."""
    for offset, record in enumerate(records):
        for name, value in record.items():
            try:
                json.dumps(value, allow_nan=False)
            except ValueError:
                raise RecordError(start + offset, name,
                                  f"holds {short_value(value)}, which a JSONL output cannot "
                                  "hold (NaN or infinity); write .parquet") from None
    raise AssertionError("write_records refused rows that each serialise")


def _records_table(records: list[dict], names: tuple[str, ...],
                   extra_types: Mapping[str, pa.DataType]) -> pa.Table:
    """JSONL records as a table of the columns `names`: schema fields in their types, other
    fields in `extra_types` (null where absent there: a column that is null throughout)."""
    fields = [schema.ARROW_SCHEMA.field(n) if n in schema.ARROW_SCHEMA.names else None for n in names]
    arrays = []
    for name, field in zip(names, fields):
        if field is None:
            try:
                arrays.append(pa.array([r.get(name) for r in records],
                                       extra_types.get(name, pa.null())))
            except (pa.ArrowInvalid, pa.ArrowTypeError) as error:
                raise ValueError(f"column {name!r} mixes types that a Parquet column cannot hold "
                                 f"({error}); write a .jsonl output to keep it as it is") from None
        else:
            values = [r.get(name) for r in records]
            if name in ("trajectory_id", "group_id", "anchor"):
                values = [str(v) if isinstance(v, int) and not isinstance(v, bool) else v for v in values]
            arrays.append(pa.array(values, field.type))
    return pa.table(dict(zip(names, arrays)))
