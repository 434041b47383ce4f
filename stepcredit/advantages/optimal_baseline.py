"""verl's optimal token baseline (OTB): a per-token, variance-weighted group baseline.

Within a group of trajectories of one task, the baseline at token position n is
the average of the returns at n weighted by each trajectory's accumulated
score-function energy W_n (a proxy for the squared norm of the policy gradient
up to n), so that trajectories whose gradients are large weigh more: the
baseline that minimises the variance of the policy-gradient estimate when W_n
is the true squared score norm. Group statistics are segment sums over
(group, position) pairs with static shapes, so everything compiles.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from stepcredit.advantages import _checks, native
from stepcredit.advantages.group import SINGLETONS, _check_option, _dense_ids
from stepcredit.advantages.recurrence import reverse_linear_recurrence

ALIGNS = ("position", "action")


def _check_inputs(fn, scores, group_ids, action_mask, ref_logp, sum_pi_squared):
    scores = _checks.float_array(fn, "scores", scores, rank=1)
    group_ids = _checks.int_array(fn, "group_ids", group_ids, rank=1)
    _checks.leading_dim(fn, scores.shape[0], group_ids=group_ids)
    action_mask = _checks.bool_array(fn, "action_mask", action_mask, rank=2)
    if action_mask.shape[0] != scores.shape[0]:
        raise ValueError(f"{fn}: action_mask has shape {tuple(action_mask.shape)} but scores has "
                         f"shape {tuple(scores.shape)}; action_mask must be [B, N] with B = "
                         f"{scores.shape[0]}")
    _checks.finite_where(fn, "scores", scores)
    arrays = {}
    for name, x in (("ref_logp", ref_logp), ("sum_pi_squared", sum_pi_squared)):
        if x is not None:
            x = _checks.float_array(fn, name, x, rank=2)
            _checks.same_shape(fn, "[B, N]", action_mask=action_mask, **{name: x})
            _checks.finite_where(fn, name, x, action_mask)
        arrays[name] = x
    if sum_pi_squared is not None and ref_logp is None:
        raise ValueError(f"{fn}: sum_pi_squared is given but ref_logp is None; the score norm "
                         "1 - 2 pi_n + sum pi^2 needs both")
    return scores, group_ids, action_mask, arrays["ref_logp"], arrays["sum_pi_squared"]


def _score_energy(action_mask, ref_logp, sum_pi_squared):
    """w_n: 1 - 2 pi_n + sum pi^2 (verl), 1 - pi_n (sum pi^2 estimated by pi_n), or 1."""
    if ref_logp is None:
        return action_mask.astype(jnp.float32)
    pi = jnp.exp(jnp.minimum(jnp.where(action_mask, ref_logp, 0.0), 0.0))
    if sum_pi_squared is None:
        w = 1.0 - pi
    else:
        w = 1.0 - 2.0 * pi + jnp.where(action_mask, sum_pi_squared, 0.0)
    return jnp.where(action_mask, w, 0.0)


def _running_sum(x: jax.Array) -> jax.Array:
    """W: the running sum of `[B, N]` x along each row, in token order.

    XLA:CPU lowers `cumsum` to a windowed reduction, several times slower than one
    pass over the rows; on CPU, for float32, the compiled recurrence
    y_n = x_n + 1 * y_{n+1} (`reverse_linear_recurrence`) runs over the reversed rows
    instead: one pass, each row summed in token order, as the reference loop sums.
    Elsewhere, for other dtypes and where the kernel is not built, `cumsum`.
    """
    def cumsum(x):
        return jnp.cumsum(x, axis=1)

    if x.size == 0 or x.dtype != jnp.float32:
        return cumsum(x)

    def by_recurrence(x):
        reversed_rows = x[:, ::-1]
        return reverse_linear_recurrence(reversed_rows, jnp.ones_like(reversed_rows),
                                         jnp.zeros(x.shape[:1], x.dtype))[:, ::-1]

    return native.on_cpu(by_recurrence, cumsum, x)


def optimal_token_baseline(scores, group_ids, action_mask, ref_logp=None, *,
                           sum_pi_squared=None, eps: float = 1e-8, align: str = "position",
                           handle_zero_tail: bool = False, singleton: str = "raw",
                           num_groups: int | None = None) -> jax.Array:
    """verl's optimal-token-baseline advantages: return minus a W-weighted group mean per token.

    For trajectory i of group g, at action tokens n (mask m_{i,n}):

        G_{i,n} = s_i                                   (outcome return-to-go)
        w_{i,n} = 1 - 2 pi_{i,n} + sum_v pi_{i,n}(v)^2  (||grad log pi||^2 of the softmax
                                                         logits: ||e_a - pi||^2)
        W_{i,n} = sum_{n' <= n} m_{i,n'} w_{i,n'}       (cumulative path-variance proxy)
        b_{g,n} = sum_{j in g} m_{j,n} W_{j,n} G_{j,n} / (sum_{j in g} m_{j,n} W_{j,n} + eps)
        A_{i,n} = (G_{i,n} - b_{g(i),n}) m_{i,n}

    With all W equal, b is the plain group mean of the returns at n (GRPO's
    baseline without the std, `grpo(std="none")`, where every trajectory has
    a token at n). `align="position"` compares tokens at the same column n
    (verl's `optimal_token_baseline`); `align="action"` compares each
    trajectory's k-th action token, skipping observation tokens (verl's
    `tir_optimal_token_baseline`, for multi-turn rows). A singleton group
    (one trajectory with action tokens) has no baseline: A = G
    (singleton="raw", verl), or 0 with singleton="zero". With
    `handle_zero_tail`, a group's uniquely longest trajectory gets baseline 0
    beyond the second-longest length L_2 (positions or action ranks >= L_2).

    Args:
      scores: `[B]` trajectory (outcome) scores s_i.
      group_ids: `[B]` int task group of each trajectory; arbitrary values
        unless `num_groups` is given, then in [0, num_groups).
      action_mask: `[B, N]` bool, True on action tokens; observation, prompt
        and padding tokens are excluded (they get 0).
      ref_logp: optional `[B, N]` log-probs of the sampled tokens under the
        policy that sampled the batch (verl's `old_log_probs`); masked entries
        may hold anything. None gives w = 1 (W counts action tokens).
      sum_pi_squared: optional `[B, N]` sum over the vocabulary of pi^2 at
        each token (verl's `sum_pi_squared`); None estimates it by pi_n.
      eps: added to the denominator (verl: 1e-8).
      align: "position" or "action", as above.
      handle_zero_tail: the zero-tail rule above (verl: False for OTB, True
        for the TIR variant).
      singleton: "raw" (verl) or "zero" for a one-trajectory group.
      num_groups: static number of groups, or None to remap ids.

    Returns:
      `[B, N]` advantages, 0 at masked tokens.

    Raises:
      ValueError / TypeError: wrong rank, shape or dtype (naming the
        argument); unknown align or singleton; a negative eps;
        sum_pi_squared without ref_logp; called eagerly, NaN or inf in scores
        or at an action token of ref_logp or sum_pi_squared.

    References:
      verl 0.9, `verl/trainer/ppo/core_algos.py`:
      `compute_optimal_token_baseline_advantage` (registered as
      "optimal_token_baseline") and `compute_multi_turn_optimal_token_baseline_advantage`
      ("tir_optimal_token_baseline"). The variance-minimising baseline
      b = E[G ||s||^2] / E[||s||^2] is Weaver and Tao, "The Optimal Reward
      Baseline for Gradient-Based Reinforcement Learning", arXiv 1301.2315.

    Notes:
      verl reads `sum_pi_squared` (computed from the full logits by the
      actor) and `old_log_probs`; `CreditInputs` holds the latter
      (`ref_logp`) but not the former, so the registry entry estimates
      sum_v pi(v)^2 = E_{a~pi}[pi_a] by the sampled token's pi_n, giving
      w = 1 - pi_n (unbiased for verl's w given the state); pass
      `sum_pi_squared` to reproduce verl exactly. verl's returns are the
      reverse cumulative sum of its token rewards; here the return is the
      outcome score at every action token, which is verl's when the reward
      sits on the last action token (its outcome setting). verl counts rows
      without response tokens as group members; here such rows are padding
      and left out. Its optional `rollout_is_weights` (w scaled by rho^2) are
      not supported. Under align="position" verl's zero tail also uses column
      indices, as here.

    Example (one group; w = 1, so W counts action tokens; the second
    trajectory has a masked token at n = 1):

      >>> optimal_token_baseline(jnp.array([1., 0.]), jnp.array([0, 0]),
      ...                        jnp.array([[1, 1, 1], [1, 0, 1]], bool))
      [[0.5, 0., 0.4], [-0.5, 0., -0.6]]

    At n = 0 both W are 1: b = 0.5. At n = 1 only the first trajectory is
    valid: b = 1 (A = 0). At n = 2, W = 3 and 2: b = 3 / 5 = 0.6, and with
    align="action" the second trajectory's token 2 is its action token 1 (W = 2),
    compared with the first's token 1 (W = 2): b = 0.5, so A = +-0.5 there and
    the first's token 2 (alone at rank 2) gets 0.
    """
    fn = "optimal_token_baseline"
    _check_option(fn, "align", align, ALIGNS)
    _check_option(fn, "singleton", singleton, SINGLETONS)
    _checks.finite_nonnegative(fn, eps=eps)
    scores, group_ids, action_mask, ref_logp, sum_pi_squared = _check_inputs(
        fn, scores, group_ids, action_mask, ref_logp, sum_pi_squared)
    dense = _dense_ids(fn, group_ids, num_groups, None)
    batch, num_tokens = action_mask.shape
    dtype = scores.dtype
    mask = action_mask.astype(dtype)
    returns = scores[:, None] * mask
    energy = _running_sum(_score_energy(action_mask, ref_logp, sum_pi_squared).astype(dtype) * mask)
    weights = energy * mask
    if align == "position":
        index = jnp.broadcast_to(jnp.arange(num_tokens), action_mask.shape)
        # The segment of token (i, n) is (g(i), n): summing whole rows per group gives every
        # column's sums at once, and XLA scatters one row per trajectory instead of one
        # element per token (the same additions in the same order).
        numerator = jax.ops.segment_sum(weights * returns, dense.ids, dense.num_groups)
        denominator = jax.ops.segment_sum(weights, dense.ids, dense.num_groups) + eps
        baseline = (numerator / denominator)[dense.ids]
    else:
        index = jnp.maximum(jnp.cumsum(action_mask.astype(jnp.int32), axis=1) - 1, 0)
        segments = (dense.ids[:, None] * num_tokens + index).reshape(-1)
        num_segments = dense.num_groups * max(num_tokens, 1)
        numerator = jax.ops.segment_sum((weights * returns).reshape(-1), segments, num_segments)
        denominator = jax.ops.segment_sum(weights.reshape(-1), segments, num_segments) + eps
        baseline = (numerator / denominator)[segments].reshape(action_mask.shape)

    # `any`, not a count of the tokens: XLA:CPU reduces the bool mask as it is, where a sum
    # first writes it out as int32.
    members = jnp.any(action_mask, axis=1)
    count = jax.ops.segment_sum(members.astype(jnp.int32), dense.ids, dense.num_groups)[dense.ids]
    if handle_zero_tail:
        lengths = jnp.sum(action_mask, axis=1).astype(jnp.int32)
        longest = jax.ops.segment_max(jnp.where(members, lengths, -1), dense.ids,
                                      dense.num_groups)[dense.ids]
        at_longest = jax.ops.segment_sum((members & (lengths == longest)).astype(jnp.int32),
                                         dense.ids, dense.num_groups)[dense.ids]
        second = jax.ops.segment_max(jnp.where(members & (lengths < longest), lengths, -1),
                                     dense.ids, dense.num_groups)[dense.ids]
        tail = (members & (lengths == longest) & (at_longest == 1) & (count >= 2))[:, None] & (
            index >= second[:, None])
        baseline = jnp.where(tail, 0.0, baseline)
    lone = (count == 1)[:, None]
    advantages = jnp.where(lone, returns if singleton == "raw" else 0.0, returns - baseline)
    return jnp.where(action_mask, advantages, 0.0)
