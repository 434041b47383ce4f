"""MaxRL: the group-centred score divided by the group mean (maximum likelihood RL)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from stepcredit.advantages import _checks
from stepcredit.advantages import group as group_lib


def maxrl(scores, group_ids, *, eps: float = 0.0, divide_by_group_size: bool = False,
          num_groups: int | None = None, axis_name: str | None = None) -> jax.Array:
    """MaxRL's advantage: each score's deviation from its group mean, divided by that mean.

        A_i = (s_i - mean_g s) / (mean_g s + eps)     where mean_g s > 0
            = 0                                         where mean_g s <= 0

    With binary scores, mean_g s is the group's success rate p-hat, so a
    success gets (1 - p-hat) / p-hat and a failure -1: the score function is
    averaged over the successful rollouts only, an unbiased estimate of the
    gradient of the order-G truncation of log p (G the group size), which
    weights hard prompts by about 1 / p instead of GRPO's 1 / sqrt(p (1 - p)).
    It is Dr. GRPO (`grpo` with std="none") divided by the group mean, and
    its members sum to 0 within a group. A singleton group gives 0 (its
    centred score is 0), as does an all-equal group. divide_by_group_size
    divides every advantage by its group's size (the authors' code).

    Args:
      scores: `[B]` trajectory scores (binary success in the paper).
      group_ids: `[B]` int task group (arbitrary unless `num_groups` is given).
      eps: added to the mean in the division (the paper: 0; the authors' code:
        1e-6).
      divide_by_group_size: divide by the group's size as well (the code).
      num_groups: static number of groups, or None to remap ids.
      axis_name: mesh axis to combine group sums over inside `shard_map`.

    Returns:
      `[B]` advantages.

    Raises:
      ValueError / TypeError: wrong rank, shape or dtype; eps negative or not
        finite; called eagerly, NaN or inf in scores or an id outside
        [0, num_groups).

    References:
      Tajwar, Zeng et al., "Maximum Likelihood Reinforcement Learning"
      (MaxRL), arXiv 2602.02710 (the estimator with its control variate:
      (r - mean) / mean, 0 when the mean is 0).

    Notes:
      The authors' code (`compute_p_normalization_outcome_advantage` in
      `verl/trainer/ppo/core_algos.py`, adv_estimator=p_normalization in
      their scripts) divides by mean + 1e-6, gives 0 when the mean is exactly
      0 (a singleton's mean is set to 0 there, so it gives 0 too) and divides
      every advantage by the group size N: eps=1e-6, divide_by_group_size=True
      reproduce it. The paper's rule covers a mean of 0 (no success); a
      negative mean (scores with penalties, outside the paper's binary
      setting) would flip the sign of every advantage, so it gives 0 here too.

    Example: scores [1, 0, 0, 0, 1, 1, 0.5, 0.5, 3], group_ids
    [0, 0, 0, 0, 1, 1, 2, 2, 3]: group 0 has mean 0.25, so [3, -1, -1, -1];
    group 1 is all-equal and group 2 has mean 0.5 with equal members, so 0;
    the singleton gives 0. scores [0, 0] give [0, 0] (mean 0).
    """
    fn = "maxrl"
    _checks.finite_nonnegative(fn, eps=eps)
    scores, dense = group_lib._check_scores(fn, scores, group_ids, num_groups, axis_name)
    valid = jnp.ones(scores.shape, jnp.bool_)
    stats = group_lib._group_stats(scores, dense.ids, valid, dense.num_groups, axis_name)
    positive = stats.mean > 0
    denominator = jnp.where(positive, stats.mean + eps, 1.0)
    if divide_by_group_size:
        denominator = denominator * stats.count
    advantages = jnp.where(positive, (scores - stats.mean) / denominator, 0.0)
    same = group_lib._all_equal(scores, dense.ids, valid, dense.num_groups, axis_name)
    return jnp.where(same | (stats.count < 2), 0.0, advantages)
