"""The critic's loss: squared error to the returns, optionally clipped around the old values."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from stepcredit.advantages import _checks
from stepcredit.losses.aggregate import Agg, aggregate, check_agg, masked_fraction, masked_stats
from stepcredit.losses.policy import LossAndMetrics, check_token_inputs


def value_loss(values, old_values, returns, mask, *, clip: float | None = None,
               agg: Agg = "token-mean", max_response_length=None,
               axis_name: str | None = None) -> LossAndMetrics:
    """Value loss 0.5 (V - R)^2, with PPO's value clipping as in verl.

    Unclipped: l = (V - R)^2. With clip = c:

        V_clip = clip(V, V_old - c, V_old + c)
        l      = max((V - R)^2, (V_clip - R)^2)

    and the loss is 0.5 * `agg_loss(l, mask, agg=agg)`. Gradients flow only
    through `values`.

    Args:
      values: `[B, N]` current critic values V (differentiated); for StepPO's
        step critic pass step values `[B, T]` with the step mask.
      old_values: `[B, N]` values V_old of the critic that computed the
        advantages; may be None when clip is None.
      returns: `[B, N]` critic targets R (e.g. `step_gae(...).returns`).
      mask: `[B, N]` bool, True where the loss applies; masked positions may
        hold anything, NaN included.
      clip: c > 0, or None (default) for no clipping (verl's `cliprange_value`).
      agg, max_response_length, axis_name: as in `agg_loss`.

    Returns:
      `(loss, metrics)` with clip_fraction (positions where the clipped error
      is the larger, verl's `vf_clipfrac`; 0 without clip), values_mean,
      returns_mean and squared_error (token mean of (V - R)^2), all over valid
      positions.

    References:
      Schulman et al., "Proximal Policy Optimization Algorithms", arXiv
      1707.06347; verl `core_algos.py::compute_value_loss`.

    Example (clip 0.2):

      >>> loss, metrics = value_loss(jnp.array([[1., 2.]]), jnp.array([[0.5, 2.]]),
      ...                            jnp.array([[2., 1.]]), jnp.ones((1, 2), bool), clip=0.2)
      >>> loss     # 0.5 * (max(1, (0.7 - 2)^2) + 1) / 2
      0.6725
      >>> metrics["clip_fraction"]
      0.5
    """
    fn = "value_loss"
    check_agg(fn, agg, max_response_length)
    if clip is not None and _checks.is_concrete(clip) and not _checks.number(fn, "clip", clip) > 0:
        raise ValueError(f"{fn}: clip={float(clip)}; it must be > 0, or None for no clipping")
    if clip is not None and old_values is None:
        raise ValueError(f"{fn}: clip={clip} needs old_values, the values of the critic that "
                         f"computed the advantages")
    arrays = {"values": values, "returns": returns}
    if old_values is not None:
        arrays["old_values"] = old_values
    mask, arrays = check_token_inputs(fn, mask, **arrays)
    predicted = jnp.where(mask, arrays["values"], 0.0)
    targets = jnp.where(mask, jax.lax.stop_gradient(arrays["returns"]), 0.0)
    errors = (predicted - targets) ** 2
    if clip is None:
        losses, clipped = errors, jnp.zeros_like(mask)
    else:
        old = jnp.where(mask, jax.lax.stop_gradient(arrays["old_values"]), 0.0)
        clipped_errors = (jnp.clip(predicted, old - clip, old + clip) - targets) ** 2
        losses, clipped = jnp.maximum(errors, clipped_errors), clipped_errors > errors
    loss = 0.5 * aggregate(losses, mask, agg, max_response_length, axis_name)
    metrics = {
        "clip_fraction": masked_fraction(clipped, mask, axis_name),
        "values_mean": masked_stats(predicted, mask, axis_name)[0],
        "returns_mean": masked_stats(targets, mask, axis_name)[0],
        "squared_error": masked_stats(errors, mask, axis_name)[0],
    }
    return loss, metrics
