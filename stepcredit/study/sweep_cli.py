"""`stepcredit sweep STUDY`: run a study's grid of training runs in parallel, resumably.

    stepcredit sweep experiments/main.toml --workers 2 --out runs/main

runs every run of the study file (`stepcredit.study.spec`) in worker processes
(`stepcredit.study.sweep`). Run again after an interruption, it finishes the
study without redoing finished runs; then `stepcredit table runs/main`.
`--reuse DIR` copies the finished runs of another sweep that this study shares
(same run id and resolved configuration) instead of training them again. After an
edit to the study file, `--amend` continues in the same directory: the runs the edit
changes are moved aside to `OUT/superseded/` and trained again, the others kept.
`--only 'webshop-*'` runs the jobs whose ids match a shell pattern (repeatable) and
leaves the rest for a later sweep.
"""

from __future__ import annotations

import argparse
import os

HELP = "run a study file's grid of training runs in parallel worker processes, resumably"


def add_parallel_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workers", type=int, default=None,
                        help="jobs at a time, one process each (default: the cores; never "
                             "more than the jobs left)")
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU threads per job (default: the cores // the jobs at a time)")
    parser.add_argument("--no-progress", dest="progress", action="store_false",
                        help="no progress bar")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("study", help="a study file (TOML), e.g. experiments/main.toml")
    parser.add_argument("--out", default=None,
                        help="the sweep's directory (default: runs/<study name>)")
    parser.add_argument("--reuse", action="append", default=[], metavar="DIR",
                        help="another sweep's directory: its finished runs that this study "
                             "would train with the same configuration are copied, not "
                             "trained again (repeatable)")
    parser.add_argument("--amend", action="store_true",
                        help="the study file was edited since OUT was swept: move aside the "
                             "runs it now trains differently (to OUT/superseded/) and keep "
                             "the rest")
    parser.add_argument("--only", action="append", default=[], metavar="PATTERN",
                        help="run only the jobs whose ids match this shell pattern, e.g. "
                             "'webshop-*' or '*-GRPO-s0' (repeatable; the diagnosis is "
                             "'diagnose'); the others are left as they stand")
    add_parallel_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from stepcredit.study.spec import load_study
    from stepcredit.study.sweep import sweep

    out = args.out or os.path.join("runs", load_study(args.study).name)
    summary = sweep(args.study, out, workers=args.workers, threads=args.threads,
                    progress=args.progress, reuse=args.reuse, amend=args.amend,
                    only=args.only)
    print(f"{len(summary.skipped)} jobs done before, {len(summary.finished)} finished now, "
          f"{len(summary.failed)} failed; results in {out} (see: stepcredit table {out})")
    return 1 if summary.failed else 0
