"""StepPO's step-level importance sampling: one length-normalised ratio per agent step.

A step is the model's whole response at one turn, so StepPO clips one
importance ratio per step rather than one per token: the geometric mean of
the step's token ratios (GSPO's sequence ratio, with a step as the
sequence). Token log-probs arrive in the trajectory view `[B, N]` with
`step_index` naming each action token's step (-1 elsewhere); the step sums
are the segment sums of `stepcredit.advantages.tokens`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from stepcredit.advantages import _checks
from stepcredit.advantages.tokens import broadcast_to_tokens, step_rewards_from_tokens
from stepcredit.losses.aggregate import aggregate, masked_fraction, masked_stats
from stepcredit.losses.policy import LossAndMetrics, check_clip, clipped_surrogate

# verl's GSPO clamps the log of the sequence ratio at 10 (no lower bound).
LOG_STEP_RATIO_MAX = 10.0


def _check_token_view(fn: str, logp, old_logp, step_index, num_steps: int, step_mask=None):
    """The token arrays, checked; their values only at action tokens (of valid steps, with
    `step_mask` given: a masked step's tokens may hold anything)."""
    step_index = _checks.int_array(fn, "step_index", step_index, rank=2)
    logp = _checks.float_array(fn, "logp", logp, rank=2)
    old_logp = _checks.float_array(fn, "old_logp", old_logp, rank=2)
    _checks.same_shape(fn, "[B, N]", logp=logp, old_logp=old_logp, step_index=step_index)
    if not isinstance(num_steps, int) or num_steps < 1:
        raise ValueError(f"{fn}: num_steps={num_steps!r}; it must be a positive Python int (static T)")
    if _checks.is_concrete(step_index) and step_index.size and int(step_index.max()) >= num_steps:
        raise ValueError(f"{fn}: step_index holds {int(step_index.max())} but there are {num_steps} "
                         f"steps; step indices must lie in [-1, {num_steps})")
    counted = step_index >= 0
    if step_mask is not None:
        counted = counted & (broadcast_to_tokens(step_mask.astype(logp.dtype), step_index) > 0)
    _checks.finite_where(fn, "logp", logp, counted)
    _checks.finite_where(fn, "old_logp", old_logp, counted)
    return logp, old_logp, step_index


def _step_log_ratio(logp, old_logp, step_index, num_steps):
    """Token log-ratios (0 off action tokens), mean log-ratio per step and tokens per step."""
    action = step_index >= 0
    token_log_ratio = jnp.where(action, logp, 0.0) - jnp.where(action, old_logp, 0.0)
    sums = step_rewards_from_tokens(token_log_ratio, step_index, num_steps)
    counts = step_rewards_from_tokens(action.astype(logp.dtype), step_index, num_steps)
    return token_log_ratio, sums / jnp.maximum(counts, 1.0), counts


def step_importance_ratio(logp, old_logp, step_index, num_steps: int) -> jax.Array:
    """StepPO's length-normalised step ratio: the geometric mean of a step's token ratios.

        w_t = exp( (1/L_t) sum_{n : step_index[n] = t} (logp_n - old_logp_n) )
            = (pi_theta(a_t | s_t) / pi_old(a_t | s_t))^(1 / L_t)

    with L_t the number of action tokens of step t. A step with no action
    token gets w_t = 1. With one step per trajectory this is GSPO's sequence
    ratio s_i.

    Args:
      logp: `[B, N]` token log-probs under pi_theta; positions with
        step_index -1 may hold anything, NaN included.
      old_logp: `[B, N]` token log-probs under pi_old.
      step_index: `[B, N]` int, the step of each action token, -1 elsewhere.
      num_steps: static number of steps T.

    Returns:
      `[B, T]` step ratios.

    References:
      Wang et al., "Step-Aligned Policy Optimization for Agentic RL"
      (StepPO), arXiv 2604.18401; Zheng et al., "Group Sequence Policy
      Optimization" (GSPO), arXiv 2507.18071.

    Example: logp [[NaN, 0.1, 0.3, NaN, -0.5]], old_logp 0,
    step_index [[-1, 0, 0, -1, 1]], num_steps 2 gives
    [[exp(0.2), exp(-0.5)]] = [[1.2214, 0.6065]].
    """
    logp, old_logp, step_index = _check_token_view("step_importance_ratio", logp, old_logp,
                                                   step_index, num_steps)
    return jnp.exp(_step_log_ratio(logp, old_logp, step_index, num_steps)[1])


def step_ppo_loss(logp, old_logp, step_advantages, step_index, step_mask, *,
                  clip_low: float = 3e-4, clip_high: float = 4e-4, dual_clip: float | None = None,
                  axis_name: str | None = None) -> LossAndMetrics:
    """StepPO's policy loss: PPO clipping of one length-normalised ratio per step, mean over steps.

    With w_t = `step_importance_ratio` (its log clamped at 10, as verl's GSPO)
    and the step advantage A_t:

        l_t  = max(-A_t w_t, -A_t clip(w_t, 1 - clip_low, 1 + clip_high))
        loss = mean of l_t over valid steps

    (with the dual clip min(l_t, -c A_t) for A_t < 0 when dual_clip = c). A
    valid step has step_mask True and at least one action token. This is
    verl's GSPO loss with `seq-mean-token-mean` over step rows, one row per
    step (StepPO's configuration).

    verl computes it at the token level with a stop-gradient trick: every
    token n of step t gets s_n = sg[w_t] * pi_theta(y_n) / sg[pi_theta(y_n)],
    equal to w_t in value, and the token losses are averaged per row then over
    rows. Its gradient is -A_t sg[w_t] (1/L_t) sum_n grad logp_n on an
    unclipped step and 0 on a clipped one, which is exactly the gradient of
    l_t above, since grad w_t = w_t (1/L_t) sum_n grad logp_n. Both forms give
    the same loss and the same gradient (tested with `jax.grad`).

    Args:
      logp: `[B, N]` token log-probs under pi_theta (differentiated);
        positions with step_index -1 may hold anything, NaN included.
      old_logp: `[B, N]` token log-probs under pi_old (held constant).
      step_advantages: `[B, T]` one advantage per step (StepPO's step GAE,
        whitened over valid steps by the caller).
      step_index: `[B, N]` int, the step of each action token, -1 elsewhere.
      step_mask: `[B, T]` bool, True on real steps; masked steps (and their
        tokens) are left out and may hold anything.
      clip_low, clip_high: clip range of the step ratio. Defaults 3e-4 /
        4e-4, GSPO's values used by StepPO's scripts.
      dual_clip: c > 1 or None (default; verl's GSPO loss has no dual clip).
      axis_name: mesh axis to reduce over (inside `shard_map`), or None.

    Returns:
      `(loss, metrics)`: scalar loss (0 when no step is valid) and scalars:
      clip_fraction and dual_clip_fraction over valid steps, ratio_mean,
      ratio_min and ratio_max of w_t over valid steps, and ppo_kl and
      approx_kl (k1 and k3, as in `ppo_clip_loss`) over the action tokens of
      valid steps.

    References:
      Wang et al., "Step-Aligned Policy Optimization for Agentic RL"
      (StepPO), arXiv 2604.18401; Zheng et al., "Group Sequence Policy
      Optimization" (GSPO), arXiv 2507.18071.

    Notes:
      verl's GSPO reports its clip fraction over tokens; here it is over
      steps (the unit being clipped). StepPO's scripts set `clip_ratio_c=10`,
      which verl's GSPO loss ignores; hence no dual clip by default. To run on
      step rows `[R, L]` (one row per step), pass step_index = where(mask, 0, -1),
      step_advantages `[R, 1]` and step_mask `[R, 1]`.

    Example (clip 0.2; step log-ratios 0.2 and -0.5, advantages 1 and -1):

      >>> loss, metrics = step_ppo_loss(
      ...     jnp.array([[jnp.nan, 0.1, 0.3, jnp.nan, -0.5]]), jnp.zeros((1, 5)),
      ...     jnp.array([[1., -1.]]), jnp.array([[-1, 0, 0, -1, 1]]), jnp.array([[True, True]]),
      ...     clip_low=0.2, clip_high=0.2)
      >>> loss    # ratios 1.2214 and 0.6065 both clipped: (-1.2 + 0.8) / 2
      -0.2
      >>> metrics["clip_fraction"]
      1.0
    """
    fn = "step_ppo_loss"
    check_clip(fn, clip_low, clip_high, dual_clip)
    step_advantages = _checks.float_array(fn, "step_advantages", step_advantages, rank=2)
    step_mask = _checks.bool_array(fn, "step_mask", step_mask, rank=2)
    _checks.same_shape(fn, "[B, T]", step_advantages=step_advantages, step_mask=step_mask)
    num_steps = step_advantages.shape[1]
    step_index = _checks.int_array(fn, "step_index", step_index, rank=2)
    if step_index.shape[0] != step_advantages.shape[0]:
        raise ValueError(f"{fn}: step_index has shape {tuple(step_index.shape)} but step_advantages "
                         f"has shape {tuple(step_advantages.shape)}; both need the same B")
    logp, old_logp, step_index = _check_token_view(fn, logp, old_logp, step_index, num_steps,
                                                   step_mask)
    _checks.finite_where(fn, "step_advantages", step_advantages, step_mask)

    token_log_ratio, log_ratio, counts = _step_log_ratio(
        logp, jax.lax.stop_gradient(old_logp), step_index, num_steps)
    valid = step_mask & (counts > 0)
    log_ratio = jnp.minimum(jnp.where(valid, log_ratio, 0.0), LOG_STEP_RATIO_MAX)
    advantages = jnp.where(valid, jax.lax.stop_gradient(step_advantages), 0.0)
    ratio, losses, clipped, dual_clipped = clipped_surrogate(log_ratio, advantages, clip_low,
                                                             clip_high, dual_clip)
    loss = aggregate(losses, valid, "token-mean", None, axis_name)

    tokens = broadcast_to_tokens(valid.astype(logp.dtype), step_index) > 0
    mean, low, high = masked_stats(ratio, valid, axis_name)
    metrics = {
        "clip_fraction": masked_fraction(clipped, valid, axis_name),
        "dual_clip_fraction": masked_fraction(dual_clipped, valid, axis_name),
        "ppo_kl": masked_stats(-token_log_ratio, tokens, axis_name)[0],
        "approx_kl": masked_stats(jnp.expm1(token_log_ratio) - token_log_ratio, tokens,
                                  axis_name)[0],
        "ratio_mean": mean,
        "ratio_min": low,
        "ratio_max": high,
    }
    return loss, metrics
