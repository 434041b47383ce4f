"""Ablation sweeps: estimators x environments x seeds on equal terms.

Every run uses the same `TrainConfig` apart from the swept fields, so the
table compares credit assignment and nothing else. Results go to
`<out>/runs/<env>-<estimator>-s<seed>/` (metrics, TensorBoard, checkpoints)
and are summarised in `<out>/results.csv`, `<out>/results.md` and, when
matplotlib is installed,
`<out>/curves.png`.

    python experiments/sweep.py --envs alfworld --estimators grpo step_gae gigpo \
        --seeds 0 1 --iterations 40 --out experiments/results/alfworld
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import functools
import itertools
import os
import statistics
import sys
import time

from stepcredit.train.config import TrainConfig
from stepcredit.train.metrics import read_metrics
from stepcredit.train.build import with_fitted_prompt_budget
from stepcredit.train.trainer import Trainer

FIELDS = ("env", "estimator", "seed", "iterations", "minutes", "eval_success", "eval_score",
          "train_success_last", "credit_fraction")


def run_one(base: TrainConfig, env: str, estimator: str, seed: int, out: str) -> dict:
    """Trains one configuration and returns its summary row."""
    logdir = os.path.join(out, "runs", f"{env}-{estimator}-s{seed}")
    config = with_fitted_prompt_budget(dataclasses.replace(
        base, env=env, estimator=estimator, seed=seed, logdir=logdir,
        eval_every=base.eval_every or base.iterations))
    began = time.perf_counter()
    history = Trainer(config, log=functools.partial(print, flush=True)).run()
    last = history[-1]
    return {"env": env, "estimator": estimator, "seed": seed, "iterations": len(history),
            "minutes": (time.perf_counter() - began) / 60,
            "eval_success": last.get("eval/success", float("nan")),
            "eval_score": last.get("eval/score", float("nan")),
            "train_success_last": last["rollout/success"],
            "credit_fraction": statistics.mean(h["time/credit_fraction"] for h in history)}


def write_table(rows: list[dict], out: str) -> None:
    """Per-run CSV and a Markdown table of means (and spread) over seeds."""
    with open(os.path.join(out, "results.csv"), "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    lines = ["| env | estimator | seeds | eval success | eval score | minutes/run |",
             "|---|---|---|---|---|---|"]
    key = lambda r: (r["env"], r["estimator"])  # noqa: E731
    for (env, estimator), group in itertools.groupby(sorted(rows, key=key), key=key):
        group = list(group)
        success = [r["eval_success"] for r in group]
        spread = f" ± {statistics.stdev(success):.2f}" if len(success) > 1 else ""
        lines.append(f"| {env} | {estimator} | {len(group)} | {statistics.mean(success):.2f}{spread} "
                     f"| {statistics.mean(r['eval_score'] for r in group):.2f} "
                     f"| {statistics.mean(r['minutes'] for r in group):.1f} |")
    with open(os.path.join(out, "results.md"), "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


def plot_curves(rows: list[dict], out: str) -> str | None:
    """Training success per iteration, one line per run; None without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    figure, axis = plt.subplots(figsize=(7, 4))
    for row in rows:
        logdir = os.path.join(out, "runs", f"{row['env']}-{row['estimator']}-s{row['seed']}")
        points = [(m["iteration"], m["rollout/success"]) for m in read_metrics(logdir)
                  if m["iteration"] >= 0]
        axis.plot(*zip(*points), label=f"{row['env']} {row['estimator']} s{row['seed']}")
    axis.set_xlabel("iteration")
    axis.set_ylabel("training success")
    axis.legend(fontsize=7)
    path = os.path.join(out, "curves.png")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--envs", nargs="+", default=["alfworld"])
    parser.add_argument("--estimators", nargs="+", default=["grpo", "step_gae"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    parser.add_argument("--iterations", type=int, default=40)
    parser.add_argument("--tasks-per-iteration", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-steps", type=int, default=8)
    parser.add_argument("--warm-start-steps", type=int, default=0)
    parser.add_argument("--eval-tasks", type=int, default=32)
    parser.add_argument("--out", default="experiments/results/sweep")
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    base = TrainConfig(iterations=args.iterations, tasks_per_iteration=args.tasks_per_iteration,
                       group_size=args.group_size, max_steps=args.max_steps,
                       warm_start_steps=args.warm_start_steps, eval_tasks=args.eval_tasks,
                       checkpoint_every=args.iterations)
    rows = [run_one(base, env, estimator, seed, args.out)
            for env, estimator, seed in itertools.product(args.envs, args.estimators, args.seeds)]
    write_table(rows, args.out)
    plot = plot_curves(rows, args.out)
    print(f"wrote {os.path.join(args.out, 'results.md')}" + (f" and {plot}" if plot else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
