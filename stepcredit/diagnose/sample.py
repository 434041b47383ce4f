"""Playing behaviour policies on a simulator, with ground truth at every step.

`play` runs one episode and records, before each step, the oracle distance
d(s_t) and, when `continuations` K > 0, a Monte Carlo estimate of the
behaviour policy's advantage from snapshots of the simulator:

    Q^(s_t, a_t) = mean_k G_k(s_t, a_t),   G_k: return of rollout k that takes
                   a_t and then follows pi to the episode's end,
    V^(s_t)      = mean_k G_k(s_t, a'_k),   a'_k ~ the policy's baseline at s_t
                   (pi itself; the expert at a single-deviation policy's mistake),
    A^pi(s_t, a_t) ~ Q^ - V^,   se = std_k(G_k(s_t, a_t) - G_k(s_t, a'_k)) / sqrt(K),

with undiscounted returns (gamma = 1) and the episode's own step limit (the
snapshot keeps the step counter, so a rollout is truncated where the episode
would be). Progress labels: a step is good when d(s_{t+1}) < d(s_t); the
last step of a terminated episode is good exactly when the episode was won
(a win is progress, a wrong final answer or purchase is not).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from stepcredit.diagnose.episodes import Episode
from stepcredit.diagnose.policies import Policy, entropy
from stepcredit.envs.base import Observation


def _sample(actions: tuple[str, ...], probs: np.ndarray, rng: np.random.Generator) -> str:
    if len(actions) == 1:
        return actions[0]
    index = int(np.searchsorted(np.cumsum(probs), rng.random() * probs.sum(), side="right"))
    return actions[min(index, len(actions) - 1)]


def _return_after(env: Any, policy: Policy, observation: Observation, history: list,
                  deviation: int, action: str, rng: np.random.Generator) -> float:
    """Takes `action`, then follows `policy` to the end; the sum of rewards."""
    total, history = 0.0, list(history)
    while True:
        result = env.step(action)
        total += result.reward
        if not env.running:
            return total
        history.append((observation.text, action))
        observation = result.observation
        actions, probs = policy.distribution(env, observation, history, env.steps_taken, deviation)
        action = _sample(actions, probs, rng)


def monte_carlo_advantage(env: Any, policy: Policy, observation: Observation, history: list,
                          deviation: int, action: str, continuations: int,
                          rng: np.random.Generator) -> tuple[float, float]:
    """A^pi(s_t, a_t) ~ Q^ - V^ from `continuations` rollouts each (module doc).

    Rollout k of Q and rollout k of V share their random numbers after the
    first action (common random numbers): where V's first action is a_t the
    two returns are equal, so the paired differences d_k = G_k^Q - G_k^V have
    far less variance than independent rollouts, and each is still unbiased.
    The environment must support snapshots; it is left in the state it was in.

    Returns:
      `(advantage, standard_error)`: the mean of the d_k and its standard
      error std(d) / sqrt(K) (NaN for K = 1).
    """
    snapshot, step = env.snapshot(), env.steps_taken
    streams = rng.integers(2**63, size=continuations)
    differences = np.empty(continuations)
    actions, probs = policy.baseline(env, observation, history, step, deviation)
    for k in range(continuations):
        q = _return_after(env, policy, observation, history, deviation, action,
                          np.random.default_rng(streams[k]))
        env.restore(snapshot)
        v = _return_after(env, policy, observation, history, deviation,
                          _sample(actions, probs, rng), np.random.default_rng(streams[k]))
        env.restore(snapshot)
        differences[k] = q - v
    if continuations < 2:
        return float(differences.mean()), float("nan")
    return float(differences.mean()), float(differences.std(ddof=1) / np.sqrt(continuations))


def play(env: Any, policy: Policy, task: int, rng: np.random.Generator, *, seed: int = 0,
         group: int = 0, continuations: int = 0) -> Episode:
    """Plays one episode of `policy` on task `task` with its ground truth.

    Args:
      env: a simulator with `oracle_distance`, `oracle_actions` and, when
        `continuations` > 0, `snapshot`/`restore`.
      policy: the behaviour policy.
      task: the task index.
      rng: the episode's random generator (actions and deviation; the rollouts
        use a stream spawned from it, so the episode does not depend on K).
      seed, group: recorded in the episode.
      continuations: K, the Monte Carlo rollouts per action and per state;
        0 leaves `advantage` NaN.

    Returns:
      The `Episode`.
    """
    # Rollouts draw from their own stream, so the episode itself is the same for any K.
    rng, rollout_rng = rng.spawn(2)
    observation = env.reset(task)
    deviation = policy.deviation(env, rng)
    history: list[tuple[str, str]] = []
    steps: list[tuple] = []
    won, score, truncated = False, 0.0, False
    while env.running:
        step = env.steps_taken
        actions, probs = policy.distribution(env, observation, history, step, deviation)
        action = _sample(actions, probs, rng)
        before = env.oracle_distance()
        advantage = se = float("nan")
        if continuations:
            advantage, se = monte_carlo_advantage(env, policy, observation, history, deviation,
                                                  action, continuations, rollout_rng)
        result = env.step(action)
        if result.done:
            won, score = bool(result.info.get("won")), float(result.info.get("score", 0.0))
            after, good = (0 if won else before), won
        else:
            after = env.oracle_distance()
            good = after < before
            if result.truncated:
                truncated, score = True, float(result.info.get("score", 0.0))
        steps.append((observation.text, action, observation.anchor, result.reward, entropy(probs),
                      before, after, good, advantage, se))
        history.append((observation.text, action))
        observation = result.observation
    columns = list(zip(*steps))
    return Episode(
        env=env.name, seed=seed, task=task, group=group, task_text=observation.task,
        observations=tuple(columns[0]), actions=tuple(columns[1]), anchors=tuple(columns[2]),
        rewards=np.array(columns[3], dtype=np.float64), entropy=np.array(columns[4]),
        distance_before=np.array(columns[5], dtype=np.int64),
        distance_after=np.array(columns[6], dtype=np.int64), good=np.array(columns[7], dtype=bool),
        deviation=deviation, advantage=np.array(columns[8]), advantage_se=np.array(columns[9]),
        score=score, won=won, truncated=truncated)


def sample_tasks(num_tasks: int, tasks: int, seed: int) -> list[int]:
    """`tasks` distinct task indices out of `num_tasks`, a fixed function of `seed`."""
    if tasks > num_tasks:
        raise ValueError(f"tasks: {tasks} asked but the split has only {num_tasks}")
    return np.random.default_rng([seed, 1]).choice(num_tasks, tasks, replace=False).tolist()


def sample_episodes(env: Any, policy: Policy, tasks: Sequence[int], *, group_size: int, seed: int,
                    continuations: int, stream: int = 0, progress=None) -> list[Episode]:
    """`group_size` episodes of each task (group i: the i-th task), one random
    stream per (seed, stream, task, member) so results do not depend on order.

    `progress`, when given, is called with the number of episodes finished.
    """
    episodes = []
    for group, task in enumerate(tasks):
        for member in range(group_size):
            rng = np.random.default_rng([seed, stream, task, member])
            episodes.append(play(env, policy, task, rng, seed=seed, group=group,
                                 continuations=continuations))
            if progress is not None:
                progress(1)
    return episodes
