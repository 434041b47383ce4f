"""Tree-structured rollouts (Tree-GRPO): branches played on from snapshotted states of earlier ones.

Per task, M trees. Each starts from one full rollout (its root chain); then L
rounds of expansion each pick N nodes (agent steps that are not the last of
their trajectory) among the tree's trajectories and play a new continuation
from each picked node to the episode's end. A branch from node t of a
trajectory shares that trajectory's steps 0..t (the same `StepRecord`s: token
ids, log-probs, entropies, values) and is played on from the simulator state
after step t, restored from the snapshot taken there, with the same prompt
history. A tree's leaves are its complete trajectories, so a tree has
1 + L N leaves and a task M (1 + L N).

Node choice ("branching"): "random", N distinct nodes uniformly among the
tree's expandable nodes (the paper's rule), or "entropy", the N whose next
step the policy sampled with the highest mean token entropy: ARPO's
entropy-guided branching (arXiv 2507.19849), simplified to a top-N choice
among the recorded steps instead of ARPO's branching probability from the
entropy's rise after a tool call. With fewer expandable nodes than N
(short trajectories), nodes are expanded more than once, and a tree with none
branches at its root: a fresh chain that shares no step.

Every round is one batched `collect` over all branches of all trees, so each
step is one policy forward for the whole batch. Keys: the root chains,
every round and the node choices draw from keys split off the iteration's
key, so a run resumed from a checkpoint plays the same trees.

Cost: a branch plays only its continuation, so a task costs fewer
environment steps (and generated actions) than M (1 + L N) independent
episodes of the same lengths; `tree/env_steps` counts the steps played and
`tree/env_step_saving` the fraction saved against the leaves' total length.

References:
  Ji et al., "Tree Search for LLM Agent Reinforcement Learning"
  (Tree-GRPO), arXiv 2509.21240 (initialisation with M chains, random
  expansion of N nodes for L rounds, nodes as whole agent steps; read from
  a summary of the method, not the paper's text); Dong et al., "Agentic
  Reinforced Policy Optimization" (ARPO), arXiv 2507.19849 (branching at
  high-entropy steps).

Notes:
  The paper's (M, N, L) per benchmark were not read here; a third-party
  reimplementation starts from (2, 2, 1). `TreeShape.for_group_size` instead
  derives a shape with `group_size` leaves per task, so that a tree run and a
  chain run of the same `--group-size` train on as many trajectories.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, NamedTuple, Sequence

import jax
import numpy as np

from stepcredit.batch import Trajectory
from stepcredit.envs.base import Env, Observation, SnapshotEnv, require_snapshots
from stepcredit.envs.pool import EnvPool
from stepcredit.rollout import Rollout, RolloutConfig, collect, history_action

BRANCHING = ("random", "entropy")
# What `require_snapshots` tells an environment without snapshots.
BRANCHES_NEED = "tree rollouts branch"


@dataclasses.dataclass(frozen=True)
class TreeShape:
    """The size of each task's forest.

    Attributes:
      trees: M, trees per task.
      branches: N, nodes expanded per tree and round.
      rounds: L, rounds of expansion.
      branching: "random" (Tree-GRPO) or "entropy" (ARPO's high-entropy steps).
    """

    trees: int
    branches: int
    rounds: int = 1
    branching: str = "random"

    def __post_init__(self):
        if self.trees < 1 or self.branches < 0 or self.rounds < 0:
            raise ValueError(f"TreeShape: trees={self.trees}, branches={self.branches} and "
                             f"rounds={self.rounds} must be >= 1, >= 0 and >= 0")
        if self.branching not in BRANCHING:
            raise ValueError(f"TreeShape: branching={self.branching!r}; expected one of "
                             f"{BRANCHING}")

    @property
    def leaves_per_tree(self) -> int:
        return 1 + self.rounds * self.branches

    @property
    def leaves_per_task(self) -> int:
        return self.trees * self.leaves_per_tree

    @classmethod
    def for_group_size(cls, group_size: int, *, trees: int = 0, branches: int = 0,
                       rounds: int = 1, branching: str = "random") -> TreeShape:
        """The shape whose leaves per task are `group_size` where that divides out.

        0 derives a size: M = max(1, G // 4) (two trees of four leaves at G = 8),
        then N = max(1, (G // M - 1) // L), so M (1 + L N) = G whenever M
        divides G and L divides G / M - 1 (G = 2: one tree, one branch).
        """
        trees = trees or max(1, group_size // 4)
        branches = branches or max(1, (group_size // trees - 1) // max(rounds, 1))
        return cls(trees, branches, rounds, branching)


class Leaf(NamedTuple):
    """A complete trajectory of a tree, with what a branch from it needs.

    Attributes:
      trajectory: its steps (shared with its parent up to `start`).
      states: per step t, the snapshot and observation before step t, plus
        the state after its last step (unused: nothing follows it).
      actions: the action text each step sent (for the prompt history).
      start: the steps it shares with its parent (0 for a root chain).
    """

    trajectory: Trajectory
    states: list[tuple[Any, Observation]]
    actions: list[str]
    start: int


class Start(NamedTuple):
    """Where a branch begins: the state before its first own step, and its parent's prefix."""

    snapshot: Any
    observation: Observation
    parent: Leaf
    prefix: int


class Recording:
    """An environment that snapshots the state before every step, and that resets
    into a given snapshot (a branch's start) when one is set."""

    def __init__(self, env: SnapshotEnv, start: Start | None = None):
        self.env, self.start = env, start
        self.name, self.max_steps = env.name, env.max_steps
        self.states: list[tuple[Any, Observation]] = []
        self.actions: list[str] = []

    def reset(self, task: Any) -> Observation:
        if self.start is None:
            observation = self.env.reset(task)
            self.states = [(self.env.snapshot(), observation)]
        else:  # snapshots are immutable: the start's own serves as the branch's first state
            self.env.restore(self.start.snapshot)
            observation = self.start.observation
            self.states = [(self.start.snapshot, observation)]
        return observation

    def step(self, action: str):
        result = self.env.step(action)
        self.actions.append(action)
        self.states.append((self.env.snapshot(), result.observation))
        return result

    def close(self) -> None:
        self.env.close()

    def __getattr__(self, name: str) -> Any:  # the rest (reference_answer, answer_action, ...)
        if name == "env":
            raise AttributeError(name)
        return getattr(self.env, name)


def expandable(starts: Sequence[int], lengths: Sequence[int]) -> list[tuple[int, int]]:
    """A tree's nodes that can be expanded, as (leaf, prefix): the branch keeps leaf's
    steps 0..prefix-1 and plays on from step `prefix`. Leaf k has `lengths[k]` steps,
    the first `starts[k]` shared with its parent; each node is counted once (a shared
    prefix belongs to the ancestors) and a leaf's last step is never expanded (its
    episode ended there)."""
    return [(k, prefix) for k, (start, length) in enumerate(zip(starts, lengths))
            for prefix in range(start + 1, length)]


def choose_nodes(entropies: Sequence[Sequence[float]], starts: Sequence[int], count: int,
                 branching: str, rng: np.random.Generator) -> list[tuple[int, int] | None]:
    """`count` nodes (leaf, prefix) of a tree to expand, None for a branch at the root.

    Args:
      entropies: per leaf, the mean token entropy of each of its steps.
      starts: per leaf, the steps it shares with its parent (0: a root chain).
      count: N.
      branching: "random", distinct nodes uniformly; "entropy", the nodes whose
        next step (the one a branch samples again) has the highest entropy
        (ties broken at random). With fewer nodes than `count`, every node is
        taken before any is taken again.
      rng: the draws.
    """
    nodes = expandable(starts, [len(e) for e in entropies])
    if not nodes:
        return [None] * count
    if branching == "entropy":
        entropy = np.array([entropies[k][prefix] for k, prefix in nodes], np.float64)
        order = np.lexsort((rng.random(len(nodes)), -entropy))
        picks = [order[i % len(nodes)] for i in range(count)]
    else:
        rounds = -(-count // len(nodes))
        picks = np.concatenate([rng.permutation(len(nodes)) for _ in range(rounds)])[:count]
    return [nodes[i] for i in picks]


def step_entropies(trajectory: Trajectory) -> list[float]:
    """The mean token entropy of each step's action (0 where not recorded)."""
    return [float(np.mean(s.action_entropy)) if s.action_entropy else 0.0
            for s in trajectory.steps]


def branch_start(leaf: Leaf, prefix: int) -> Start:
    snapshot, observation = leaf.states[prefix]
    return Start(snapshot, observation, leaf, prefix)


def prompt_history(config: RolloutConfig, start: Start) -> list[tuple[str, Any]]:
    """The (observation, action) pairs of the parent's first `prefix` steps, as
    `collect` recorded them for its prompts."""
    leaf = start.parent
    return [(leaf.states[t][1].text,
             history_action(config, leaf.actions[t], leaf.trajectory.steps[t].action_ids))
            for t in range(start.prefix)]


def _play(graphdef, state, make_env: Callable[[], Env], tasks: Sequence[int],
          starts: Sequence[Start | None], tokenizer, key: jax.Array,
          config: RolloutConfig, share_prompts: bool) -> tuple[Rollout, list[Leaf]]:
    """One batched `collect` of episodes on `tasks[i]`, from `starts[i]` where given."""
    envs = []
    try:
        for start in starts:
            env = make_env()
            require_snapshots(env, BRANCHES_NEED)
            envs.append(Recording(env, start))
    except BaseException:
        for env in envs:
            env.close()
        raise
    history = [[] if start is None else prompt_history(config, start) for start in starts]
    with EnvPool(envs) as pool:
        rollout = collect(graphdef, state, pool, list(tasks), 1, tokenizer, key, config,
                          history=history, share_prompts=share_prompts)
    return rollout, [joined_leaf(env, start, played)
                     for env, start, played in zip(envs, starts, rollout.trajectories)]


def joined_leaf(env: Recording, start: Start | None, played: Trajectory) -> Leaf:
    """The leaf an episode played in `env` makes: a root chain (`start` None), or its parent's
    steps, states and actions before the node followed by the branch's own, scored in full."""
    if start is None:
        return Leaf(played, env.states, env.actions, 0)
    parent, prefix = start.parent, start.prefix
    steps = list(parent.trajectory.steps[:prefix]) + list(played.steps)
    trajectory = dataclasses.replace(played, steps=steps, score=float(sum(s.reward for s in steps)))
    return Leaf(trajectory, parent.states[:prefix] + env.states, parent.actions[:prefix] + env.actions,
                prefix)


def collect_trees(graphdef, state, make_env: Callable[[], Env], tasks: Sequence[int],
                  shape: TreeShape, tokenizer, key: jax.Array,
                  config: RolloutConfig, share_prompts: bool = True) -> Rollout:
    """Plays each task's forest of M trees (module docstring), every round batched.

    Args:
      graphdef, state: the policy, from `nnx.split(model)`.
      make_env: makes one environment with snapshots (the run's, at its step limit).
      tasks: one task per group.
      shape: the forest's `TreeShape`.
      tokenizer, config, share_prompts: as for `collect`.
      key: PRNG key; the root chains, each round's sampling and the node
        choices use keys split from it.

    Returns:
      A `Rollout` of `len(tasks) * shape.leaves_per_task` leaves: task g's
      leaves have group id g and tree ids g * M + m (tree m), in tree order,
      each tree's root chain first and then its branches as they were played.
      Metrics: the collections' (their
      episode-weighted means; times summed), the leaves' steps per episode,
      return and truncation rate, and `tree/leaves` (per task),
      `tree/env_steps` (played), `tree/chain_env_steps` (the leaves' total
      length: what independent episodes of those lengths would play),
      `tree/env_step_saving` and `time/tree`.
    """
    tick = time.perf_counter()
    m = shape.trees
    keys = jax.random.split(key, shape.rounds + 2)
    rng = np.random.default_rng(np.asarray(jax.random.key_data(keys[-1])).ravel().tolist())
    root_tasks = [task for task in tasks for _ in range(m)]
    rollout, leaves = _play(graphdef, state, make_env, root_tasks, [None] * len(root_tasks),
                            tokenizer, keys[0], config, share_prompts)
    forest = [[leaf] for leaf in leaves]  # tree g * M + m
    rounds, played = [rollout], sum(len(t.steps) for t in rollout.trajectories)
    for r in range(shape.rounds):
        if not shape.branches:
            break
        starts, owners = [], []
        for tree, tree_leaves in enumerate(forest):
            nodes = choose_nodes([step_entropies(leaf.trajectory) for leaf in tree_leaves],
                                 [leaf.start for leaf in tree_leaves], shape.branches,
                                 shape.branching, rng)
            for node in nodes:
                starts.append(None if node is None else branch_start(tree_leaves[node[0]],
                                                                     node[1]))
                owners.append(tree)
        rollout, leaves = _play(graphdef, state, make_env, [root_tasks[t] for t in owners],
                                starts, tokenizer, keys[r + 1], config, share_prompts)
        for tree, leaf in zip(owners, leaves):
            forest[tree].append(leaf)
        rounds.append(rollout)
        played += sum(len(t.steps) for t in rollout.trajectories)
    trajectories = [dataclasses.replace(leaf.trajectory, group_id=tree // m, tree_id=tree)
                    for tree, tree_leaves in enumerate(forest) for leaf in tree_leaves]
    chain = sum(len(t.steps) for t in trajectories)
    metrics = {**_merged(rounds),
               "rollout/steps_per_episode": chain / len(trajectories),
               "rollout/return": float(np.mean([t.score for t in trajectories])),
               "rollout/truncated": float(np.mean([t.steps[-1].truncated for t in trajectories])),
               "tree/leaves": len(trajectories) / len(tasks), "tree/env_steps": float(played),
               "tree/chain_env_steps": float(chain),
               "tree/env_step_saving": 1.0 - played / chain,
               "time/tree": time.perf_counter() - tick}
    return Rollout(trajectories, metrics)


def _merged(rollouts: Sequence[Rollout]) -> dict[str, float]:
    """The collections' metrics: times summed, the rest weighted by episodes played
    (a key missing from a collection, such as an action type it never took, counts 0)."""
    weights = np.array([len(r.trajectories) for r in rollouts], np.float64)
    keys = sorted({k for r in rollouts for k in r.metrics})
    return {k: float(sum(r.metrics.get(k, 0.0) for r in rollouts)) if k.startswith("time/")
            else float(np.dot(weights, [r.metrics.get(k, 0.0) for r in rollouts]) / weights.sum())
            for k in keys}
