"""Token-level clipped policy losses: PPO (clip-higher, dual clip) and AReaL's decoupled PPO.

Both take token log-probs `[B, N]` (or step rows `[R, L]`), compute one
surrogate loss per token and reduce it with `agg_loss`. Gradients flow only
through `logp`: old, proximal and behaviour log-probs and the advantages are
held constant (`stop_gradient`), as in rlax's `clipped_surrogate_pg_loss`.
Masked positions may hold anything, NaN included: they are read only through
`jnp.where`, before any exponential, so neither the loss nor its gradient
sees them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from stepcredit.advantages import _checks
from stepcredit.losses.aggregate import Agg, aggregate, check_agg, masked_fraction, masked_stats

LossAndMetrics = tuple[jax.Array, dict[str, jax.Array]]

# verl clamps log(pi / pi_old) to [-20, 20] before the exponential.
LOG_RATIO_BOUND = 20.0


def check_clip(fn: str, clip_low, clip_high, dual_clip) -> None:
    """Raises for concrete clip ranges outside their domains (skipped on tracers)."""
    if _checks.is_concrete(clip_low) and not 0.0 <= _checks.number(fn, "clip_low", clip_low) <= 1.0:
        raise ValueError(f"{fn}: clip_low={float(clip_low)} is outside [0, 1]; the ratio is "
                         f"clipped to [1 - clip_low, 1 + clip_high]")
    if (_checks.is_concrete(clip_high)
            and not 0.0 <= _checks.number(fn, "clip_high", clip_high) < float("inf")):
        raise ValueError(f"{fn}: clip_high={float(clip_high)} must be finite and >= 0")
    if (dual_clip is not None and _checks.is_concrete(dual_clip)
            and not _checks.number(fn, "dual_clip", dual_clip) > 1.0):
        raise ValueError(f"{fn}: dual_clip={float(dual_clip)}; the dual-clip constant c must be > 1 "
                         f"(arXiv 1912.09729), or None for no dual clip")


def check_token_inputs(fn: str, mask, **arrays) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Float `[B, N]` arrays and a bool mask of one shape, finite at valid positions."""
    mask = _checks.bool_array(fn, "mask", mask, rank=2)
    arrays = {name: _checks.float_array(fn, name, x, rank=2) for name, x in arrays.items()}
    _checks.same_shape(fn, "[B, N]", **arrays, mask=mask)
    for name, x in arrays.items():
        _checks.finite_where(fn, name, x, mask)
    return mask, arrays


def clipped_surrogate(log_ratio, advantages, clip_low, clip_high, dual_clip):
    """Per-position PPO loss max(-A r, -A clip(r)), with the dual clip for A < 0.

    Returns (ratio, loss, clipped, dual_clipped); `clipped` is verl's
    `pg_losses2 > pg_losses1`, `dual_clipped` its `pg_clipfrac_lower` flag.
    """
    ratio = jnp.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped_loss = -advantages * jnp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high)
    loss = jnp.maximum(unclipped, clipped_loss)
    clipped = clipped_loss > unclipped
    if dual_clip is None:
        return ratio, loss, clipped, jnp.zeros_like(clipped)
    floor = -advantages * dual_clip
    negative = advantages < 0
    dual_clipped = negative & (loss > floor)
    return ratio, jnp.where(negative, jnp.minimum(loss, floor), loss), clipped, dual_clipped


def ratio_metrics(log_ratio, ratio, clipped, dual_clipped, mask, axis_name) -> dict[str, jax.Array]:
    """Clip fractions, KL estimates and ratio statistics over valid positions."""
    mean, low, high = masked_stats(ratio, mask, axis_name)
    return {
        "clip_fraction": masked_fraction(clipped, mask, axis_name),
        "dual_clip_fraction": masked_fraction(dual_clipped, mask, axis_name),
        "ppo_kl": masked_stats(-log_ratio, mask, axis_name)[0],
        "approx_kl": masked_stats(jnp.expm1(log_ratio) - log_ratio, mask, axis_name)[0],
        "ratio_mean": mean,
        "ratio_min": low,
        "ratio_max": high,
    }


def _held(x, mask):
    return jnp.where(mask, jax.lax.stop_gradient(x), 0.0)


def ppo_clip_loss(logp, old_logp, advantages, mask, *, clip_low: float = 0.2,
                  clip_high: float = 0.2, dual_clip: float | None = None, agg: Agg = "token-mean",
                  max_response_length=None, axis_name: str | None = None) -> LossAndMetrics:
    """PPO's clipped surrogate loss on tokens, with DAPO's clip-higher and an optional dual clip.

    With r = exp(logp - old_logp) per token (log-ratio clamped to [-20, 20]):

        l = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))
        l = min(l, -A c)      where A < 0, if dual_clip = c > 1 is given

    and the loss is `agg_loss(l, mask, agg=agg)`. clip_low = clip_high = eps is
    PPO; clip_high > clip_low is DAPO's clip-higher (0.2 / 0.28). The dual
    clip bounds the loss of a negative-advantage token at c |A|, however large
    its ratio. With logp = old_logp and token-mean, the loss is the negated
    mean advantage over valid tokens.

    Args:
      logp: `[B, N]` log pi_theta of the sampled tokens (differentiated).
      old_logp: `[B, N]` log pi_old, the policy that sampled the batch.
      advantages: `[B, N]` token advantages (step advantages broadcast to
        their action tokens, `broadcast_to_tokens`).
      mask: `[B, N]` bool, True on action tokens; observation, prompt and
        padding tokens are excluded and may hold anything, NaN included.
      clip_low, clip_high: clip range; clip_low in [0, 1], clip_high >= 0.
        Defaults 0.2 / 0.2 (PPO).
      dual_clip: c > 1, or None (default) for no dual clip (verl's
        `clip_ratio_c`, default 3 there).
      agg: aggregation mode of `agg_loss`; default "token-mean" (DAPO).
      max_response_length: constant L_max for "seq-mean-token-sum-norm".
      axis_name: mesh axis to reduce over (inside `shard_map`), or None.

    Returns:
      `(loss, metrics)`: scalar loss and a dict of scalars over valid tokens:
      clip_fraction (verl's `pg_clipfrac`), dual_clip_fraction
      (`pg_clipfrac_lower`), ppo_kl (mean of old_logp - logp, verl's k1
      estimate), approx_kl (mean of k3 = (r - 1) - log r, Schulman's
      low-variance estimate of KL(pi_old || pi_theta)), ratio_mean,
      ratio_min, ratio_max. All are 0 when the mask is all False.

    References:
      Schulman et al., "Proximal Policy Optimization Algorithms", arXiv
      1707.06347; Ye et al., "Mastering Complex Control in MOBA Games with
      Deep Reinforcement Learning" (dual clip), arXiv 1912.09729; Yu et al.,
      "DAPO", arXiv 2503.14476 (clip-higher, token-mean); Liu et al.,
      "Understanding R1-Zero-Like Training" (Dr. GRPO), arXiv 2503.20783.

    Notes:
      Reproduces verl's `compute_policy_loss_vanilla` (log-ratio clamp, clip
      and dual-clip flags) with its `agg_loss`. verl always applies the dual
      clip, with `clip_ratio_c` = 3: pass dual_clip=3.0 to reproduce it; the
      default None is the paper's PPO (and DAPO's) objective.

    Example (clip 0.2, token-mean; ratios 1.5, 0.5, 1.1; the fourth token masked):

      >>> loss, metrics = ppo_clip_loss(
      ...     jnp.log(jnp.array([[1.5, 0.5, 1.1, jnp.nan]])), jnp.zeros((1, 4)),
      ...     jnp.array([[1., 1., -2., 5.]]), jnp.array([[True, True, True, False]]))
      >>> loss                      # (-1.2 - 0.5 + 2.2) / 3
      0.16667
      >>> metrics["clip_fraction"]  # only the first token is clipped
      0.33333
    """
    fn = "ppo_clip_loss"
    check_clip(fn, clip_low, clip_high, dual_clip)
    check_agg(fn, agg, max_response_length)
    mask, arrays = check_token_inputs(fn, mask, logp=logp, old_logp=old_logp, advantages=advantages)
    log_ratio = jnp.clip(jnp.where(mask, arrays["logp"], 0.0) - _held(arrays["old_logp"], mask),
                         -LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    ratio, losses, clipped, dual_clipped = clipped_surrogate(
        log_ratio, _held(arrays["advantages"], mask), clip_low, clip_high, dual_clip)
    loss = aggregate(losses, mask, agg, max_response_length, axis_name)
    metrics = ratio_metrics(log_ratio, ratio, clipped, dual_clipped, mask, axis_name)
    return loss, metrics


def decoupled_ppo_loss(logp, prox_logp, behav_logp, advantages, mask, *, clip_low: float = 0.2,
                       clip_high: float = 0.2, dual_clip: float | None = None,
                       behav_weight_cap: float | None = None, agg: Agg = "token-mean",
                       max_response_length=None, axis_name: str | None = None) -> LossAndMetrics:
    """AReaL's decoupled PPO loss: clip against a proximal policy, reweight for the behaviour policy.

    Three policies: pi_behav sampled the tokens (possibly stale), pi_prox is
    the trust-region anchor (recent log-probs recomputed by the trainer) and
    pi_theta is trained. Per token, with the PPO loss l(r, A) of
    `ppo_clip_loss`:

        r = pi_theta / pi_prox,   w = pi_prox / pi_behav   (no gradient)
        l_dec = w * l(r, A)       on tokens with w <= behav_weight_cap, 0 elsewhere

    reduced with `agg_loss` over `mask`. With pi_prox = pi_behav, w = 1 and it
    is `ppo_clip_loss(logp, prox_logp, ...)`.

    Args:
      logp: `[B, N]` log pi_theta (differentiated).
      prox_logp: `[B, N]` log pi_prox, the proximal policy.
      behav_logp: `[B, N]` log pi_behav, the policy that generated the tokens.
      advantages: `[B, N]` token advantages.
      mask: `[B, N]` bool, True on action tokens; other positions may hold NaN.
      clip_low, clip_high, dual_clip: as in `ppo_clip_loss` (AReaL's
        `eps_clip`, `eps_clip_higher`, `c_clip`).
      behav_weight_cap: tokens whose w exceeds it are masked out (their loss
        is 0); must be > 1; None (default) keeps every token. Masking the
        token, rather than clipping w, follows AReaL.
      agg, max_response_length, axis_name: as in `ppo_clip_loss`.

    Returns:
      `(loss, metrics)`: the metrics of `ppo_clip_loss` for r, plus
      behav_weight_mean and behav_weight_max (w over valid tokens, before the
      cap), behav_capped_fraction (valid tokens with w over the cap) and
      behav_approx_kl (mean k3 = (w - 1) - log w, an estimate of
      KL(pi_behav || pi_prox)).

    References:
      Fu et al., "AReaL: A Large-Scale Asynchronous Reinforcement Learning
      System for Language Reasoning", arXiv 2505.24298
      (`areal/utils/functional.py::ppo_actor_loss_fn`).

    Notes:
      As in AReaL's code, a capped token keeps its place in the denominator
      (token-mean divides by the number of valid tokens, capped or not); it
      only contributes 0. Both log-ratios are clamped to [-20, 20] like
      verl's (AReaL does not clamp); this only changes ratios above e^20.

    Example (clip 0.2; r = 1.1 on both tokens, w = 2 and 0.5, cap 1.5):

      >>> loss, metrics = decoupled_ppo_loss(
      ...     jnp.log(jnp.array([[1.1, 1.1]])), jnp.zeros((1, 2)),
      ...     jnp.log(jnp.array([[0.5, 2.0]])), jnp.ones((1, 2)), jnp.ones((1, 2), bool),
      ...     behav_weight_cap=1.5)
      >>> loss    # (0 + 0.5 * -1.1) / 2; without the cap (2 * -1.1 + 0.5 * -1.1) / 2 = -1.375
      -0.275
      >>> metrics["behav_capped_fraction"]
      0.5
    """
    fn = "decoupled_ppo_loss"
    check_clip(fn, clip_low, clip_high, dual_clip)
    check_agg(fn, agg, max_response_length)
    if behav_weight_cap is not None and _checks.is_concrete(behav_weight_cap) \
            and not float(behav_weight_cap) > 1.0:
        raise ValueError(f"{fn}: behav_weight_cap={float(behav_weight_cap)}; it must be > 1 (AReaL), "
                         f"or None for no cap")
    mask, arrays = check_token_inputs(fn, mask, logp=logp, prox_logp=prox_logp,
                                      behav_logp=behav_logp, advantages=advantages)
    prox = _held(arrays["prox_logp"], mask)
    log_ratio = jnp.clip(jnp.where(mask, arrays["logp"], 0.0) - prox, -LOG_RATIO_BOUND,
                         LOG_RATIO_BOUND)
    log_weight = jnp.clip(prox - _held(arrays["behav_logp"], mask), -LOG_RATIO_BOUND,
                          LOG_RATIO_BOUND)
    weight = jnp.exp(log_weight)
    capped = jnp.zeros_like(mask) if behav_weight_cap is None else weight > behav_weight_cap
    ratio, losses, clipped, dual_clipped = clipped_surrogate(
        log_ratio, _held(arrays["advantages"], mask), clip_low, clip_high, dual_clip)
    losses = jnp.where(mask & ~capped, weight * losses, 0.0)
    loss = aggregate(losses, mask, agg, max_response_length, axis_name)
    metrics = ratio_metrics(log_ratio, ratio, clipped, dual_clipped, mask, axis_name)
    weight_mean, _, weight_max = masked_stats(weight, mask, axis_name)
    metrics.update(
        behav_weight_mean=weight_mean,
        behav_weight_max=weight_max,
        behav_capped_fraction=masked_fraction(capped, mask, axis_name),
        behav_approx_kl=masked_stats(jnp.expm1(log_weight) - log_weight, mask, axis_name)[0],
    )
    return loss, metrics
