"""Process rewards from an implicit PRM: PRIME's token rewards and two ways to shape with them.

An implicit process reward model (PRM) scores each action by
beta log(pi_prm / pi_ref). This module holds what the iStar paper compares its
step rewards against (arXiv 2509.19199, ablations "merged rewards" and
"token-level process rewards"):

  - PRIME (arXiv 2502.01456): token-level implicit rewards, RLOO on the
    process rewards and on the outcome separately, summed into token returns;
  - "merged rewards": process rewards added into the outcome before the group
    estimator (iStar's code `process_outcome_combined`);
  - a group-normalised process advantage added to the episode advantage, at
    step level (iStar itself) or token level.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from stepcredit.advantages import _checks
from stepcredit.advantages import group as group_lib
from stepcredit.advantages.recurrence import reverse_linear_recurrence, zero_carry

NORMALIZATIONS = ("rloo", "grpo")
BASELINES = ("all", "first")


def _first_valid(values: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Each row's entry at its first valid position `[B]`, and whether the row has one."""
    first = jnp.argmax(mask, axis=1)
    return jnp.take_along_axis(values, first[:, None], axis=1)[:, 0], jnp.any(mask, axis=1)


def _group_relative(values, ids, mask, num_groups, *, normalize, baseline, std, eps, axis_name):
    """Group-normalised `[B, L]` values (0 where masked); ids are dense `[B]`."""
    full_ids = jnp.broadcast_to(ids[:, None], values.shape)
    if baseline == "all":
        # A group with fewer than two valid positions has all of them equal: 0 either way.
        return group_lib._normalize(values, full_ids, mask, num_groups,
                                    std="leave_one_out" if normalize == "rloo" else std, eps=eps,
                                    singleton="zero", axis_name=axis_name)
    first, has_step = _first_valid(values, mask)
    stats = group_lib.group_stats(first, ids, has_step, num_groups=num_groups,
                                  axis_name=axis_name)
    stats = group_lib.GroupStats(*(x[:, None] for x in stats))
    centered = values - stats.mean
    if normalize == "rloo":
        out = centered * stats.count / jnp.maximum(stats.count - 1.0, 1.0)
    elif std == "none":
        out = centered
    else:
        scale = (stats.std_unbiased if std == "unbiased" else stats.std_biased) + eps
        out = centered / jnp.where(scale > 0, scale, 1.0)
    # Equal first steps say nothing about the other steps: only the count zeroes here.
    out = jnp.where(stats.count < 2, 0.0, out)
    return jnp.where(mask, out, 0.0)


def add_process_advantage(episode_advantages, process_rewards, group_ids, mask, *,
                          weight: float = 1.0, normalize: str = "rloo", baseline: str = "all",
                          std: str = "unbiased", num_groups: int | None = None, eps: float = 1e-6,
                          axis_name: str | None = None) -> jax.Array:
    """Episode advantage plus a group-normalised process advantage (iStar's combination).

    With R_g the process rewards at the valid positions of group g's
    trajectories (baseline="all") or at each trajectory's first valid
    position (baseline="first"), M = |R_g|:

        A^S_{i,t} = M/(M-1) (r_{i,t} - mean R_g)                 (normalize="rloo")
        A^S_{i,t} = (r_{i,t} - mean R_g) / (std R_g + eps)        (normalize="grpo")
        A_{i,t}   = A^E_i + weight A^S_{i,t}

    A^S is 0 where the baseline has fewer than two members and, with
    baseline="all", where all of the group's process rewards are equal.
    std="none" drops the division (and eps); "biased" divides by M, not M - 1.
    The positions are agent steps (`[B, T]`, iStar) or action tokens
    (`[B, N]`, the "token-level process rewards" ablation).

    Args:
      episode_advantages: `[B]` episode advantages A^E (e.g. `rloo` of the
        outcome scores), broadcast over positions.
      process_rewards: `[B, T]` step (or `[B, N]` token) process rewards,
        e.g. `implicit_step_rewards` or `prime_token_rewards`.
      group_ids: `[B]` int task group of each trajectory (arbitrary unless
        `num_groups` is given).
      mask: `[B, T]` (or `[B, N]`) bool, True on valid steps (action tokens).
      weight: alpha, the weight of the process advantage (iStar: 1.0).
      normalize: "rloo" or "grpo".
      baseline: "all" (the paper's R_s: every valid position of the group)
        or "first" (one position per trajectory, its first: iStar's code).
      std: "unbiased", "biased" or "none", for normalize="grpo".
      num_groups: static number of groups, or None to remap ids.
      eps: added to the std (1e-6).
      axis_name: mesh axis to combine group sums over inside `shard_map`.

    Returns:
      Advantages of the shape of `process_rewards`, 0 where `mask` is False.

    Raises:
      ValueError / TypeError: wrong rank, shape, dtype or option; called
        eagerly, NaN or inf at a valid position or in the episode_advantages
        of a trajectory with one, or an id outside [0, num_groups).

    References:
      Liu et al., "Agentic RL with Implicit Step Rewards" (iStar), arXiv
      2509.19199, §3 (A = A^E + alpha A^S).

    Notes:
      With baseline="first" and normalize="grpo", a group whose first
      positions hold equal rewards has std 0, so other positions are divided
      by eps alone, as in the authors' code; prefer std="none" (their
      `mean_norm` default) with that baseline.

    Example: episode_advantages [1, -1], process_rewards [[0.2, 0.4], [0.0,
    NaN]], group_ids [0, 0], mask [[T, T], [T, F]]: the group's step rewards
    {0.2, 0.4, 0} have mean 0.2 and M = 3, so A^S = 1.5 (r - 0.2) and

      [[1.0, 1.3], [-1.3, 0.0]]
    """
    fn = "add_process_advantage"
    _checks.finite_scalars(fn, weight=weight)
    _checks.one_of(fn, "normalize", normalize, NORMALIZATIONS)
    _checks.one_of(fn, "baseline", baseline, BASELINES)
    _checks.one_of(fn, "std", std, group_lib.STDS)
    process_rewards = _checks.float_array(fn, "process_rewards", process_rewards, rank=2)
    mask = _checks.bool_array(fn, "mask", mask, rank=2)
    _checks.same_shape(fn, "[B, T]", process_rewards=process_rewards, mask=mask)
    episode_advantages = _checks.float_array(fn, "episode_advantages", episode_advantages, rank=1)
    group_ids = _checks.int_array(fn, "group_ids", group_ids, rank=1)
    _checks.leading_dim(fn, mask.shape[0], episode_advantages=episode_advantages,
                        group_ids=group_ids)
    _checks.finite_where(fn, "process_rewards", process_rewards, mask)
    _checks.finite_where(fn, "episode_advantages", episode_advantages, jnp.any(mask, axis=1))
    dense = group_lib._dense_ids(fn, group_ids, num_groups, axis_name)
    step_term = _group_relative(process_rewards, dense.ids, mask, dense.num_groups,
                                normalize=normalize, baseline=baseline, std=std, eps=eps,
                                axis_name=axis_name)
    return jnp.where(mask, episode_advantages[:, None] + weight * step_term, 0.0)


def merge_process_rewards(outcome_scores, step_rewards, mask, *, weight: float = 1.0) -> jax.Array:
    """Merged rewards: the outcome plus the weighted sum of the process rewards.

        s'_i = s_i + weight * sum_{valid t} r_{i,t}

    The merged score then goes through a group estimator (`rloo(s', ...)`:
    the iStar paper's "merged rewards" ablation, which it reports as worse
    than adding a separately normalised step advantage).

    Args:
      outcome_scores: `[B]` outcome scores r_o.
      step_rewards: `[B, T]` process rewards r_phi (e.g. `implicit_step_rewards`).
      mask: `[B, T]` bool, True on valid steps.
      weight: weight w of the process rewards (1.0).

    Returns:
      `[B]` merged trajectory scores.

    References:
      Liu et al., "Agentic RL with Implicit Step Rewards" (iStar), arXiv
      2509.19199, ablation "w/ merged rewards".

    Notes:
      The authors' code (`process_outcome_combined`) merges r_o + w r_phi
      before RLOO; how it folds several steps into one score was not read.
      Summing the step rewards keeps the Bradley-Terry reading of the PRM, in
      which a trajectory's implicit return is the sum of its step rewards.

    Example: outcome_scores [1, 0], step_rewards [[0.2, 0.4], [-0.1, NaN]],
    mask [[T, T], [T, F]], weight 0.5 gives [1.3, -0.05].
    """
    fn = "merge_process_rewards"
    _checks.finite_scalars(fn, weight=weight)
    step_rewards = _checks.float_array(fn, "step_rewards", step_rewards, rank=2)
    mask = _checks.bool_array(fn, "mask", mask, rank=2)
    _checks.same_shape(fn, "[B, T]", step_rewards=step_rewards, mask=mask)
    outcome_scores = _checks.float_array(fn, "outcome_scores", outcome_scores, rank=1)
    _checks.leading_dim(fn, mask.shape[0], outcome_scores=outcome_scores)
    _checks.finite_where(fn, "outcome_scores", outcome_scores)
    _checks.finite_where(fn, "step_rewards", step_rewards, mask)
    return outcome_scores + weight * jnp.sum(jnp.where(mask, step_rewards, 0.0), axis=1)


def prime_token_rewards(prm_logp, ref_logp, action_mask, *, beta: float = 0.05) -> jax.Array:
    """PRIME's implicit process reward of each action token.

        r_n = beta (log pi_prm(y_n | y_<n) - log pi_ref(y_n | y_<n))

    Args:
      prm_logp: `[B, N]` token log-probs under the implicit PRM.
      ref_logp: `[B, N]` token log-probs under the reference (PRIME: the
        rolling old policy when no reference model is configured).
      action_mask: `[B, N]` bool, True on action tokens; other entries may
        hold anything, NaN included.
      beta: the implicit reward's scale (PRIME `beta_train` = 0.05).

    Returns:
      `[B, N]` token rewards, 0 off the action tokens.

    References:
      Cui et al., "Process Reinforcement through Implicit Rewards" (PRIME),
      arXiv 2502.01456.

    Example: prm_logp [[-1.0, -2.0]], ref_logp [[-1.5, -1.0]], action_mask
    [[T, T]] gives [[0.025, -0.05]].
    """
    fn = "prime_token_rewards"
    _checks.finite_scalars(fn, beta=beta)
    prm_logp = _checks.float_array(fn, "prm_logp", prm_logp, rank=2)
    ref_logp = _checks.float_array(fn, "ref_logp", ref_logp, rank=2)
    action_mask = _checks.bool_array(fn, "action_mask", action_mask, rank=2)
    _checks.same_shape(fn, "[B, N]", prm_logp=prm_logp, ref_logp=ref_logp, action_mask=action_mask)
    _checks.finite_where(fn, "prm_logp", prm_logp, action_mask)
    _checks.finite_where(fn, "ref_logp", ref_logp, action_mask)
    return jnp.where(action_mask, beta * (prm_logp - ref_logp), 0.0)


def prime_advantages(token_rewards, outcome_scores, action_mask, group_ids, *,
                     reward_dpo_coef: float = 5.0, reward_gt_coef: float = 5.0,
                     num_groups: int | None = None, axis_name: str | None = None) -> jax.Array:
    """PRIME's token returns: RLOO on process rewards and on the outcome, weighted and summed.

    With N_g the number of trajectories in trajectory i's group, rho_i the
    mean of i's token rewards over its action tokens and n_i its last action
    token:

        p_{i,n} = N_g/(N_g-1) (r_{i,n} - mean_{j in g} rho_j)
        o_i     = N_g/(N_g-1) (s_i - mean_{j in g} s_j)            (at n_i only)
        x_{i,n} = reward_dpo_coef p_{i,n} + reward_gt_coef o_i [n = n_i]
        G_{i,n} = sum_{m >= n, action} x_{i,m}                     (gamma = 1)

    The caller whitens G over valid tokens (registry whiten="tokens") to get
    the advantages. A singleton group contributes 0 (verl divides by zero).

    Args:
      token_rewards: `[B, N]` implicit token rewards (`prime_token_rewards`).
      outcome_scores: `[B]` outcome scores (PRIME: the 0/1 accuracy).
      action_mask: `[B, N]` bool, True on action tokens.
      group_ids: `[B]` int group (prompt) of each trajectory.
      reward_dpo_coef: weight of the process part (PRIME recipe: 5).
      reward_gt_coef: weight of the outcome part (PRIME recipe: 5).
      num_groups: static number of groups, or None to remap ids.
      axis_name: mesh axis to combine group sums over inside `shard_map`.

    Returns:
      `[B, N]` returns G (the advantages before whitening), 0 off action tokens.

    Raises:
      ValueError / TypeError: wrong rank, shape or dtype; called eagerly,
        NaN or inf at an action token or in the outcome_scores of a
        trajectory with one.

    References:
      Cui et al., "Process Reinforcement through Implicit Rewards" (PRIME),
      arXiv 2502.01456; verl's PRIME recipe `compute_rloo_advantage_return`
      (copied into iStar's code).

    Notes:
      Every row with at least one action token is a member of its group; a
      row with none (padding) is left out of the group means. The PRM's own
      loss (cross-entropy on the outcome) is not part of this function.

    Example (coefficients 1): token_rewards [[0.1, 0.3], [0.0, -0.2]],
    outcome_scores [1, 0], one group, all tokens valid: rho = [0.2, -0.1]
    (mean 0.05), so p = 2 (r - 0.05) = [[0.1, 0.5], [-0.1, -0.5]] and
    o = [1, -1] at each last token; x = [[0.1, 1.5], [-0.1, -1.5]] and

      G = [[1.6, 1.5], [-1.6, -1.5]]
    """
    fn = "prime_advantages"
    _checks.finite_scalars(fn, reward_dpo_coef=reward_dpo_coef, reward_gt_coef=reward_gt_coef)
    token_rewards = _checks.float_array(fn, "token_rewards", token_rewards, rank=2)
    action_mask = _checks.bool_array(fn, "action_mask", action_mask, rank=2)
    _checks.same_shape(fn, "[B, N]", token_rewards=token_rewards, action_mask=action_mask)
    outcome_scores = _checks.float_array(fn, "outcome_scores", outcome_scores, rank=1)
    group_ids = _checks.int_array(fn, "group_ids", group_ids, rank=1)
    _checks.leading_dim(fn, action_mask.shape[0], outcome_scores=outcome_scores,
                        group_ids=group_ids)
    present = jnp.any(action_mask, axis=1)
    _checks.finite_where(fn, "token_rewards", token_rewards, action_mask)
    _checks.finite_where(fn, "outcome_scores", outcome_scores, present)
    dense = group_lib._dense_ids(fn, group_ids, num_groups, axis_name)

    def leave_one_out(values, scores):
        stats = group_lib.group_stats(scores, dense.ids, present, num_groups=dense.num_groups,
                                      axis_name=axis_name)
        factor = jnp.where(stats.count >= 2, stats.count / jnp.maximum(stats.count - 1.0, 1.0), 0.0)
        return factor[:, None] * (values - stats.mean[:, None])

    rewards = jnp.where(action_mask, token_rewards, 0.0)
    length = jnp.maximum(jnp.sum(action_mask, axis=1), 1).astype(rewards.dtype)
    process = leave_one_out(rewards, jnp.sum(rewards, axis=1) / length)
    outcome = leave_one_out(jnp.where(present, outcome_scores, 0.0)[:, None],
                            jnp.where(present, outcome_scores, 0.0))
    positions = jnp.arange(action_mask.shape[1])
    last = jnp.max(jnp.where(action_mask, positions, -1), axis=1)
    combined = (reward_dpo_coef * process
                + reward_gt_coef * jnp.where(positions == last[:, None], outcome, 0.0))
    combined = jnp.where(action_mask, combined, 0.0)
    # G_n = x_n + G_{n+1}: the reverse cumulative sum as a linear recurrence, which CPU
    # runs as the compiled kernel (XLA:CPU runs a cumulative sum as a slow reduce-window).
    returns = reverse_linear_recurrence(combined, jnp.ones_like(combined),
                                        zero_carry(combined))
    return jnp.where(action_mask, returns, 0.0)
