"""Tree-structured rollouts (Tree-GRPO, arXiv 2509.21240) for a chat-model policy.

The forest of `stepcredit.train.tree` (its module docstring has the method):
per task, M trees, each a root episode and then L rounds in which N nodes
(agent steps that are not their episode's last) are picked at random among the
tree's episodes and played on to the episode's end, from the simulator state
before the node's step (its snapshot) with the chat history the model saw
there. A branch shares its parent's step records up to the node; every round is
one `rollout.play` call over all branches of all trees. The leaves of task g
carry group id g and tree ids g * M + m, each tree's root first.

Node choice is "random" (the paper's rule): the chat sampler records no
entropies, so ARPO's entropy-guided branching is refused.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Sequence

import numpy as np

from stepcredit.batch import Trajectory
from stepcredit.envs.base import Env, require_snapshots
from stepcredit.llm import rollout
from stepcredit.llm.checkpoint import Checkpoint
from stepcredit.train.tree import (BRANCHES_NEED, Leaf, Recording, Start, TreeShape, branch_start,
                                   choose_nodes, joined_leaf)


def _history(start: Start) -> list[tuple[str, str]]:
    """The (observation, action) pairs of the parent's steps before the node."""
    leaf = start.parent
    return [(leaf.states[t][1].text, leaf.actions[t]) for t in range(start.prefix)]


def _play(qwen: Checkpoint, make_env: Callable[[], Env], tasks: Sequence[Any],
          starts: Sequence[Start | None], *, seed: int, settings: dict[str, Any]) -> list[Leaf]:
    """One `rollout.play` of episodes on `tasks[i]`, from `starts[i]` where given."""
    envs = []
    try:
        for start in starts:
            env = make_env()
            envs.append(Recording(env, start))
            require_snapshots(env, BRANCHES_NEED)
        observations = [env.reset(task) for env, task in zip(envs, tasks)]
        histories = [[] if start is None else _history(start) for start in starts]
        played = rollout.play(qwen, envs, observations, histories, group_ids=[0] * len(envs), seed=seed,
                              **settings)
    finally:
        for env in envs:
            env.close()
    return [joined_leaf(env, start, trajectory) for env, start, trajectory in zip(envs, starts, played)]


def collect_trees(qwen: Checkpoint, make_env: Callable[[], Env], tasks: Sequence[Any], shape: TreeShape,
                  *, seed: int, max_new_tokens: int, temperature: float, window: int,
                  invalid_action_penalty: float) -> tuple[list[Trajectory], dict[str, float]]:
    """Plays each task's forest of `shape.trees` trees (module docstring).

    Args:
      qwen: the policy.
      make_env: a simulator with snapshots, at the run's step limit.
      tasks: one task per group.
      shape: M, N, L (`shape.branching` must be "random").
      seed: round r samples with seed + r; the node choices draw from `seed`.
      max_new_tokens, temperature, window, invalid_action_penalty: `rollout.play`'s.

    Returns:
      `len(tasks) * shape.leaves_per_task` leaves, and the metrics
      `tree/leaves` (per task), `tree/env_steps` (played), `tree/chain_env_steps`
      (the leaves' total length), `tree/env_step_saving` and `time/tree`.
    """
    if shape.branching != "random":
        raise ValueError(f"collect_trees: branching={shape.branching!r}; the chat sampler records no "
                         "entropies, so only 'random' branching is available")
    tick = time.perf_counter()
    settings = dict(max_new_tokens=max_new_tokens, temperature=temperature, window=window,
                    invalid_action_penalty=invalid_action_penalty)
    rng = np.random.default_rng([seed, 0x54524545])  # "TREE": node choices apart from sampling
    m = shape.trees
    root_tasks = [task for task in tasks for _ in range(m)]
    forest = [[leaf] for leaf in _play(qwen, make_env, root_tasks, [None] * len(root_tasks), seed=seed,
                                       settings=settings)]  # tree g * M + m
    played = sum(len(tree[0].trajectory.steps) for tree in forest)
    for r in range(shape.rounds if shape.branches else 0):
        starts, owners = [], []
        for tree, leaves in enumerate(forest):
            entropies = [[0.0] * len(leaf.trajectory.steps) for leaf in leaves]  # only lengths count
            for node in choose_nodes(entropies, [leaf.start for leaf in leaves], shape.branches,
                                     "random", rng):
                starts.append(None if node is None else branch_start(leaves[node[0]], node[1]))
                owners.append(tree)
        branches = _play(qwen, make_env, [root_tasks[t] for t in owners], starts, seed=seed + r + 1,
                         settings=settings)
        for tree, leaf in zip(owners, branches):
            forest[tree].append(leaf)
        played += sum(len(leaf.trajectory.steps) - leaf.start for leaf in branches)
    trajectories = [dataclasses.replace(leaf.trajectory, group_id=tree // m, tree_id=tree)
                    for tree, leaves in enumerate(forest) for leaf in leaves]
    chain = sum(len(t.steps) for t in trajectories)
    return trajectories, {"tree/leaves": len(trajectories) / len(tasks), "tree/env_steps": float(played),
                          "tree/chain_env_steps": float(chain), "tree/env_step_saving": 1.0 - played / chain,
                          "time/tree": time.perf_counter() - tick}


__all__: Sequence[str] = ("collect_trees",)
