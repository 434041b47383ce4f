"""Rollout collection for training: which tasks an iteration plays, and DAPO's dynamic sampling."""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import jax
import numpy as np

from stepcredit.batch import Trajectory
from stepcredit.envs.pool import EnvPool
from stepcredit.rollout import Rollout, collect
from stepcredit.train import information_gain, vine
from stepcredit.train.build import Parts, check_snapshots, make_env
from stepcredit.train.tree import BRANCHES_NEED, TreeShape, collect_trees

# Dynamic sampling plays at most this many extra rounds of tasks to fill a batch.
MAX_REFILL_ROUNDS = 3


def iteration_tasks(config, iteration: int, num_train_tasks: int, *, round_: int = 0,
                    process_index: int | None = None) -> list[int]:
    """The training tasks of an iteration: `config.tasks_per_iteration` distinct task ids, a
    fixed function of (seed, iteration, round, process)."""
    seed = [config.seed, iteration, round_]
    if process_index is not None:
        seed.append(process_index)
    return np.random.default_rng(seed).choice(
        num_train_tasks, config.tasks_per_iteration, replace=False).tolist()


class Collector:
    """Plays an iteration's tasks, G episodes each, with a given policy.

    Args:
      parts: the run's parts (`stepcredit.train.build.build`).
      process_index: this process's index when several processes train one
        policy (each plays its own tasks), else None.
    """

    def __init__(self, parts: Parts, *, process_index: int | None = None):
        self.parts = parts
        self.config = parts.config
        self.process_index = process_index
        self.trees = None  # Tree-GRPO's recipe: each task's rollouts are a forest
        if parts.estimator.recipe.rollout_trees:
            c = self.config
            self.trees = TreeShape(c.tree_count, c.tree_branches, c.tree_rounds, c.tree_branching)
            check_snapshots(c, BRANCHES_NEED)
        if parts.estimator.needs_mc_values:
            check_snapshots(self.config, vine.VALUES_NEED)

    def tasks(self, iteration: int, round_: int = 0) -> list[int]:
        return iteration_tasks(self.config, iteration, self.parts.num_train_tasks, round_=round_,
                               process_index=self.process_index)

    def rollout(self, policy, tasks: list[int], key: jax.Array, limit: int) -> Rollout:
        """Plays each task `group_size` times at the step limit `limit` (with, for
        estimators that read them, each step's Monte Carlo value: `vine.with_mc_values`), or,
        under the estimator's tree recipe, as a forest of trees (`tree.collect_trees`)."""
        config = self.config
        if self.trees is not None:
            return collect_trees(self.parts.graphdef, policy,
                                 lambda: make_env(config, "train", limit), tasks, self.trees,
                                 self.parts.tokenizer, key, config.rollout,
                                 share_prompts=config.share_contexts)
        envs = [make_env(config, "train", limit) for _ in range(len(tasks) * config.group_size)]
        with EnvPool(envs) as pool:
            rollout = collect(self.parts.graphdef, policy, pool, tasks, config.group_size,
                              self.parts.tokenizer, key, config.rollout,
                              share_prompts=config.share_contexts)
            if self.parts.estimator.needs_information_gain:  # IGPO: each task's answer
                rollout = information_gain.with_answers(rollout, pool.envs)
        if self.parts.estimator.needs_mc_values:
            rollout = vine.with_mc_values(self.parts, policy, rollout, tasks, key, limit)
        return rollout

    def batch(self, policy, iteration: int, key: jax.Array, limit: int) -> tuple[Rollout, dict]:
        """One iteration's batch; with dynamic sampling, groups whose scores are all
        equal are replaced by groups of fresh tasks (`informative_groups`)."""
        rollout = self.rollout(policy, self.tasks(iteration), key, limit)
        if not self.config.dynamic_sampling:
            return rollout, {}
        keys = [key]

        def play_round(round_: int) -> list[Trajectory]:
            keys[0], sub = jax.random.split(keys[0])
            return self.rollout(policy, self.tasks(iteration, round_), sub, limit).trajectories

        trajectories, metrics = informative_groups(rollout.trajectories, play_round,
                                                   group_size=self.config.group_size,
                                                   wanted=self.config.tasks_per_iteration)
        return Rollout(trajectories, rollout.metrics), metrics


def informative_groups(first: Sequence[Trajectory], play_round: Callable[[int], Sequence[Trajectory]], *,
                       group_size: int, wanted: int) -> tuple[list[Trajectory], dict[str, float]]:
    """DAPO's dynamic sampling (arXiv 2503.14476): the first `wanted` groups whose scores are
    not all equal, from `first` and then from `play_round(1)`, `play_round(2)`, ... (at most
    `MAX_REFILL_ROUNDS` more rounds), renumbered 0..; every group of `first` when none differs
    (learn nothing rather than something wrong).

    Args:
      first: the iteration's trajectories, consecutive groups of `group_size`.
      play_round: plays round r's fresh tasks, in the same layout.

    Returns:
      The trajectories and `dapo/groups_dropped`, `dapo/sampling_rounds`.
    """
    kept, dropped, round_ = [], 0, 0
    candidates = first
    while True:
        for start in range(0, len(candidates), group_size):
            group = candidates[start:start + group_size]
            if len({t.score for t in group}) == 1:
                dropped += 1
            elif len(kept) < wanted:
                kept.append(group)
        round_ += 1
        if len(kept) >= wanted or round_ > MAX_REFILL_ROUNDS:
            break
        candidates = play_round(round_)
    if not kept:
        kept = [first[i:i + group_size] for i in range(0, len(first), group_size)]
    trajectories = [dataclasses.replace(t, group_id=k) for k, group in enumerate(kept) for t in group]
    return trajectories, {"dapo/groups_dropped": float(dropped), "dapo/sampling_rounds": float(round_)}
