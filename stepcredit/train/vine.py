"""VinePPO's Monte Carlo values: K continuations of the policy from every state a batch visited.

After an iteration's episodes are played, every visited state s_t (the start
of each step) is rebuilt and K continuations are played from it with the same
policy at the same temperature, to the iteration's step limit:

    V_MC(s_t) = (1 / K) sum_k G_k,   G_k = the sum of continuation k's step
                                     rewards (invalid-action penalty included,
                                     as in the batch's rewards; gamma = 1)

and the estimator (`vineppo`: step GAE with lam 0 on these values) gives
A_t = r_t + V_MC(s_{t+1}) - V_MC(s_t). After the last step no value is read:
V_MC is 0 after a termination and, after a truncation by the step limit, 0 as
well, because no steps remain under the limit (the continuations themselves
stop there, so V_MC is the value under the iteration's step limit).

States are rebuilt by replaying each trajectory's actions (the text each
environment received, `info["action"]`) on a fresh simulator of the same
config: one pass of the batch's steps, cheaper than a snapshot at every step
of the rollout and exact, since the simulators are deterministic given the
task and the actions; every replayed state is checked against the recorded
anchor and observation, so a divergence raises instead of valuing another
state. Identical states (the same task and the same action ids so far: the
first state of a group's G episodes, shared prefixes) are valued once, as the
authors deduplicate identical prefixes. The continuations start from each
state's snapshot with the prompt history the policy saw there, and play
through `stepcredit.rollout.collect` and `EnvPool` in pools of at most
`MAX_ENVIRONMENTS`, one batched policy forward per step for all of them.
Their keys are `fold_in(rollout key, VINE_STREAM)`, a function of the
iteration's key, so a resumed run plays them again bit for bit.

Only simulators with snapshots (`SnapshotEnv`) can be resumed mid-episode;
TextWorld and HTTP environments are refused.

References:
  Kazemnejad et al., "VinePPO: Refining Credit Assignment in RL Training of
  LLMs", arXiv 2410.01679 (K = 9 in the authors' configs,
  `episode_generators/9rolls.jsonnet`).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Sequence

import jax
import numpy as np

from stepcredit.batch import Trajectory
from stepcredit.envs.base import Observation, StepResult, step_info
from stepcredit.envs.pool import EnvPool
from stepcredit.keys import stable_key
from stepcredit.rollout import Rollout, RolloutConfig, collect, history_action
from stepcredit.train import mappings
from stepcredit.train.build import Parts, make_env

# Folded into the iteration's rollout key for the continuations' keys ("VINE").
VINE_STREAM = 0x56494E45
# The most continuations played together (one policy forward per step for all of them);
# a pool is padded to a power of two, so a run compiles few generation shapes.
MAX_ENVIRONMENTS = 1024
# Where each step's V_MC(s_t) is kept in its `StepRecord.info`.
MC_VALUE = "vine/mc_value"
# What `build.check_snapshots` tells an environment without snapshots.
VALUES_NEED = "vineppo's Monte Carlo values continue episodes"


@dataclasses.dataclass(frozen=True)
class BranchPoint:
    """A visited state to continue from.

    Attributes:
      snapshot: the simulator's state at the step's start (`SnapshotEnv.snapshot`).
      observation: what the environment showed there.
      history: the (observation, action) pairs of the episode before it, as
        the policy's prompt shows them (`history_action`).
    """

    snapshot: Any
    observation: Observation
    history: tuple[tuple[str, Any], ...]


def branch_points(env, tasks: Sequence[Any], trajectories: Sequence[Trajectory],
                  config: RolloutConfig | None, tokenizer) -> tuple[list[BranchPoint], list[list[int]]]:
    """Every distinct state the trajectories visited, rebuilt by replaying their actions.

    Args:
      env: a simulator of the rollout's config (it is reset for each trajectory).
      tasks: the task of each group (trajectory b played `tasks[group_id]`).
      trajectories: the batch, each step's info holding its action text.
      config, tokenizer: the word-level rollout's, for its prompt history and a
        check of each observation's ids; None for a chat model's trajectories
        (`stepcredit.llm.rollout`: the history holds the action text, and the
        anchors alone are checked).

    Returns:
      `(points, index)`: the distinct states, and per trajectory the index in
      `points` of each step's start state.

    Raises:
      ValueError: a step holds no action text, or the replay reached another
        state than the one recorded (the environment is not deterministic).
    """
    points: list[BranchPoint] = []
    seen: dict[tuple, int] = {}
    index = []
    for b, trajectory in enumerate(trajectories):
        task = tasks[trajectory.group_id]
        observation, history, prefix, rows = env.reset(task), [], (task,), []
        for t, step in enumerate(trajectory.steps):
            if stable_key(observation.anchor) != step.anchor or (
                    tokenizer is not None
                    and list(tokenizer.encode(observation.text)) != list(step.observation_ids)):
                raise ValueError(f"vineppo: replaying trajectory {b} on {env.name} reached "
                                 f"another state at step {t} than the one recorded; the "
                                 "environment must be deterministic given the task and actions")
            if prefix not in seen:
                seen[prefix] = len(points)
                points.append(BranchPoint(env.snapshot(), observation, tuple(history)))
            rows.append(seen[prefix])
            if "action" not in step.info:
                raise ValueError(f"vineppo: step {t} of trajectory {b} holds no action text "
                                 "(info['action']); collect it with stepcredit.rollout.collect")
            action = step.info["action"]
            history.append((observation.text, action if config is None else
                            history_action(config, action, step.action_ids)))
            observation = env.step(action).observation
            prefix = (*prefix, tuple(step.action_ids))
        index.append(rows)
    return points, index


class _Resume:
    """A simulator whose `reset(i)` puts it in branch point i."""

    def __init__(self, env, points: Sequence[BranchPoint]):
        self.env, self.points = env, points
        self.name, self.max_steps = env.name, env.max_steps

    def reset(self, i: int) -> Observation:
        self.env.restore(self.points[i].snapshot)
        return self.points[i].observation

    def step(self, action: str) -> StepResult:
        return self.env.step(action)

    def close(self) -> None:
        self.env.close()


class _Idle:
    """Pads a pool to its fixed size: its episode ends at the first step, with reward 0."""

    name, max_steps = "idle", 1

    def __init__(self, observation: Observation):
        self.observation = observation

    def reset(self, task: Any) -> Observation:
        return self.observation

    def step(self, action: str) -> StepResult:
        return StepResult(self.observation, 0.0, True, False, step_info(valid=True))

    def close(self) -> None:
        pass


def continuation_returns(parts: Parts, policy, points: Sequence[BranchPoint], rollouts: int,
                         key: jax.Array, limit: int) -> tuple[np.ndarray, int]:
    """`[len(points), K]` returns of K continuations from each point, and their env steps.

    Continuation k of point p is environment `p * K + k` of the flattened list,
    played in pools of at most `MAX_ENVIRONMENTS` (pool c with key
    `fold_in(key, c)`), each padded with idle environments to a power of two.
    """
    config = parts.config
    # No bootstrap forward: after a truncation no steps remain under the limit.
    rollout_config = dataclasses.replace(config.rollout, bootstrap_truncated=False)
    starts = [p for p in range(len(points)) for _ in range(rollouts)]
    returns, env_steps = np.zeros(len(starts)), 0
    for c, begin in enumerate(range(0, len(starts), MAX_ENVIRONMENTS)):
        mappings.release_compiled_programs()  # each pool meets shapes of its own
        chunk = starts[begin:begin + MAX_ENVIRONMENTS]
        size = min(MAX_ENVIRONMENTS, 1 << max(3, (len(chunk) - 1).bit_length()))
        envs = ([_Resume(make_env(config, "train", limit), points) for _ in chunk]
                + [_Idle(points[chunk[0]].observation) for _ in range(size - len(chunk))])
        history = [points[p].history for p in chunk] + [()] * (size - len(chunk))
        with EnvPool(envs) as pool:
            played = collect(parts.graphdef, policy, pool, chunk + [0] * (size - len(chunk)), 1,
                             parts.tokenizer, jax.random.fold_in(key, c), rollout_config,
                             history=history, share_prompts=config.share_contexts)
        real = played.trajectories[:len(chunk)]
        returns[begin:begin + len(chunk)] = [t.score for t in real]
        env_steps += sum(len(t.steps) for t in real)
    return returns.reshape(len(points), rollouts), env_steps


def with_mc_values(parts: Parts, policy, rollout: Rollout, tasks: Sequence[Any], key: jax.Array,
                   limit: int) -> Rollout:
    """The rollout with V_MC(s_t) in every step's info (`MC_VALUE`) and the cost in its metrics.

    Args:
      parts: the run's parts; `parts.config.vine_rollouts` is K.
      policy: the policy that played `rollout` (it plays the continuations).
      rollout: the iteration's episodes, played on `tasks` at the step limit `limit`.
      key: the iteration's rollout key; the continuations use
        `fold_in(key, VINE_STREAM)`.

    Returns:
      A `Rollout` of the same trajectories with `info[MC_VALUE]` set, and the
      metrics `vine/env_steps` (continuation steps played), `vine/states`
      (distinct states valued) and `time/vine`.
    """
    started = time.perf_counter()
    env = make_env(parts.config, "train", limit)
    try:
        points, index = branch_points(env, tasks, rollout.trajectories, parts.config.rollout,
                                      parts.tokenizer)
    finally:
        env.close()
    returns, env_steps = continuation_returns(parts, policy, points, parts.config.vine_rollouts,
                                              jax.random.fold_in(key, VINE_STREAM), limit)
    values = returns.mean(axis=1)
    trajectories = [dataclasses.replace(t, steps=[
        dataclasses.replace(s, info={**s.info, MC_VALUE: float(values[p])})
        for s, p in zip(t.steps, rows)]) for t, rows in zip(rollout.trajectories, index)]
    return Rollout(trajectories, {**rollout.metrics, "vine/env_steps": float(env_steps),
                                  "vine/states": float(len(points)),
                                  "time/vine": time.perf_counter() - started})


def mc_value_array(trajectories: Sequence[Trajectory], num_steps: int) -> np.ndarray:
    """`[B, num_steps]` float32 V_MC(s_t) of each step (0 on padding), from `info[MC_VALUE]`;
    steps past `num_steps` are cut, as `collate` cuts them."""
    out = np.zeros((len(trajectories), num_steps), np.float32)
    for b, trajectory in enumerate(trajectories):
        steps = trajectory.steps[:num_steps]
        out[b, :len(steps)] = [s.info[MC_VALUE] for s in steps]
    return out
