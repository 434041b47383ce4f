"""Environment steps per second per core for the embedded simulators.

For each simulator, plays a uniformly random admissible-action policy and the
oracle policy on one core, resetting to a random task whenever an episode ends.
The clock runs only inside `reset` and `step` (the environment's work: parsing,
state update, observation text, admissible actions, anchor); the policy's choice
and the oracle's planning are not counted. Prints a table and writes it into a
marked section of `benchmarks/ENV_SPEED.md`, replacing the previous one.

Usage: python benchmarks/env_speed.py [--steps 200000] [--out benchmarks/ENV_SPEED.md]
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.sections import write_section  # noqa: E402
from stepcredit.envs import AlfWorldEnv, HotpotQAEnv, WebShopEnv  # noqa: E402

TARGET = 20_000
BEGIN, END = "<!-- env_speed:begin -->", "<!-- env_speed:end -->"


def _measure(env, steps: int, policy: str, seed: int = 0) -> tuple[float, float]:
    """Runs `steps` environment steps and returns (steps per second counting
    only `reset` and `step` calls, mean episode length). The policy's own time
    (a random choice, or the oracle's planning) is excluded."""
    rng = random.Random(seed)
    clock = time.perf_counter
    spent = 0.0
    episodes = 0
    t = clock()
    obs = env.reset(rng.randrange(env.num_tasks))
    spent += clock() - t
    for _ in range(steps):
        if policy == "random":
            action = rng.choice(obs.admissible_actions)
        else:
            action = env.oracle_actions()[0]
        t = clock()
        result = env.step(action)
        obs = result.observation
        if result.done or result.truncated:
            obs = env.reset(rng.randrange(env.num_tasks))
            episodes += 1
        spent += clock() - t
    return steps / spent, steps / max(episodes, 1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200_000, help="steps per measurement")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "ENV_SPEED.md"))
    args = parser.parse_args(argv)

    rows = []
    for cls in (WebShopEnv, AlfWorldEnv, HotpotQAEnv):
        for policy in ("random", "oracle"):
            env = cls()  # default split, difficulty and step limit
            _measure(env, 2_000, policy, seed=1)  # warm the catalogue and task caches
            rate, length = _measure(env, args.steps, policy)
            rows.append((cls.name, policy, rate, length))
            print(f"{cls.name:9s} {policy:7s} {rate:10,.0f} steps/s  (mean episode {length:.1f} "
                  f"steps)", flush=True)

    lines = ["| environment | policy | steps/s (one core) | mean episode length | >= 20,000 |",
             "|---|---|---:|---:|:---:|"]
    lines += [f"| {name} | {policy} | {rate:,.0f} | {length:.1f} | {'yes' if rate >= TARGET else 'no'} |"
              for name, policy, rate, length in rows]
    section = "\n".join([
        BEGIN, "## Embedded simulators: steps per second per core", "",
        f"`python benchmarks/env_speed.py --steps {args.steps}` on {platform.processor() or platform.machine()}, "
        f"Python {platform.python_version()}, one process (one core). Time counts `reset` and "
        "`step` calls only (building observations, admissible actions and anchors included); "
        "the policy's choice and the oracle's planning are excluded. Default configs "
        "(difficulty 1, split train).", "", *lines, END])
    write_section(args.out, section, BEGIN, END, "Environment speed")
    print("\n".join(lines))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
