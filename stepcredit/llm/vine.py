"""VinePPO's Monte Carlo values for a chat-model policy: K continuations from every visited state.

As `stepcredit.train.vine` does for the word-level policy (Kazemnejad et al.,
arXiv 2410.01679): every state s_t a batch visited is rebuilt by replaying its
trajectory's actions (the text each environment received, `info["action"]`)
on a fresh simulator and checked against the recorded anchor
(`train.vine.branch_points`, shared with the word-level policy); identical states
(the same task and the same sampled ids so far) are valued once; K
continuations are played from each state's snapshot with the chat history the
model saw there (`rollout.play`, one sampling call per step for all of them),
at the policy's temperature, until the episode ends or the environment's step
limit, and

    V_MC(s_t) = (1 / K) sum_k G_k,   G_k = the sum of continuation k's rewards
                                     (invalid-action penalty included; gamma 1)

goes into each step's `info[stepcredit.train.vine.MC_VALUE]`, where the
estimator reads it (`vine.mc_value_array`). Only simulators with snapshots
(`SnapshotEnv`) can be continued mid-episode.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Sequence

import numpy as np

from stepcredit.batch import Trajectory
from stepcredit.envs.base import Env
from stepcredit.llm import rollout
from stepcredit.llm.checkpoint import Checkpoint
from stepcredit.train.vine import MC_VALUE, VINE_STREAM, branch_points

# The most continuations sampled in one call: a rollout batch of GiGPO's recipe (16 tasks x 8),
# whose KV cache a 7B model's GPU holds (the word policy's 1024 would not fit).
CONTINUATIONS_PER_CALL = 128


def with_mc_values(qwen: Checkpoint, make_env: Callable[[], Env], tasks: Sequence[Any],
                   trajectories: Sequence[Trajectory], *, rollouts: int, seed: int,
                   max_new_tokens: int, temperature: float, window: int,
                   invalid_action_penalty: float) -> tuple[list[Trajectory], dict[str, float]]:
    """The trajectories with V_MC(s_t) in every step's `info[MC_VALUE]`, and the metrics
    `vine/env_steps` (continuation steps played), `vine/states` (states valued) and `time/vine`.

    Args:
      qwen: the policy that played the batch (it plays the continuations).
      make_env: a fresh simulator of the batch's config.
      tasks: each group's task.
      rollouts: K, continuations per state.
      seed: the continuations' sampling seed (chunk c of `CONTINUATIONS_PER_CALL`
        continuations samples with seed + c).
      max_new_tokens, temperature, window, invalid_action_penalty: the batch's.
    """
    started = time.perf_counter()
    env = make_env()
    try:
        points, index = branch_points(env, tasks, trajectories, None, None)
    finally:
        env.close()
    starts = [p for p in range(len(points)) for _ in range(rollouts)]
    returns, env_steps = np.zeros(len(starts)), 0
    for c, begin in enumerate(range(0, len(starts), CONTINUATIONS_PER_CALL)):
        chunk = starts[begin:begin + CONTINUATIONS_PER_CALL]
        envs = [make_env() for _ in chunk]
        try:
            for env, p in zip(envs, chunk):
                env.restore(points[p].snapshot)
            played = rollout.play(qwen, envs, [points[p].observation for p in chunk],
                                  [points[p].history for p in chunk], group_ids=[0] * len(chunk),
                                  seed=seed + c, max_new_tokens=max_new_tokens, temperature=temperature,
                                  window=window, invalid_action_penalty=invalid_action_penalty)
        finally:
            for env in envs:
                env.close()
        returns[begin:begin + len(chunk)] = [t.score for t in played]
        env_steps += sum(len(t.steps) for t in played)
    values = returns.reshape(len(points), rollouts).mean(axis=1)
    valued = [dataclasses.replace(t, steps=tuple(
        dataclasses.replace(s, info={**s.info, MC_VALUE: float(values[p])}) for s, p in zip(t.steps, rows)))
        for t, rows in zip(trajectories, index)]
    return valued, {"vine/env_steps": float(env_steps), "vine/states": float(len(points)),
                    "time/vine": time.perf_counter() - started}


def continuation_seed(seed: int, iteration: int, round_: int = 0) -> int:
    """The continuations' seed of an iteration's round of tasks: apart from the batch's own."""
    return ((seed * 100_003 + iteration) * 17 + round_) * 1_000_003 + VINE_STREAM


__all__: Sequence[str] = ("continuation_seed", "with_mc_values")
