"""`stepcredit reproduce --preset quick|full`: a shipped study, swept and tabulated.

    stepcredit reproduce --preset quick

runs `experiments/quick.toml` (the diagnosis on the three simulators and a small
training comparison; about 10 minutes on 2 cores) or `experiments/main.toml`
(the main table), then prints the table and writes the plots, as
`stepcredit sweep` and `stepcredit table` do. Interrupted, the same command
continues where it stopped.
"""

from __future__ import annotations

import argparse
import os

import stepcredit

HELP = ("sweep and tabulate a shipped study: quick (about 10 minutes on 2 cores) or full (the "
        "main table)")

# The shipped studies live beside the package, in the clone's experiments/ folder.
STUDIES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(stepcredit.__file__))),
                       "experiments")
PRESETS = {"quick": "quick.toml", "full": "main.toml"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from stepcredit.study.sweep_cli import add_parallel_arguments

    parser.add_argument("--preset", choices=sorted(PRESETS), default="quick",
                        help="quick: the diagnosis and a small training comparison; full: the "
                             "main study (hours)")
    parser.add_argument("--out", default=None,
                        help="the sweep's directory (default: runs/reproduce-<preset>)")
    add_parallel_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from stepcredit.study.sweep import sweep
    from stepcredit.study.table_cli import write_outputs

    study = os.path.join(STUDIES, PRESETS[args.preset])
    if not os.path.exists(study):
        raise FileNotFoundError(f"--preset {args.preset}: {study} is missing (the presets are "
                                "the study files of a clone's experiments/ folder)")
    out = args.out or os.path.join("runs", f"reproduce-{args.preset}")
    summary = sweep(study, out, workers=args.workers, threads=args.threads,
                    progress=args.progress)
    print(write_outputs(out))
    return 1 if summary.failed else 0
