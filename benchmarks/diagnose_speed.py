"""The default diagnosis's wall-clock time, and the Monte Carlo ground truth's cost per step.

1. Plays the same episodes of each simulator (eps = 0.3 expert, the default
   tasks, group size and seeds) with K = 0 and K = `--continuations` Monte
   Carlo rollouts, and reports the difference per diagnosed step: what A^pi
   costs, and per rollout step taken.
2. Runs the default diagnosis (`stepcredit diagnose` with no arguments:
   every registered estimator on the three simulators, two seeds) and
   reports each phase's seconds and the total against the 2-minute budget.

Writes a marked section of `benchmarks/DIAGNOSE_SPEED.md`.

Usage: python benchmarks/diagnose_speed.py [--out benchmarks/DIAGNOSE_SPEED.md]
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from stepcredit.diagnose.config import DiagnoseConfig  # noqa: E402
from stepcredit.diagnose.policies import parse_policy  # noqa: E402
from stepcredit.diagnose.run import diagnosable_env, diagnose  # noqa: E402
from stepcredit.diagnose.sample import sample_episodes, sample_tasks  # noqa: E402

BUDGET_S = 120.0


def _episodes_seconds(env, policy, config: DiagnoseConfig, continuations: int):
    start, steps = time.perf_counter(), 0
    for seed in config.seeds:
        tasks = sample_tasks(env.num_tasks, config.tasks, seed)
        episodes = sample_episodes(env, policy, tasks, group_size=config.group_size, seed=seed,
                                   continuations=continuations)
        steps += sum(e.length for e in episodes)
    return time.perf_counter() - start, steps


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__),
                                                      "DIAGNOSE_SPEED.md"))
    args = parser.parse_args(argv)
    config = DiagnoseConfig()
    policy = parse_policy(config.policy)

    rows = []
    for name in config.envs:
        env = diagnosable_env(name, config)
        plain, steps = _episodes_seconds(env, policy, config, 0)
        graded, _ = _episodes_seconds(env, policy, config, config.continuations)
        env.close()
        per_step = (graded - plain) / steps
        rows.append((name, steps, plain / steps, per_step))
        print(f"{name:9s} {steps} steps: playing {plain / steps * 1e3:.3f} ms/step, A^pi with "
              f"K={config.continuations} {per_step * 1e3:.2f} ms/step "
              f"({per_step / (plain / steps):.0f}x)", flush=True)

    start = time.perf_counter()
    diagnosis = diagnose(config, progress=False)
    total = time.perf_counter() - start
    print(f"default diagnosis: {total:.1f} s ({diagnosis.seconds}); budget {BUDGET_S:.0f} s",
          flush=True)

    lines = ["| simulator | diagnosed steps | playing (ms/step) | A^pi (ms/step) | "
             "A^pi / playing |", "|---|---:|---:|---:|---:|"]
    lines += [f"| {name} | {steps} | {play * 1e3:.3f} | {truth * 1e3:.2f} | {truth / play:.0f}x |"
              for name, steps, play, truth in rows]
    phases = " · ".join(f"{k} {v:.1f} s" for k, v in diagnosis.seconds.items())
    section = "\n".join([
        "# Diagnosis speed", "",
        f"`python benchmarks/diagnose_speed.py` on {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores, Python {platform.python_version()}, one process.", "",
        f"Monte Carlo ground truth (K = {config.continuations} paired rollouts per action and "
        f"per state, policy {config.policy}, {config.tasks} tasks x {config.group_size} "
        f"episodes x {len(config.seeds)} seeds per simulator): the cost per diagnosed step "
        "beyond playing it.", "", *lines, "",
        f"The default diagnosis (`stepcredit diagnose`: {len(diagnosis.estimators)} rows "
        f"(every registered estimator and the two references) on {', '.join(config.envs)}, "
        f"{len(config.seeds)} seeds): **{total:.1f} s** against a budget of "
        f"{BUDGET_S:.0f} s ({total / BUDGET_S:.2f} of it); by phase: {phases}.", ""])
    with open(args.out, "w") as f:
        f.write(section)
    print(f"wrote {args.out}")
    return 0 if total <= BUDGET_S else 1


if __name__ == "__main__":
    sys.exit(main())
