"""Schedules over training iterations: ScalingInter-RL's horizon curriculum
(AgentGym-RL, arXiv 2509.08755) and the learning rate's warm-up and decay."""

from __future__ import annotations

import math
from typing import Sequence

LEARNING_RATE_SCHEDULES = ("constant", "cosine", "linear")


def horizon_stage(iteration: int, *, switch_every: int, num_stages: int) -> int:
    """The curriculum stage at `iteration`: min(iteration // switch_every, num_stages - 1).

    Args:
      iteration: 0-based training iteration.
      switch_every: iterations per stage (`steps_scaling_inter` in AgentGym-RL).
      num_stages: number of step limits in the schedule.

    Returns:
      The 0-based stage index.

    References:
      Xi et al., "AgentGym-RL", arXiv 2509.08755: `StepRoundsScheduler`.

    Example: switch_every 100, 3 stages: iteration 250 is stage 2, 1000 stays 2.
    """
    if switch_every < 1:
        raise ValueError(f"horizon_stage: switch_every={switch_every}; it must be >= 1")
    if num_stages < 1:
        raise ValueError(f"horizon_stage: num_stages={num_stages}; the schedule is empty")
    return min(iteration // switch_every, num_stages - 1)


def step_limit(iteration: int, schedule: Sequence[int], *, switch_every: int,
               default: int) -> int:
    """The episode step limit at `iteration`: `schedule[stage]`, or `default` without a schedule.

    Example: schedule (10, 20, 30), switch_every 100: iterations 0-99 allow 10
    steps, 100-199 allow 20, then 30 (SciWorld's released schedule).
    """
    if not schedule:
        return default
    if any(limit < 1 for limit in schedule):
        raise ValueError(f"step_limit: schedule={tuple(schedule)}; every limit must be >= 1")
    return schedule[horizon_stage(iteration, switch_every=switch_every, num_stages=len(schedule))]


def learning_rate_at(iteration: int, *, base: float, schedule: str, iterations: int,
                     final_fraction: float, warmup: int = 0) -> float:
    """The learning rate of `iteration`: a linear warm-up to `base`, then a decay to
    `final_fraction * base`.

    With W = `warmup`, f = `final_fraction` and, after the warm-up,
    p = min((iteration - W) / (iterations - 1 - W), 1), so that the last iteration
    runs at the final rate:

        iteration < W:  base * iteration / W      (the warm-up; 0 at iteration 0)
        constant:       base
        cosine:         base * (f + (1 - f) * (1 + cos(pi p)) / 2)
        linear:         base * (1 - (1 - f) p)

    (optax's `warmup_constant_schedule`, `warmup_cosine_decay_schedule` and
    `linear_schedule`; without a warm-up, `cosine_decay_schedule`.) The warm-up
    matters because RL starts a fresh AdamW state: its first updates move every
    parameter by about the full rate whatever the gradient's scale, which can
    undo a supervised warm start in a few iterations. At rate 0 the first
    iteration only fills the moment estimates.

    Set per iteration, not per optimizer step, because the number of minibatches
    of an iteration varies with the batch's rows.

    Example: base 1e-3, cosine, 101 iterations, f = 0.1: 1e-3 at iteration 0,
    5.5e-4 at 50, 1e-4 at 100; with warmup 10: 0 at 0, 5e-4 at 5, 1e-3 at 10.
    """
    if schedule not in LEARNING_RATE_SCHEDULES:
        raise ValueError(f"learning_rate_at: schedule={schedule!r}; expected one of "
                         f"{LEARNING_RATE_SCHEDULES}")
    if warmup < 0:
        raise ValueError(f"learning_rate_at: warmup={warmup}; it must be >= 0")
    if iteration < warmup:
        return base * iteration / warmup
    progress = min((iteration - warmup) / max(iterations - 1 - warmup, 1), 1.0)
    if schedule == "cosine":
        cosine = (1 + math.cos(math.pi * progress)) / 2
        return base * (final_fraction + (1 - final_fraction) * cosine)
    if schedule == "linear":
        return base * (1 - (1 - final_fraction) * progress)
    return base
