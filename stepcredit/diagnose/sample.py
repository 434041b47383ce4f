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
would be). With `vine_rollouts` K' > 0, VinePPO's input is recorded too:

    V_MC(s_t) = mean_k G_k(s_t, a_k),   a_k ~ pi at s_t, then pi to the end,

from K' rollouts on a random stream of their own, independent of the A^pi
rollouts above, so that VinePPO is not graded against its own samples.
Progress labels: a step is good when d(s_{t+1}) < d(s_t); the
last step of a terminated episode is good exactly when the episode was won
(a win is progress, a wrong final answer or purchase is not).

IGPO's belief is recorded where the simulator has a reference answer
(HotpotQA): the behaviour policy's probability of taking the answer action at
the start of each step, pi(finish[answer] | s_t), 0 where it is not on offer.
This is the diagnosis policies' analogue of a language model's teacher-forced
probability of the answer: they have explicit action probabilities.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np

from stepcredit.diagnose.episodes import Episode
from stepcredit.diagnose.policies import Policy, entropy
from stepcredit.envs.base import Observation
from stepcredit.train.tree import TreeShape, choose_nodes


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


def monte_carlo_value(env: Any, policy: Policy, observation: Observation, history: list,
                      deviation: int, actions: tuple[str, ...], probs: np.ndarray,
                      rollouts: int, rng: np.random.Generator) -> float:
    """V_MC(s_t): the mean return of `rollouts` episodes of `policy` from the state now (its
    first action drawn from `actions` with `probs`); the environment is left as it was."""
    snapshot, total = env.snapshot(), 0.0
    for _ in range(rollouts):
        total += _return_after(env, policy, observation, history, deviation,
                               _sample(actions, probs, rng), rng)
        env.restore(snapshot)
    return total / rollouts


def answer_probability(env: Any, actions: tuple[str, ...], probs: np.ndarray) -> float:
    """pi(the answer action | s): the probability `probs` gives `env`'s ground-truth
    answer action among `actions` (0 where it is not one of them)."""
    answer = env.answer_action.format(env.reference_answer())
    return float(probs[actions.index(answer)]) if answer in actions else 0.0


def play(env: Any, policy: Policy, task: int, rng: np.random.Generator, *, seed: int = 0,
         group: int = 0, continuations: int = 0, vine_rollouts: int = 0,
         branch: tuple[Episode, int] | None = None) -> Episode:
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
      vine_rollouts: K', the rollouts of each state's V_MC (`mc_value`, on a
        stream of its own); 0 leaves `mc_value` None.
      branch: `(parent, prefix)`: a branch of a rollout tree (Tree-GRPO) that
        keeps the parent's first `prefix` steps (their ground truth included)
        and plays on from the state after them, with the parent's deviation.

    Returns:
      The `Episode`.
    """
    # Rollouts draw from their own streams, so the episode itself is the same for any K, K'
    # (spawned children 0 and 1 are those of K alone).
    rng, rollout_rng, vine_rng = rng.spawn(3)
    observation = env.reset(task)
    deviation = policy.deviation(env, rng)
    history: list[tuple[str, str]] = []
    if branch is not None:
        observation, deviation, history = _replayed(env, observation, *branch)
    steps: list[tuple] = []
    answered = callable(getattr(env, "reference_answer", None))  # IGPO's belief is defined
    won, score, truncated = False, 0.0, False
    while env.running:
        step = env.steps_taken
        actions, probs = policy.distribution(env, observation, history, step, deviation)
        action = _sample(actions, probs, rng)
        before = env.oracle_distance()
        advantage = se = value = float("nan")
        if vine_rollouts:
            value = monte_carlo_value(env, policy, observation, history, deviation, actions,
                                      probs, vine_rollouts, vine_rng)
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
                      before, after, good, advantage, se, value,
                      answer_probability(env, actions, probs) if answered else 0.0))
        history.append((observation.text, action))
        observation = result.observation
    columns = list(zip(*steps))
    episode = Episode(
        env=env.name, seed=seed, task=task, group=group, task_text=observation.task,
        observations=tuple(columns[0]), actions=tuple(columns[1]), anchors=tuple(columns[2]),
        rewards=np.array(columns[3], dtype=np.float64), entropy=np.array(columns[4]),
        distance_before=np.array(columns[5], dtype=np.int64),
        distance_after=np.array(columns[6], dtype=np.int64), good=np.array(columns[7], dtype=bool),
        deviation=deviation, advantage=np.array(columns[8]), advantage_se=np.array(columns[9]),
        score=score, won=won, truncated=truncated,
        mc_value=np.array(columns[10]) if vine_rollouts else None,
        answer_prob=np.array(columns[11]) if answered else None)
    return episode if branch is None else _joined(*branch, episode)


def _replayed(env: Any, observation: Observation, parent: Episode,
              prefix: int) -> tuple[Observation, int, list]:
    """Replays the parent's first `prefix` actions from the reset state (`observation`; the
    simulators are deterministic given the task and the actions); returns the observation,
    the parent's deviation and the history there."""
    history = []
    for text, action in zip(parent.observations[:prefix], parent.actions[:prefix]):
        observation = env.step(action).observation
        history.append((text, action))
    return observation, parent.deviation, history


def _joined(parent: Episode, prefix: int, child: Episode) -> Episode:
    """The child's episode (its own steps) with the parent's first `prefix` steps in front."""
    joined = {}
    for field in dataclasses.fields(Episode):
        value = getattr(child, field.name)
        if isinstance(value, tuple) and len(value) == child.length:
            joined[field.name] = getattr(parent, field.name)[:prefix] + value
        elif isinstance(value, np.ndarray) and value.shape == (child.length,):
            joined[field.name] = np.concatenate([getattr(parent, field.name)[:prefix], value])
    return dataclasses.replace(child, **joined)


def sample_tasks(num_tasks: int, tasks: int, seed: int) -> list[int]:
    """`tasks` distinct task indices out of `num_tasks`, a fixed function of `seed`."""
    if tasks > num_tasks:
        raise ValueError(f"tasks: {tasks} asked but the split has only {num_tasks}")
    return np.random.default_rng([seed, 1]).choice(num_tasks, tasks, replace=False).tolist()


def sample_episodes(env: Any, policy: Policy, tasks: Sequence[int], *, group_size: int, seed: int,
                    continuations: int, stream: int = 0, progress=None,
                    vine_rollouts: int = 0) -> list[Episode]:
    """`group_size` episodes of each task (group i: the i-th task), one random
    stream per (seed, stream, task, member) so results do not depend on order.

    `progress`, when given, is called with the number of episodes finished.
    """
    episodes = []
    for group, task in enumerate(tasks):
        for member in range(group_size):
            rng = np.random.default_rng([seed, stream, task, member])
            episodes.append(play(env, policy, task, rng, seed=seed, group=group,
                                 continuations=continuations, vine_rollouts=vine_rollouts))
            if progress is not None:
                progress(1)
    return episodes


def sample_trees(env: Any, policy: Policy, tasks: Sequence[int], *, shape: TreeShape, seed: int,
                 continuations: int, stream: int = 2, progress=None) -> list[Episode]:
    """Each task's forest of `shape.trees` rollout trees (Tree-GRPO, `stepcredit.train.tree`):
    a root episode per tree, then `shape.rounds` rounds that each branch `shape.branches`
    episodes from nodes of the tree's episodes (`choose_nodes`), so a task has
    `shape.leaves_per_task` episodes with `tree` set to g * M + m (tree m of group g).

    A branch keeps its parent's steps up to the node, ground truth included (the same
    state and action), and plays on from the replayed state (`play`'s `branch`). One
    random stream per (seed, stream, task, tree) for the node choices and per
    (seed, stream, task, tree, leaf) for each episode; `progress` is called per episode.
    """
    episodes = []
    for group, task in enumerate(tasks):
        for m in range(shape.trees):
            rng = np.random.default_rng([seed, stream, task, m])
            root = np.random.default_rng([seed, stream, task, m, 0])
            leaves = [play(env, policy, task, root, seed=seed, group=group,
                           continuations=continuations)]
            starts = [0]
            for _ in range(shape.rounds):
                for node in choose_nodes([leaf.entropy for leaf in leaves], starts,
                                         shape.branches, shape.branching, rng):
                    branch = None if node is None else (leaves[node[0]], node[1])
                    leaf_rng = np.random.default_rng([seed, stream, task, m, len(leaves)])
                    leaves.append(play(env, policy, task, leaf_rng, seed=seed, group=group,
                                       continuations=continuations, branch=branch))
                    starts.append(0 if node is None else node[1])
            episodes += [dataclasses.replace(leaf, tree=group * shape.trees + m)
                         for leaf in leaves]
            if progress is not None:
                progress(len(leaves))
    return episodes
