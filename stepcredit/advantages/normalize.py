"""Batch whitening over valid positions, kept apart from the estimators."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from stepcredit.advantages import _checks


def masked_mean(x, mask) -> jax.Array:
    """Mean of `x` over the positions where `mask` is True:

        mean = sum_{mask} x / max(|mask|, 1)      (0 when no position is valid)

    Args:
      x: `[B, T]` or `[B, N]` values (any shape matching `mask`); NaN or inf only at
        masked positions.
      mask: bool (or 0/1 integers), the same shape as `x`.

    Returns:
      A scalar.

    References:
      verl `core_algos.masked_mean` (the token-mean loss aggregation of
      DAPO, arXiv 2503.14476, uses the same mean).
    """
    fn = "masked_mean"
    x = _checks.float_array(fn, "x", x)
    mask = _checks.bool_array(fn, "mask", mask)
    _checks.same_shape(fn, "the same shape", x=x, mask=mask)
    _checks.finite_where(fn, "x", x, mask)
    return _masked_mean(x, mask)


def _masked_mean(x: jax.Array, mask: jax.Array) -> jax.Array:
    return jnp.sum(jnp.where(mask, x, 0.0)) / jnp.maximum(jnp.sum(mask), 1)


def masked_whiten(x, mask, *, unbiased: bool = True, shift_mean: bool = True,
                  eps: float = 1e-8) -> jax.Array:
    """Whitens `x` over its valid positions: (x - mean) / sqrt(var + eps).

    mean and var are taken over positions where `mask` is True; var uses
    Bessel's correction (divides by n - 1) when `unbiased`, else by n. With
    fewer than two valid positions the unbiased variance is taken as 0.
    `shift_mean=False` adds the mean back (scale only). Masked outputs are 0.

    Args:
      x: `[B, T]` or `[B, N]` values (any shape matching `mask`).
      mask: bool, same shape, True at valid positions.
      unbiased: Bessel-corrected variance (verl's `masked_whiten`) or biased.
      shift_mean: subtract the mean (True) or keep it.
      eps: added to the variance before the square root (verl: 1e-8).

    Returns:
      Whitened array, same shape, 0 at masked positions.

    References:
      verl `core_algos.masked_whiten`; StepPO (arXiv 2604.18401) whitens step
      advantages over valid steps, token-level GAE and REINFORCE++ (arXiv
      2501.03262) over valid tokens.

    Example: x [[1, 2, 3, NaN]], mask [[T, T, T, F]] gives, with the unbiased
    variance 1, [[-1, 0, 1, 0]] (to within eps).
    """
    fn = "masked_whiten"
    x = _checks.float_array(fn, "x", x)
    mask = _checks.bool_array(fn, "mask", mask)
    _checks.same_shape(fn, "the same shape", x=x, mask=mask)
    _checks.finite_where(fn, "x", x, mask)
    _checks.finite_nonnegative(fn, eps=eps)
    count = jnp.sum(mask).astype(x.dtype)
    mean = _masked_mean(x, mask)
    centered = jnp.where(mask, x - mean, 0.0)
    denominator = jnp.maximum(count - 1.0, 1.0) if unbiased else jnp.maximum(count, 1.0)
    var = jnp.sum(centered**2) / denominator
    whitened = centered * jax.lax.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return jnp.where(mask, whitened, 0.0)
