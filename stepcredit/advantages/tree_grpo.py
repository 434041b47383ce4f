"""Tree-GRPO: GRPO's normalisation within each tree of prefix-sharing rollouts, plus over the task."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from stepcredit.advantages import _checks
from stepcredit.advantages import group as group_lib


def tree_grpo(scores, group_ids, tree_ids=None, *, std: str = "unbiased", eps: float = 1e-6,
              singleton: str = "zero", num_groups: int | None = None,
              num_trees: int | None = None, axis_name: str | None = None) -> jax.Array:
    """Tree-GRPO's advantage of each leaf (root-to-leaf trajectory) of a forest of rollout trees.

        A_i = A_intra(i) + A_inter(i)
        A_intra(i) = (s_i - mean_{j in tree(i)} s_j) / (std_{j in tree(i)} s_j + eps)
        A_inter(i) = (s_i - mean_{j in task(i)} s_j) / (std_{j in task(i)} s_j + eps)

    Each trajectory is one leaf of a tree: the tree's rollouts share the
    prefix up to the step they branched from. A leaf is compared with the
    leaves of its own tree (intra-tree: the leaves differ only after their
    branch points, so the comparison is a step-level preference signal) and
    with every leaf of the task's M trees (inter-tree: GRPO's group). Both are
    `grpo`'s normalisation with the same std, eps and small-group rules, so:

      - one leaf per tree (chain rollouts; `tree_ids` None): A_intra = 0 and
        the advantage is GRPO's;
      - one tree per task: A_intra = A_inter and the advantage is twice GRPO's.

    A step shared by k leaves appears once in each of their trajectories and
    is trained once per leaf, each copy with its own leaf's advantage: its
    gradient is the sum of the k leaves' advantages (the paper's objective
    over root-to-leaf trajectories, in which the intra-tree terms of two
    branches cancel on their common prefix and differ after the branch).

    Args:
      scores: `[B]` score of each leaf (the sum of its trajectory's rewards).
      group_ids: `[B]` int task of each trajectory (arbitrary unless
        `num_groups` is given).
      tree_ids: `[B]` int tree of each trajectory, a tree lying within one
        task (arbitrary ids unless `num_trees` is given); None makes every
        trajectory a tree of its own.
      std: "unbiased", "biased" or "none" (both normalisations).
      eps: added to both stds (ignored under std="none").
      singleton: "zero" or "raw" (`grpo`'s rule for a one-member group, in
        both normalisations).
      num_groups, num_trees: static numbers of tasks and trees, or None to
        remap the ids.
      axis_name: mesh axis to combine group sums over inside `shard_map`.

    Returns:
      `[B]` advantages, broadcast by the caller to every step of the leaf.

    Raises:
      ValueError / TypeError: wrong rank, shape or dtype; unknown std or
        singleton; called eagerly, a NaN score, an id out of range, or a tree
        whose leaves belong to different tasks.

    References:
      Ji et al., "Tree Search for LLM Agent Reinforcement Learning"
      (Tree-GRPO), arXiv 2509.21240: group-relative advantages at the
      intra-tree and inter-tree levels (its abstract); the rollout trees are
      `stepcredit.train.tree`'s.

    Notes:
      Neither the paper's equations nor the authors' code (AMAP-ML/Tree-GRPO)
      could be read here. The sum A_intra + A_inter is this library's reading
      of the abstract and secondary summaries (a third-party reimplementation
      documents the same sum); which std the paper uses and how a one-leaf
      tree is treated are unchecked. The defaults are GRPO's as verl computes
      it (unbiased std, eps 1e-6), with a singleton giving 0 so that chain
      rollouts reduce to GRPO (singleton="raw" is verl's mean 0, std 1 rule).

    Example: scores [1, 0, 0, 1, 1, 1], group_ids [0, 0, 0, 0, 0, 0],
    tree_ids [0, 0, 0, 1, 1, 1]: tree 0 has mean 1/3 and std 0.5774, so
    A_intra = [1.1547, -0.5774, -0.5774, 0, 0, 0] (tree 1 is all equal); the
    task has mean 2/3 and std 0.5164, so A_inter = [0.6455, -1.2910, -1.2910,
    0.6455, 0.6455, 0.6455]; A = [1.8002, -1.8684, -1.8684, 0.6455, 0.6455,
    0.6455].
    """
    fn = "tree_grpo"
    group_lib._check_option(fn, "std", std, group_lib.STDS)
    group_lib._check_option(fn, "singleton", singleton, group_lib.SINGLETONS)
    _checks.finite_nonnegative(fn, eps=eps)
    scores, groups = group_lib._check_scores(fn, scores, group_ids, num_groups, axis_name)
    valid = jnp.ones(scores.shape, jnp.bool_)
    inter = group_lib._normalize(scores, groups.ids, valid, groups.num_groups, std=std, eps=eps,
                                 singleton=singleton, axis_name=axis_name)
    if tree_ids is None:
        return inter
    trees = _tree_ids(fn, tree_ids, scores.shape[0], num_trees, axis_name)
    _check_trees_within_tasks(fn, group_ids, tree_ids)
    intra = group_lib._normalize(scores, trees.ids, valid, trees.num_groups, std=std, eps=eps,
                                 singleton=singleton, axis_name=axis_name)
    return intra + inter


def _tree_ids(fn: str, tree_ids, batch: int, num_trees: int | None,
              axis_name: str | None) -> group_lib.DenseGroupIds:
    """Validates `[B]` tree ids (named as such in errors); returns their dense ids."""
    tree_ids = _checks.int_array(fn, "tree_ids", tree_ids, rank=1)
    _checks.leading_dim(fn, batch, tree_ids=tree_ids)
    if num_trees is not None:
        group_lib._check_num_groups(fn, num_trees)
        if _checks.is_concrete(tree_ids) and tree_ids.size and not (
                0 <= int(tree_ids.min()) and int(tree_ids.max()) < num_trees):
            raise ValueError(f"{fn}: tree_ids holds ids outside [0, num_trees={num_trees})")
    return group_lib._dense_ids(fn, tree_ids, num_trees, axis_name)


def _check_trees_within_tasks(fn: str, group_ids, tree_ids) -> None:
    """Raises when concrete ids put one tree's leaves in two tasks; skipped on tracers."""
    if not _checks.is_concrete(group_ids, tree_ids):
        return
    groups, trees = np.asarray(group_ids), np.asarray(tree_ids)
    for tree in np.unique(trees):
        tasks = np.unique(groups[trees == tree])
        if tasks.size > 1:
            raise ValueError(f"{fn}: tree {int(tree)} has leaves in the tasks "
                             f"{tasks[:3].tolist()} of group_ids; a tree lies within one task")
