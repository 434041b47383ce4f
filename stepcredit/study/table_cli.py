"""`stepcredit table RESULTS`: a sweep's table with confidence intervals, and its curves.

    stepcredit table runs/main

writes `table.md`, `table.csv` (`stepcredit.study.table`) and `curves.png`
(`stepcredit.study.curves`) for the sweep in RESULTS and prints the Markdown.
"""

from __future__ import annotations

import argparse
import os

HELP = "tabulate a sweep: success over seeds with 95% intervals, diagnosis, published numbers"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("results", help="a sweep's directory (its --out)")
    parser.add_argument("--output", default=None,
                        help="where table.md, table.csv and curves.png go (default: RESULTS)")
    parser.add_argument("--window", type=int, default=5,
                        help="iterations of the learning curves' moving average")


def write_outputs(results: str, output: str | None = None, *, window: int = 5) -> str:
    """Writes the table and the curves of the sweep in `results`; returns the Markdown
    and a line naming the files."""
    from stepcredit.study.curves import plot_curves
    from stepcredit.study.table import write_table

    output = output or results
    paths = write_table(results, directory=output)
    plot = plot_curves(results, os.path.join(output, "curves.png"), window=window)
    with open(paths["md"], encoding="utf-8") as f:
        text = f.read()
    return text + f"\nwrote {paths['md']}, {paths['csv']}" + (f" and {plot}" if plot else "")


def run(args: argparse.Namespace) -> int:
    print(write_outputs(args.results, args.output, window=args.window))
    return 0
