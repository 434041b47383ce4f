"""DAPO's batch-side pieces: the soft overlong penalty and the dynamic-sampling filter.

DAPO's other two ingredients live in `ppo_clip_loss`: clip-higher
(clip_low 0.2, clip_high 0.28) and token-mean aggregation. Dynamic sampling
is a trainer loop (drop the trajectories of groups whose scores are all
equal, sample more groups until the batch is full); `dynamic_sampling_mask`
is its pure, jit-able test.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

from stepcredit.advantages import _checks
from stepcredit.advantages.group import dense_group_ids


def overlong_penalty(response_lengths, *, max_length: int, cache_length: int,
                     penalty_factor: float = 1.0, floor_at_max: bool = True) -> jax.Array:
    """DAPO's soft overlong punishment, a length-aware reward added to the score.

    With L_max = max_length and L_cache = cache_length:

        R_length(|y|) = 0                                 |y| <= L_max - L_cache
                      = ((L_max - L_cache) - |y|) / L_cache  L_max - L_cache < |y| <= L_max
                      = -1                                L_max < |y|

    times `penalty_factor`: 0 for responses that fit, falling linearly to -1
    across the last L_cache tokens of the budget.

    Args:
      response_lengths: `[B]` response lengths |y| in tokens (int or float).
      max_length: L_max, the maximum response length (> 0). DAPO: 20480.
      cache_length: L_cache, the soft punishment interval, in (0, L_max].
        DAPO: 4096.
      penalty_factor: scale of the penalty (verl's `overlong_buffer.penalty_factor`,
        default 1).
      floor_at_max: True (default, the paper) gives -1 beyond L_max; False
        continues the line below -1 (verl's and AReaL's code).

    Returns:
      `[B]` penalties, <= 0, to add to the trajectory scores.

    References:
      Yu et al., "DAPO: An Open-Source LLM Reinforcement Learning System at
      Scale", arXiv 2503.14476, Eq. 13; verl `workers/reward_manager/dapo.py`.

    Notes:
      The code computes min(-(|y| - (L_max - L_cache)) / L_cache * factor, 0)
      without the -1 floor; the two agree whenever generation stops at L_max,
      as it does in DAPO's runs.

    Example: max_length 20, cache_length 4, lengths [10, 16, 18, 20, 25] give
    [0, 0, -0.5, -1, -1] (and -2.25 for 25 with floor_at_max=False).
    """
    fn = "overlong_penalty"
    lengths = jnp.asarray(response_lengths)
    if jnp.issubdtype(lengths.dtype, jnp.integer):
        lengths = lengths.astype(jnp.float32)
    lengths = _checks.float_array(fn, "response_lengths", lengths, rank=1)
    for name, value in (("max_length", max_length), ("cache_length", cache_length),
                        ("penalty_factor", penalty_factor)):
        if not _checks.is_concrete(value):
            raise ValueError(f"{fn}: {name} must be a static number, not a traced value")
        _checks.number(fn, name, value)
    if not 0 < cache_length <= max_length:
        raise ValueError(f"{fn}: cache_length={cache_length} and max_length={max_length}; they "
                         f"must satisfy 0 < cache_length <= max_length")
    if not penalty_factor >= 0:
        raise ValueError(f"{fn}: penalty_factor={penalty_factor}; it must be >= 0")
    if _checks.is_concrete(lengths) and lengths.size and float(np.min(np.asarray(lengths))) < 0:
        raise ValueError(f"{fn}: response_lengths holds {float(np.min(np.asarray(lengths)))}; "
                         f"lengths must be >= 0")
    expected = max_length - cache_length
    penalty = jnp.minimum((expected - lengths) / cache_length, 0.0)
    if floor_at_max:
        penalty = jnp.where(lengths > max_length, -1.0, penalty)
    return penalty_factor * penalty


def dynamic_sampling_mask(scores, group_ids, *, num_groups: int | None = None,
                          singleton: Literal["drop", "keep"] = "drop",
                          axis_name: str | None = None) -> jax.Array:
    """DAPO's dynamic-sampling filter: True for trajectories whose group scores are not all equal.

        keep_i = max_{j in g(i)} s_j > min_{j in g(i)} s_j

    A group whose rollouts all score the same (all solved, all failed) has
    zero group-relative advantage and no gradient; DAPO drops it and samples
    more groups until the batch is full (the trainer's loop).

    Args:
      scores: `[B]` trajectory scores (the accuracy or reward DAPO filters on).
      group_ids: `[B]` int ids of each trajectory's group (task); arbitrary
        values, or in [0, num_groups) when num_groups is given.
      num_groups: static number of groups, or None to remap the ids.
      singleton: "drop" (default, the paper: one rollout cannot differ from
        itself) or "keep" (verl's `filter_groups`, which keeps groups of size 1).
      axis_name: mesh axis the batch is sharded over (inside `shard_map`); the
        group max, min and size are combined across devices, so a group may
        span devices.

    Returns:
      `[B]` bool, True for trajectories to keep.

    References:
      Yu et al., "DAPO: An Open-Source LLM Reinforcement Learning System at
      Scale", arXiv 2503.14476, Eq. 11 (0 < |{o_i correct}| < G); verl
      `recipe/dapo` (`filter_groups`); AReaL `dynamic_sampling`.

    Notes:
      verl keeps a group when `np.std(metric) > 0` or it has one member; here
      equality is exact (max == min), so float round-off in the std (e.g.
      three scores of 0.1) cannot keep an all-equal group. AReaL drops
      singletons, like the default.

    Example: scores [1, 0, 1, 1, 0.5], group_ids [7, 7, 3, 3, 9] give
    [T, T, F, F, F], and [T, T, F, F, T] with singleton="keep".
    """
    fn = "dynamic_sampling_mask"
    if singleton not in ("drop", "keep"):
        raise ValueError(f"{fn}: singleton={singleton!r} is not one of 'drop', 'keep'")
    scores = _checks.float_array(fn, "scores", scores, rank=1)
    group_ids = _checks.int_array(fn, "group_ids", group_ids, rank=1)
    _checks.leading_dim(fn, scores.shape[0], group_ids=group_ids)
    _checks.finite_where(fn, "scores", scores)
    if num_groups is not None:
        if isinstance(num_groups, bool) or not isinstance(num_groups, (int, np.integer)) \
                or num_groups < 1:
            raise ValueError(f"{fn}: num_groups={num_groups!r}; it must be a positive Python int")
        if _checks.is_concrete(group_ids) and group_ids.size:
            ids = np.asarray(group_ids)
            bad = [int(i) for i in (ids.min(), ids.max()) if not 0 <= i < num_groups]
            if bad:
                raise ValueError(f"{fn}: group_ids holds {bad[0]} but num_groups={num_groups}; ids "
                                 f"must lie in [0, {num_groups}) (omit num_groups to remap)")
    ids, size = dense_group_ids(group_ids, num_groups, axis_name=axis_name)
    high = jax.ops.segment_max(scores, ids, num_segments=size)
    low = jax.ops.segment_min(scores, ids, num_segments=size)
    count = jax.ops.segment_sum(jnp.ones_like(scores), ids, num_segments=size)
    if axis_name is not None:
        high = jax.lax.pmax(high, axis_name)
        low = jax.lax.pmin(low, axis_name)
        count = jax.lax.psum(count, axis_name)
    keep = high[ids] > low[ids]
    if singleton == "keep":
        keep = keep | (count[ids] == 1)
    return keep
