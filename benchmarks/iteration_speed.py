"""Environment steps per second of whole training iterations, before and after a lever.

    python -m benchmarks.iteration_speed [--envs hotpotqa webshop] [--iterations 20]
        [--warmup 5] [--out benchmarks/ITERATION_SPEED.md]

For each environment the README's training command (choice actions, d_model 64,
8 tasks x 8 rollouts, KL 0.1 to the warm-started policy, its warm start; WebShop
with history window 0 and 75 warm-start steps on 512 tasks) is built twice:
with `share_contexts=False` (before: every step row and prompt computed on its
own) and with `share_contexts=True` (after: rows sharing their context computed
once, `stepcredit.models.sharing`). Both start from one warm-started state with
the same keys, and their iterations alternate, so whatever else loads the machine
falls on both alike. A whole iteration is rollout, scoring, credit and update;
environment steps are its step rows. Reported per setting: steps per second over
all iterations (compilation included) and after the first `--warmup`, the median
seconds of each phase, the mean training success and the greedy test success on
64 tasks after the last iteration (the learning is the same up to float
rounding, so these should agree within noise).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import statistics
import tempfile

import jax
import numpy as np

from benchmarks.sections import write_section
from stepcredit.train.build import make_env, with_fitted_prompt_budget
from stepcredit.train.state import TrainState
from stepcredit.train.train_command import add_arguments, config_from_args
from stepcredit.train.trainer import Trainer
from stepcredit.train.warm_start import supervised_warm_start

COMMON = ("--estimator grpo --tasks-per-iteration 8 --group-size 8 --kl-coef 0.1 "
          "--eval-tasks 64 --action-format choice --d-model 64 --max-steps 5 "
          "--learning-rate 1e-3").split()
COMMANDS = {"hotpotqa": ["--env", "hotpotqa", "--warm-start-steps", "36"],
            "webshop": ["--env", "webshop", "--history-window", "0", "--warm-start-steps", "75",
                        "--warm-start-tasks", "512"]}
PHASES = (("rollout s", "time/rollout"), ("scoring s", "time/score"),
          ("update s", "time/update"), ("iteration s", "time/iteration"))
BEGIN, END = "<!-- iteration-speed:begin -->", "<!-- iteration-speed:end -->"


def _copy(state: TrainState) -> TrainState:
    """An independent copy (the update donates its input buffers)."""
    return TrainState.from_tree(jax.tree.map(lambda x: x.copy() if hasattr(x, "copy") else x,
                                             state.as_tree()))


def _trainers(env: str, iterations: int, logdir: str) -> dict[str, Trainer]:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(COMMANDS[env] + COMMON + ["--iterations", str(iterations),
                                                       "--logdir", logdir])
    config = with_fitted_prompt_budget(config_from_args(args))
    after = Trainer(dataclasses.replace(config, share_contexts=True), log=lambda _: None)
    after.state, _ = supervised_warm_start(after.state, after.parts,
                                           lambda: make_env(after.config, "train"))
    before = Trainer(dataclasses.replace(config, share_contexts=False), log=lambda _: None)
    before.state = _copy(after.state)
    return {"before": before, "after": after}


def _summary(history: list[dict], warmup: int) -> dict[str, float]:
    late = history[warmup:]
    steps = lambda part: sum(m["batch/rows"] for m in part)  # noqa: E731
    seconds = lambda part: sum(m["time/iteration"] for m in part)  # noqa: E731
    out = {"all": steps(history) / seconds(history), "late": steps(late) / seconds(late),
           "success": float(np.mean([m["rollout/success"] for m in history]))}
    out.update({name: statistics.median(m[key] for m in late) for name, key in PHASES})
    return out


def measure(env: str, iterations: int, warmup: int) -> list[str]:
    with tempfile.TemporaryDirectory() as logdir:
        trainers = _trainers(env, iterations, logdir)
        history = {name: [] for name in trainers}
        for iteration in range(iterations):
            for name, trainer in trainers.items():
                history[name].append(trainer.iteration(iteration))
        tests = {name: trainer.evaluate()["success"] for name, trainer in trainers.items()}
    summary = {name: _summary(h, warmup) for name, h in history.items()}
    lines = []
    for name, s in summary.items():
        phases = " | ".join(f"{s[title]:.2f}" for title, _ in PHASES)
        lines.append(f"| {env} | {name} | {phases} | {s['all']:,.0f} | {s['late']:,.0f} "
                     f"| {s['success']:.3f} | {tests[name]:.2f} |")
    ratio_all = summary["after"]["all"] / summary["before"]["all"]
    ratio_late = summary["after"]["late"] / summary["before"]["late"]
    lines.append(f"| {env} | after / before | | | | | {ratio_all:.2f}x | {ratio_late:.2f}x | | |")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--envs", nargs="+", default=list(COMMANDS), choices=list(COMMANDS))
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5,
                        help="iterations left out of the 'after warm-up' rate (compilation)")
    parser.add_argument("--out", default=os.path.join("benchmarks", "ITERATION_SPEED.md"))
    args = parser.parse_args(argv)
    if not 0 <= args.warmup < args.iterations:
        raise ValueError(f"--warmup {args.warmup} must lie in [0, --iterations {args.iterations})")
    header = ("| env | setting | " + " | ".join(f"{title} (median)" for title, _ in PHASES)
              + " | env steps/s, all | env steps/s, after warm-up | training success "
              "| test success |")
    rows = [header, "|---|---|" + "---:|" * (len(PHASES) + 4)]
    for env in args.envs:
        rows += measure(env, args.iterations, args.warmup)
        print("\n".join(rows[-3:]), flush=True)
    load = os.getloadavg()[0]
    section = "\n".join([
        BEGIN, "## Training iterations: shared contexts off (before) and on (after)", "",
        f"`python -m benchmarks.iteration_speed --iterations {args.iterations} "
        f"--warmup {args.warmup}` on {platform.machine()}, {os.cpu_count()} cores, jax "
        f"{jax.__version__} on {jax.devices()[0].platform}; 1-minute load average at the end "
        f"{load:.1f}. Medians over the iterations after the first {args.warmup}; "
        "\"all\" includes them (and their compilation).", "", *rows, END])
    write_section(args.out, section, BEGIN, END, "Training iteration speed")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
