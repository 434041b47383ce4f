"""Where a training iteration's time goes, from the metrics of finished runs.

    python benchmarks/training_profile.py runs/hotpotqa-grpo runs/hotpotqa-step-gae

reads each run's `metrics.jsonl` (written by `stepcredit train`) and prints a
Markdown table of per-iteration medians, over the first 20 iterations and over
the whole run: iteration, rollout, scoring, credit assignment and update
seconds, the fraction spent in credit assignment (issue target: at most 1%),
the rollout's environment steps and generated tokens per second, and step rows.
"""

from __future__ import annotations

import argparse
import os
import statistics

from stepcredit.train.metrics import read_metrics

COLUMNS = (("iteration s", "time/iteration", "{:.1f}"), ("rollout s", "time/rollout", "{:.2f}"),
           ("scoring s", "time/score", "{:.2f}"), ("credit s", "time/credit", "{:.3f}"),
           ("update s", "time/update", "{:.2f}"),
           ("credit fraction", "time/credit_fraction", "{:.2%}"),
           ("rollout env steps/s", "rollout/env_steps_per_second", "{:,.0f}"),
           ("generated tokens/s", "rollout/generated_tokens_per_second", "{:,.0f}"),
           ("step rows", "batch/rows", "{:.0f}"))
FIRST = 20


def profile_rows(name: str, metrics: list[dict]) -> list[str]:
    """Markdown rows of medians for one run (iteration -1, the warm start, is skipped)."""
    iterations = [m for m in metrics if m["iteration"] >= 0]
    if not iterations:
        raise ValueError(f"{name}: no training iterations in its metrics")
    lines = []
    for phase, part in ((f"first {min(FIRST, len(iterations))}", iterations[:FIRST]),
                        (f"all {len(iterations)}", iterations)):
        cells = [fmt.format(statistics.median(m[key] for m in part)) for _, key, fmt in COLUMNS]
        lines.append(f"| {name} | {phase} | " + " | ".join(cells) + " |")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("logdirs", nargs="+", help="run directories holding metrics.jsonl")
    args = parser.parse_args(argv)
    print("| run | phase | " + " | ".join(title for title, _, _ in COLUMNS) + " |")
    print("|---|---|" + "---:|" * len(COLUMNS))
    for logdir in args.logdirs:
        for line in profile_rows(os.path.basename(os.path.normpath(logdir)), read_metrics(logdir)):
            print(line)


if __name__ == "__main__":
    main()
