"""`stepcredit credit`: offline credit assignment on a log of step rows.

    stepcredit credit --input steps.jsonl --estimator step_gae --set gamma=0.99 \\
        --set lam=0.95 --output credited.parquet

reads the log (JSONL, Parquet or a save_to_disk folder; see
`stepcredit.data.schema`), computes the estimator's advantages (and returns
where defined) and writes the input rows, untouched, with the new columns;
the output is written atomically and the input is never modified.
"""

from __future__ import annotations

import argparse

HELP = "compute an estimator's advantages on a log of step rows and write them as new columns"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--input", required=True, help="JSONL/Parquet file or save_to_disk folder")
    parser.add_argument("--estimator", required=True,
                        help="registry name (see stepcredit.advantages.names())")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a hyperparameter of the estimator (repeatable)")
    parser.add_argument("--output", required=True, help="output .jsonl/.json or .parquet file")
    parser.add_argument("--whiten", default="default", choices=("default", "none", "steps", "tokens"),
                        help="whitening over the whole input (default: the estimator's)")
    parser.add_argument("--batch-rows", type=int, default=16384,
                        help="rows per batch of whole trajectories or groups (default 16384)")
    parser.add_argument("--allow-empty", action="store_true",
                        help="write an empty output when the input has no rows (default: an empty "
                             "input is an error)")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bars")


def run(args: argparse.Namespace) -> int:
    from stepcredit.data import offline
    from stepcredit.settings import parse_settings

    summary = offline.compute_credit(
        args.input, args.output, args.estimator, overrides=parse_settings(args.set),
        whiten=args.whiten, batch_rows=args.batch_rows, allow_empty=args.allow_empty,
        progress=not args.no_progress)
    print(f"{summary.estimator}: {summary.rows} steps in {summary.trajectories} trajectories, "
          f"whiten={summary.whiten}")
    print(f"wrote {summary.output} (new columns: {', '.join(summary.columns)})")
    return 0
