"""Snapshot, restore and clone of the embedded simulators against copy.deepcopy.

For each simulator (default config), prepares environments in mid-episode
states (random tasks, a few random admissible steps) and times, cycling over
them, `restore(snapshot())`, `clone()` and `copy.deepcopy(env)`; prints the
medians and how many times faster the snapshot calls are, and writes the table
into a marked section of `benchmarks/ENV_SPEED.md`, replacing the previous one.

Usage: python benchmarks/snapshot_speed.py [--reps 2000] [--deepcopy-reps 30]
           [--out benchmarks/ENV_SPEED.md]
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.sections import write_section  # noqa: E402
from stepcredit.envs import AlfWorldEnv, HotpotQAEnv, WebShopEnv  # noqa: E402

TARGET_S = 1e-3  # snapshot + restore must stay under a millisecond
BEGIN, END = "<!-- snapshot_speed:begin -->", "<!-- snapshot_speed:end -->"


def _mid_episode(cls, count: int, seed: int = 0) -> list:
    """`count` environments of `cls`, each a few random steps into a random task."""
    rng = random.Random(seed)
    envs = []
    while len(envs) < count:
        env = cls()
        obs = env.reset(rng.randrange(env.num_tasks))
        for _ in range(rng.randrange(1, 5)):
            result = env.step(rng.choice(obs.admissible_actions))
            obs = result.observation
            if result.done or result.truncated:
                break
        if env.running:
            envs.append(env)
    return envs


def _median_seconds(call, envs: list, reps: int) -> float:
    """The median seconds of `call(env)`, cycling over `envs`."""
    clock, times = time.perf_counter, []
    for i in range(reps):
        env = envs[i % len(envs)]
        t = clock()
        call(env)
        times.append(clock() - t)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=2000,
                        help="calls timed for snapshot + restore and for clone")
    parser.add_argument("--deepcopy-reps", type=int, default=30, help="calls timed for deepcopy")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "ENV_SPEED.md"))
    args = parser.parse_args(argv)

    rows = []
    for cls in (WebShopEnv, AlfWorldEnv, HotpotQAEnv):
        envs = _mid_episode(cls, 10)
        snap = _median_seconds(lambda env: env.restore(env.snapshot()), envs, args.reps)
        clone = _median_seconds(lambda env: env.clone(), envs, args.reps)
        deep = _median_seconds(copy.deepcopy, envs, args.deepcopy_reps)
        rows.append((cls.name, snap, clone, deep))
        print(f"{cls.name:9s} snapshot+restore {snap * 1e6:8.1f} us  clone {clone * 1e6:8.1f} us  "
              f"deepcopy {deep * 1e6:10.1f} us  ({deep / snap:,.0f}x, {deep / clone:,.0f}x)",
              flush=True)

    lines = ["| environment | snapshot + restore (us) | clone (us) | copy.deepcopy (us) | "
             "deepcopy / (snapshot + restore) | deepcopy / clone | < 1 ms |",
             "|---|---:|---:|---:|---:|---:|:---:|"]
    lines += [f"| {name} | {snap * 1e6:.1f} | {clone * 1e6:.1f} | {deep * 1e6:,.0f} | "
              f"{deep / snap:,.0f}x | {deep / clone:,.0f}x | {'yes' if snap < TARGET_S else 'no'} |"
              for name, snap, clone, deep in rows]
    section = "\n".join([
        BEGIN, "## Embedded simulators: snapshot, restore and clone", "",
        f"`python benchmarks/snapshot_speed.py --reps {args.reps} --deepcopy-reps "
        f"{args.deepcopy_reps}` on {platform.processor() or platform.machine()}, Python "
        f"{platform.python_version()}, one process. Medians over calls cycling through ten "
        "mid-episode environments per simulator (default configs: difficulty 1, split train). "
        "Snapshots copy only the episode state; `copy.deepcopy` also copies the shared "
        "catalogue, knowledge base or layouts.", "", *lines, END])
    write_section(args.out, section, BEGIN, END, "Environment speed")
    print("\n".join(lines))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
