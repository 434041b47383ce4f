"""Reducing a per-token loss matrix to a scalar, verl's `agg_loss` modes.

Every loss of `stepcredit.losses` computes a `[B, N]` matrix (one entry per
token, or `[R, L]` over step rows) and reduces it here. With `axis_name`
(inside `shard_map`), the sums and counts are `psum`-ed over that mesh axis,
so the sharded loss equals the loss of the whole batch on one device.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp

from stepcredit.advantages import _checks

Agg = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
AGG_MODES: tuple[str, ...] = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
                              "seq-mean-token-sum-norm")


def check_agg(fn: str, agg: str, max_response_length) -> None:
    """Raises unless `agg` is a known mode and the norm mode has its constant."""
    if agg not in AGG_MODES:
        raise ValueError(f"{fn}: agg={agg!r} is not one of {', '.join(map(repr, AGG_MODES))}")
    if agg == "seq-mean-token-sum-norm":
        if max_response_length is None:
            raise ValueError(f"{fn}: agg='seq-mean-token-sum-norm' needs max_response_length, the "
                             f"configured maximum response length (a constant, Dr. GRPO)")
        if _checks.is_concrete(max_response_length) and not float(max_response_length) > 0:
            raise ValueError(f"{fn}: max_response_length={max_response_length!r}; it must be > 0")


def psum(x: jax.Array, axis_name: str | None) -> jax.Array:
    """`jax.lax.psum` over `axis_name`, or `x` itself when it is None."""
    return x if axis_name is None else jax.lax.psum(x, axis_name)


def aggregate(loss_mat: jax.Array, mask: jax.Array, agg: str, max_response_length,
              axis_name: str | None) -> jax.Array:
    """`agg_loss` without the boundary checks (for callers that already made them)."""
    dtype = loss_mat.dtype
    clean = jnp.where(mask, loss_mat, 0.0)
    if agg == "token-mean":
        count = psum(jnp.sum(mask, dtype=dtype), axis_name)
        return psum(jnp.sum(clean), axis_name) / jnp.maximum(count, 1.0)
    tokens = jnp.sum(mask, axis=-1, dtype=dtype)
    rows = jnp.sum(clean, axis=-1)
    if agg == "seq-mean-token-mean":
        rows = rows / jnp.maximum(tokens, 1.0)
    has_tokens = tokens > 0
    count = psum(jnp.sum(has_tokens, dtype=dtype), axis_name)
    loss = psum(jnp.sum(jnp.where(has_tokens, rows, 0.0)), axis_name) / jnp.maximum(count, 1.0)
    if agg == "seq-mean-token-sum-norm":
        loss = loss / max_response_length
    return loss


def masked_stats(x: jax.Array, mask: jax.Array, axis_name: str | None):
    """(mean, min, max) of `x` over valid positions, all 0 when none is valid; no gradient."""
    x = jax.lax.stop_gradient(x)
    dtype = x.dtype
    count = psum(jnp.sum(mask, dtype=dtype), axis_name)
    mean = psum(jnp.sum(jnp.where(mask, x, 0.0)), axis_name) / jnp.maximum(count, 1.0)
    low = jnp.min(jnp.where(mask, x, jnp.inf))
    high = jnp.max(jnp.where(mask, x, -jnp.inf))
    if axis_name is not None:
        low, high = jax.lax.pmin(low, axis_name), jax.lax.pmax(high, axis_name)
    empty = count == 0
    return mean, jnp.where(empty, 0.0, low), jnp.where(empty, 0.0, high)


def masked_fraction(flags: jax.Array, mask: jax.Array, axis_name: str | None) -> jax.Array:
    """Fraction of valid positions where `flags` holds (0 when none is valid)."""
    count = psum(jnp.sum(mask, dtype=jnp.float32), axis_name)
    hits = psum(jnp.sum(flags & mask, dtype=jnp.float32), axis_name)
    return hits / jnp.maximum(count, 1.0)


def agg_loss(loss_mat, mask, *, agg: Agg = "token-mean", max_response_length=None,
             axis_name: str | None = None) -> jax.Array:
    """Reduces a per-token loss matrix to a scalar, as verl's `agg_loss` does.

    With m_{b,n} the mask, n_b = sum_n m_{b,n} the valid tokens of row b and
    S the set of rows with n_b > 0 (fully masked rows are left out):

        token-mean              sum_{b,n} m l / sum_{b,n} m            (DAPO)
        seq-mean-token-sum      (1/|S|) sum_{b in S} sum_n m l
        seq-mean-token-mean     (1/|S|) sum_{b in S} (1/n_b) sum_n m l (GRPO, GSPO)
        seq-mean-token-sum-norm (1/|S|) sum_{b in S} sum_n m l / L_max (Dr. GRPO)

    A "seq" is a row: a whole response, or one agent step when the rows are
    step rows (one step's prompt tokens followed by its action tokens). An
    all-False mask gives 0.

    Args:
      loss_mat: `[B, N]` per-token losses (or `[R, L]` over step rows); masked
        positions may hold anything, NaN included.
      mask: `[B, N]` bool, True on the tokens that enter the loss.
      agg: one of the four modes above.
      max_response_length: L_max, the configured maximum response length, a
        constant through training; required by "seq-mean-token-sum-norm".
      axis_name: mesh axis to `psum` sums and counts over (inside `shard_map`,
        the batch sharded along B), or None on one device.

    Returns:
      Scalar loss.

    References:
      verl `trainer/ppo/core_algos.py::agg_loss`; Yu et al., "DAPO: An
      Open-Source LLM Reinforcement Learning System at Scale", arXiv 2503.14476
      (token-mean); Liu et al., "Understanding R1-Zero-Like Training: A
      Critical Perspective" (Dr. GRPO), arXiv 2503.20783 (constant normaliser).

    Notes:
      Follows current verl: fully masked rows leave the seq-mean (older verl
      averaged over all rows, and divided by zero in seq-mean-token-mean), and
      seq-mean-token-sum-norm divides the seq-mean of token sums by
      L_max (older verl summed over rows without the seq-mean and divided by
      the padded width `loss_mask.shape[-1]`; Dr. GRPO divides by a constant,
      the configured maximum response length, so it is required here).
      verl adds 1e-8 to the
      per-row token count; here the count is floored at 1 instead, which
      changes nothing for a row with tokens. verl's `dp_size` rescaling is
      not needed: with `axis_name` the value is already the global one.

    Example: loss_mat [[1, 2, NaN], [3, NaN, NaN]], mask [[T, T, F], [T, F, F]]
    gives token-mean 2, seq-mean-token-sum 3, seq-mean-token-mean 2.25 and,
    with max_response_length 3, seq-mean-token-sum-norm 1.
    """
    fn = "agg_loss"
    check_agg(fn, agg, max_response_length)
    loss_mat = _checks.float_array(fn, "loss_mat", loss_mat, rank=2)
    mask = _checks.bool_array(fn, "mask", mask, rank=2)
    _checks.same_shape(fn, "[B, N]", loss_mat=loss_mat, mask=mask)
    return aggregate(loss_mat, mask, agg, max_response_length, axis_name)
