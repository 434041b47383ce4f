"""`stepcredit.batch.Trajectory`s to step rows and back.

`save_trajectories` writes trajectories as rows of the schema
(`stepcredit.data.schema`); `iter_trajectories` and `load_trajectories` read
any log of step rows back into trajectories.
"""

from __future__ import annotations

import bisect
import json
from typing import Iterator, Sequence

import numpy as np
import pyarrow as pa

from stepcredit.data import schema
from stepcredit.data.checks import RecordError, canonical_records, check_trajectories, check_values
from stepcredit.data.read import BATCH_ROWS
from stepcredit.data.stream import iter_batches
from stepcredit.data.write import RowWriter, atomic_path, output_format
from stepcredit.keys import stable_key


def _checked_table(rows: list[dict], starts: list[int], owners: list[int]) -> pa.Table:
    """A batch of whole trajectories' rows as a table of the schema, checked as
    `load_trajectories` will read them back; trajectory `owners[k]` holds rows
    `starts[k]` onwards. A bad value is named by its trajectory and step before
    anything of the batch is written."""
    try:
        table = canonical_records(rows, 0)
        check_values(table, 0)
        check_trajectories(table, np.asarray([*starts, len(rows)]), 0)
    except RecordError as error:
        k = bisect.bisect_right(starts, error.row) - 1
        message = str(error).split(": ", 1)[1]
        raise ValueError(f"save_trajectories: trajectories[{owners[k]}].steps"
                         f"[{error.row - starts[k]}], field {error.field!r}: {message}") from None
    return table


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
    first_of: dict[str, int] = {}
    for i, name in enumerate(trajectory_ids):
        if first_of.setdefault(str(name), i) != i:
            raise ValueError(f"save_trajectories: trajectory_ids[{i}] is {str(name)!r}, as is "
                             f"trajectory_ids[{first_of[str(name)]}]; each trajectory needs its "
                             "own id (its rows would read back as one trajectory)")
    written = 0
    with atomic_path(path) as temporary:
        writer = RowWriter(temporary, fmt)
        try:
            # Checked and converted a batch at a time: one table per trajectory cost more
            # than the write itself (about 2,500 rows a second).
            rows: list[dict] = []
            starts: list[int] = []
            owners: list[int] = []
            for i, (trajectory, name) in enumerate(zip(trajectories, trajectory_ids)):
                if not trajectory.steps:
                    raise ValueError(f"save_trajectories: trajectories[{i}] has no steps")
                try:
                    steps = _trajectory_rows(trajectory, str(name))
                except TypeError as error:  # an info value json cannot write
                    raise ValueError(f"save_trajectories: trajectories[{i}]: {error}") from None
                starts.append(len(rows))
                owners.append(i)
                rows.extend(steps)
                if len(rows) >= batch_rows:
                    writer.write_table(_checked_table(rows, starts, owners))
                    written, rows, starts, owners = written + len(rows), [], [], []
            if rows or written == 0:
                writer.write_table(_checked_table(rows, starts, owners) if rows else
                                   pa.Table.from_pylist([], schema=schema.ARROW_SCHEMA))
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
            return stable_key(text)
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
    strings (raw observations) come back as `stepcredit.keys.stable_key` of
    the string. Log-probs and entropies come back as the float32 values stored.
    `response_values` (token-level critic values) have no place in a
    `StepRecord` and are not read.
    """
    return list(iter_trajectories(source, batch_rows=batch_rows))
