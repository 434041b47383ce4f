"""Precomputed trajectories: the step-row schema, reading, validation and writing.

One row per agent step (see `stepcredit.data.schema`). Sources are JSONL,
Parquet, `save_to_disk` folders or `datasets.Dataset`s, read in batches of whole
trajectories so that millions of steps run in bounded memory. By job:
`read` (sources and their raw batches), `checks` (record and trajectory
checks, `RecordError`), `stream` (`iter_batches`, `validate`, `load`),
`write` (atomic JSONL/Parquet output), `convert` (`Trajectory`s to rows and
back). Offline credit (`stepcredit credit`) lives in `stepcredit.data.offline`.
"""

from stepcredit.data.checks import RecordError
from stepcredit.data.convert import iter_trajectories, load_trajectories, save_trajectories
from stepcredit.data.schema import ARROW_SCHEMA, FEATURES
from stepcredit.data.stream import LogBatch, Summary, iter_batches, load, validate

__all__ = [
    "ARROW_SCHEMA",
    "FEATURES",
    "LogBatch",
    "RecordError",
    "Summary",
    "iter_batches",
    "iter_trajectories",
    "load",
    "load_trajectories",
    "save_trajectories",
    "validate",
]
