"""iStar: implicit step rewards from a trajectory-level DPO process reward model.

An implicit PRM pi_prm (a causal LM initialised from the policy) gives each
agent step the reward beta log(pi_prm(a_t) / pi_old(a_t)). It is trained with
a Bradley-Terry loss on (successful, failed) trajectory pairs of the same
task, and its step rewards, normalised within each task group, are added to
the episode advantage.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from stepcredit.advantages import _checks
from stepcredit.advantages import group as group_lib
from stepcredit.advantages import process
from stepcredit.advantages.tokens import step_rewards_from_tokens

EPISODES = ("rloo", "grpo")
STEP_BASELINES = ("all_steps", "first_step")
REDUCES = ("sum", "mean")


def _check_logps(fn: str, prm_logp, ref_logp, counted_name: str, counted):
    prm_logp = _checks.float_array(fn, "prm_logp", prm_logp, rank=2)
    ref_logp = _checks.float_array(fn, "ref_logp", ref_logp, rank=2)
    _checks.same_shape(fn, "[B, N]", prm_logp=prm_logp, ref_logp=ref_logp,
                       **{counted_name: counted})
    return prm_logp, ref_logp


def implicit_step_rewards(prm_logp, ref_logp, step_index, num_steps: int, *, beta: float = 0.05,
                          normalize: str | None = None, axis_name: str | None = None) -> jax.Array:
    """iStar's implicit step reward: beta log(pi_prm(a_t) / pi_old(a_t)) summed over the step.

        r_t = beta sum_{n : step_index[n] = t} (log pi_prm(y_n) - log pi_old(y_n))

    since a step's action a_t is all of its tokens. normalize="max_abs"
    divides every r_t by max |r| over the batch (so r lies in [-1, 1]); an
    all-zero batch stays zero.

    Args:
      prm_logp: `[B, N]` token log-probs under the implicit PRM.
      ref_logp: `[B, N]` token log-probs under the rolling old policy pi_old
        (the policy that sampled the batch), not the KL reference.
      step_index: `[B, N]` int, the step of each action token, -1 on
        observation, prompt and padding tokens (whose log-probs may be NaN).
      num_steps: static number of steps T of the output.
      beta: the implicit reward's scale (iStar `beta_train` = 0.05).
      normalize: None (the paper) or "max_abs" (the authors' `batch_norm`).
      axis_name: mesh axis the batch is sharded over, for the batch maximum
        of normalize="max_abs" inside `shard_map`.

    Returns:
      `[B, T]` step rewards, 0 for a step without action tokens.

    Raises:
      ValueError / TypeError: wrong rank, shape or dtype; unknown normalize;
        called eagerly, NaN or inf at an action token, or a step index >=
        num_steps.

    References:
      Liu et al., "Agentic RL with Implicit Step Rewards" (iStar), arXiv
      2509.19199, §3 (implicit step reward).

    Notes:
      The authors' code (`dp_rm.py`) places the step's summed reward on its
      last token and, with `istar_norm=batch_norm` (their config default),
      divides by the largest |reverse cumulative sum| in the batch; with one
      step per row that is the largest |r_t|: normalize="max_abs". The paper
      states no normalisation. As in the paper, the step rewards come from
      the PRM after this iteration's update; the authors'
      code takes them from the forward pass before the PRM's gradient step:
      pass that pass's log-probs to reproduce it.

    Example (beta = 0.5): prm_logp [[-1, -1, 9, -2]], ref_logp
    [[-2, -1.5, 0, -1]], step_index [[0, 0, -1, 1]], num_steps 2 gives
    [[0.75, -0.5]]; with normalize="max_abs", [[1, -0.6667]].
    """
    fn = "implicit_step_rewards"
    _checks.finite_scalars(fn, beta=beta)
    _checks.one_of(fn, "normalize", normalize, (None, "max_abs"))
    step_index = _checks.int_array(fn, "step_index", step_index, rank=2)
    prm_logp, ref_logp = _check_logps(fn, prm_logp, ref_logp, "step_index", step_index)
    _checks.finite_where(fn, "prm_logp", prm_logp, step_index >= 0)
    _checks.finite_where(fn, "ref_logp", ref_logp, step_index >= 0)
    token_rewards = jnp.where(step_index >= 0, beta * (prm_logp - ref_logp), 0.0)
    rewards = step_rewards_from_tokens(token_rewards, step_index, num_steps)
    if normalize == "max_abs":
        largest = jnp.max(jnp.abs(rewards))
        if axis_name is not None:
            largest = jax.lax.pmax(largest, axis_name)
        rewards = rewards / jnp.where(largest > 0, largest, 1.0)
    return rewards


def trajectory_preference_loss(prm_logp, ref_logp, action_mask, step_index, success, group_ids, *,
                               beta: float = 0.05, reduce: str = "sum",
                               num_groups: int | None = None, num_steps: int | None = None,
                               axis_name: str | None = None) -> tuple[jax.Array, dict]:
    """iStar's PRM objective: Bradley-Terry over (successful, failed) trajectory pairs.

        Q(tau) = sum_t r_t           (reduce="sum", the paper)
               = (1/T_tau) sum_t r_t   (reduce="mean", the authors' code)
        r_t    = beta sum_{action tokens n of step t} (log pi_prm(y_n) - log pi_old(y_n))
        loss   = mean over pairs (i, j) of -log sigmoid(Q(tau_i) - Q(tau_j))

    over every pair of the batch with i successful, j failed and both in the
    same task group (all pairs averaged together, not per group first;
    groups without both kinds contribute none). No pair at all gives loss 0
    with zero gradient. Differentiable in `prm_logp`.

    Args:
      prm_logp: `[B, N]` token log-probs under the implicit PRM.
      ref_logp: `[B, N]` token log-probs under pi_old (treated as constant).
      action_mask: `[B, N]` bool, True on the action tokens the loss counts
        (other entries may hold NaN).
      step_index: `[B, N]` int, the step of each action token (>= 0 where
        action_mask is True); used by reduce="mean" to count T_tau.
      success: `[B]` bool, True for a successful trajectory (iStar: score > 0).
      group_ids: `[B]` int task group; arbitrary unless `num_groups` is given.
      beta: the implicit reward's scale (0.05).
      reduce: "sum" (paper) or "mean" (code).
      num_groups: when given, group ids must lie in [0, num_groups) (checked
        eagerly); pairs are formed by id equality either way.
      num_steps: static bound on step indices for reduce="mean" (None: N).
      axis_name: mesh axis the batch is sharded over inside `shard_map`;
        trajectory scores are gathered so that pairs may span devices.

    Returns:
      `(loss, metrics)`: the scalar loss and a dict with "num_pairs" (float),
      "accuracy" (the fraction of pairs with Q+ > Q-, 0 without pairs) and
      "margin" (mean Q+ - Q- over pairs, 0 without pairs).

    Raises:
      ValueError / TypeError: wrong rank, shape or dtype; unknown reduce;
        called eagerly, NaN or inf at a counted token, a counted token with
        step_index < 0 or >= num_steps, or an id outside [0, num_groups).

    References:
      Liu et al., "Agentic RL with Implicit Step Rewards" (iStar), arXiv
      2509.19199, §3 (trajectory-based DPO); Rafailov et al., "Direct
      Preference Optimization", arXiv 2305.18290.

    Notes:
      The authors' code (`rm_utils.compute_eto_loss_rm`) scores a trajectory
      by the mean of its step rewards over steps (reduce="mean"); the paper
      writes the sum (log pi(tau) = sum_t log pi(a_t)), the default here. A
      trajectory without counted tokens (padding) forms no pair.

    Example (beta = 1): one group, trajectories 0 and 1 successful, 2 and 3
    failed, with Q = [1, 0, 0, -1] (one single-token step each, prm_logp =
    Q, ref_logp = 0): pair margins 1, 2, 0, 1, so the loss is
    mean(softplus(-[1, 2, 0, 1])) = 0.36165, accuracy 0.75, margin 1.0.
    """
    fn = "trajectory_preference_loss"
    _checks.one_of(fn, "reduce", reduce, REDUCES)
    action_mask = _checks.bool_array(fn, "action_mask", action_mask, rank=2)
    step_index = _checks.int_array(fn, "step_index", step_index, rank=2)
    prm_logp, ref_logp = _check_logps(fn, prm_logp, ref_logp, "action_mask", action_mask)
    _checks.same_shape(fn, "[B, N]", action_mask=action_mask, step_index=step_index)
    success = _checks.bool_array(fn, "success", success, rank=1)
    group_ids = _checks.int_array(fn, "group_ids", group_ids, rank=1)
    _checks.leading_dim(fn, action_mask.shape[0], success=success, group_ids=group_ids)
    if num_groups is not None:
        group_lib.dense_group_ids(group_ids, num_groups)  # range check only
    num_steps = action_mask.shape[1] if num_steps is None else num_steps
    if _checks.is_concrete(step_index, action_mask) and bool(jnp.any(action_mask)):
        counted = step_index[action_mask]
        if int(counted.min()) < 0 or int(counted.max()) >= num_steps:
            raise ValueError(f"{fn}: step_index holds {int(counted.min())}..{int(counted.max())} "
                             f"at counted tokens; it must lie in [0, num_steps={num_steps})")
    _checks.finite_where(fn, "prm_logp", prm_logp, action_mask)
    _checks.finite_where(fn, "ref_logp", ref_logp, action_mask)

    log_ratio = jnp.where(action_mask, prm_logp - jax.lax.stop_gradient(ref_logp), 0.0)
    scores = beta * jnp.sum(log_ratio, axis=1)
    present = jnp.any(action_mask, axis=1)
    if reduce == "mean":
        counted_index = jnp.where(action_mask, step_index, -1)
        tokens_per_step = step_rewards_from_tokens(action_mask.astype(scores.dtype), counted_index,
                                                   num_steps)
        scores = scores / jnp.maximum(jnp.sum(tokens_per_step > 0, axis=1), 1).astype(scores.dtype)
    return _pairwise_loss(scores, success & present, ~success & present, group_ids, axis_name)


def _pairwise_loss(scores, winners, losers, group_ids, axis_name):
    """Mean -log sigmoid(Q_i - Q_j) over same-group (winner i, loser j) pairs; local i, global j."""
    if axis_name is None:
        all_scores, all_losers, all_ids = scores, losers, group_ids
    else:
        gather = lambda x: jax.lax.all_gather(x, axis_name, tiled=True)  # noqa: E731
        all_scores, all_losers, all_ids = gather(scores), gather(losers), gather(group_ids)
    pairs = winners[:, None] & all_losers[None, :] & (group_ids[:, None] == all_ids[None, :])
    margins = scores[:, None] - all_scores[None, :]
    sums = jnp.stack([
        jnp.sum(jnp.where(pairs, jax.nn.softplus(-margins), 0.0)),
        jnp.sum(pairs).astype(scores.dtype),
        jnp.sum(pairs & (margins > 0)).astype(scores.dtype),
        jnp.sum(jnp.where(pairs, margins, 0.0)),
    ])
    if axis_name is not None:
        sums = jax.lax.psum(sums, axis_name)
    loss_sum, count, correct, margin_sum = sums
    denominator = jnp.maximum(count, 1.0)
    metrics = {"num_pairs": count, "accuracy": correct / denominator,
               "margin": margin_sum / denominator}
    return loss_sum / denominator, metrics


def istar(scores, step_rewards, group_ids, mask, *, alpha: float = 1.0, episode: str = "rloo",
          step_baseline: str = "all_steps", std: str = "unbiased", num_groups: int | None = None,
          eps: float = 1e-6, axis_name: str | None = None) -> jax.Array:
    """iStar's step advantage: episode advantage plus alpha times the normalised step reward.

        A^E_i     = rloo(s)_i = N/(N-1) (s_i - mean_g s)             (episode="rloo")
                  = grpo(s)_i = (s_i - mean_g s) / (std_g s + eps)     (episode="grpo")
        A^S_{i,t} = M/(M-1) (r_{i,t} - mean R_g)                       (rloo)
                  = (r_{i,t} - mean R_g) / (std R_g + eps)              (grpo)
        A_{i,t}   = A^E_i + alpha A^S_{i,t}

    where R_g holds the implicit step rewards of all valid steps of the
    group's trajectories (M of them). alpha = 0 gives the episode estimator
    broadcast over steps. A singleton group gives 0 at the episode level,
    and at the step level with step_baseline="first_step" (or fewer than two
    valid steps: with "all_steps" one trajectory's steps are still compared
    among themselves); a group whose scores (or, with "all_steps", whose
    step rewards) are all equal gives 0 at that level (the conventions of
    `grpo` and `rloo`).

    Args:
      scores: `[B]` episode scores r_o (the sum of the step rewards); every
        row counts as a member of its group.
      step_rewards: `[B, T]` implicit step rewards (`implicit_step_rewards`).
      group_ids: `[B]` int task group (arbitrary unless `num_groups` is given).
      mask: `[B, T]` bool, True on valid steps (padding may hold NaN).
      alpha: weight of the step advantage (iStar `step_advantage_w` = 1.0).
      episode: "rloo" (the paper's main results, `istar_rloo`) or "grpo".
      step_baseline: "all_steps" (the paper's R_s) or "first_step" (the
        authors' code: one step per trajectory, its first, in the baseline).
      std: for episode="grpo": "unbiased", "biased" or "none" (applies at
        both levels; "none" is the code's `mean_norm` default of `istar_grpo`).
      num_groups: static number of groups, or None to remap ids.
      eps: added to the std (1e-6).
      axis_name: mesh axis to combine group sums over inside `shard_map`.

    Returns:
      `[B, T]` advantages, 0 at masked steps.

    Raises:
      ValueError / TypeError: wrong rank, shape, dtype or option; called
        eagerly, NaN or inf in scores or at a valid step, or an id outside
        [0, num_groups).

    References:
      Liu et al., "Agentic RL with Implicit Step Rewards" (iStar), arXiv
      2509.19199, §3 (A = A^E + alpha A^S).

    Notes:
      The authors' `core_istar.py` de-duplicates rows by (uid, traj_uid), so
      only the first step of each trajectory enters the step-reward baseline:
      step_baseline="first_step" reproduces it (with M the number of
      trajectories). Their `istar_grpo` defaults to no std division:
      std="none". The paper's A^E and A^S both divide by the std.

    Example: the hand-checked group of the tests: scores [1, 1, 0, 0] in one
    group, step_rewards [[0.3, 0.1], [0.2, NaN], [-0.1, -0.3], [0.0, NaN]]
    with the NaN steps masked: A^E = 4/3 (s - 0.5) = [2/3, 2/3, -2/3, -2/3];
    R_g has M = 6 rewards with mean 1/30, so A^S = 1.2 (r - 1/30) and

      [[0.98667, 0.74667], [0.86667, 0], [-0.82667, -1.06667], [-0.70667, 0]]
    """
    fn = "istar"
    _checks.finite_scalars(fn, alpha=alpha)
    _checks.one_of(fn, "episode", episode, EPISODES)
    _checks.one_of(fn, "step_baseline", step_baseline, STEP_BASELINES)
    _checks.one_of(fn, "std", std, group_lib.STDS)
    step_rewards, mask, scores, group_ids = _checks.step_and_group_arrays(
        fn, "step_rewards", step_rewards, mask, scores, group_ids)
    _checks.finite_where(fn, "scores", scores)
    _checks.finite_where(fn, "step_rewards", step_rewards, mask)
    if episode == "rloo":
        episode_advantages = group_lib.rloo(scores, group_ids, num_groups=num_groups,
                                            axis_name=axis_name)
    else:
        episode_advantages = group_lib.grpo(scores, group_ids, num_groups=num_groups, eps=eps,
                                            std=std, axis_name=axis_name)
    return process.add_process_advantage(
        episode_advantages, step_rewards, group_ids, mask, weight=alpha, normalize=episode,
        baseline="all" if step_baseline == "all_steps" else "first", std=std,
        num_groups=num_groups, eps=eps, axis_name=axis_name)
