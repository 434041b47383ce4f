"""A sweep's result records: one JSON file per run, written whole or not at all.

`<out>/records/<run_id>.json` holds, for a finished run ("status": "done"), its
study labels, seed, resolved configuration, the final evaluation on each test
split (`eval`: split -> success, score, ...), its last training batch and wall
time; for a failed one ("status": "failed"), the error. A run without a record
has not finished; its directory `<out>/runs/<run_id>/` holds its checkpoints.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

from stepcredit.data.write import atomic_path

DONE, FAILED = "done", "failed"


def record_path(out: str | os.PathLike, run_id: str) -> str:
    return os.path.join(out, "records", f"{run_id}.json")


def run_dir(out: str | os.PathLike, run_id: str) -> str:
    return os.path.join(out, "runs", run_id)


def write_record(out: str | os.PathLike, record: dict[str, Any]) -> str:
    """Writes `record` (it names its `run`) atomically; returns the path."""
    path = record_path(out, record["run"])
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with atomic_path(path) as temporary, open(temporary, "w", encoding="utf-8") as f:
        json.dump(_finite(record), f, indent=1, sort_keys=True, allow_nan=False)
    return path


def read_record(out: str | os.PathLike, run_id: str) -> dict[str, Any] | None:
    """The run's record, or None if it has none."""
    path = record_path(out, run_id)
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}: not a result record ({error})") from None


def load_records(out: str | os.PathLike) -> list[dict[str, Any]]:
    """Every record under `<out>/records/`, sorted by run id."""
    directory = os.path.join(out, "records")
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"{out}: no records/ directory (not a sweep's output)")
    names = sorted(n for n in os.listdir(directory) if n.endswith(".json"))
    return [read_record(out, name[:-len(".json")]) for name in names]


def _finite(value: Any) -> Any:
    """NaN and infinities as null, so that any JSON reader can read the record."""
    if isinstance(value, dict):
        return {key: _finite(v) for key, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value
