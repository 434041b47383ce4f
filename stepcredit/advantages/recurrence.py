"""The linear recurrence behind GAE and discounted returns, two ways.

Every backward credit computation in this package reduces to

    y_t = x_t + c_t * y_{t+1},    y_T = y_init,

run from the last time step to the first along axis 1 of `[B, T]` arrays. It is
implemented four ways, which agree to float32 rounding:

- "auto" (the default): on CPU, for float32 arrays, a compiled kernel over the
  batch-major rows (`native.linear_recurrence`, the same numbers as
  "sequential" bit for bit) once it is built; "sequential" elsewhere;
- "sequential": a `lax.scan` over time-major arrays, one step per iteration
  (the reference path);
- "chunked": blocks of `_BLOCK` steps solved together by recursive doubling
  (log2 `_BLOCK` vectorised passes over the batch-major array), then the same
  recurrence, recursively, over the block starts (T / `_BLOCK` steps); no
  scan and no transposes, so its cost does not grow with per-step overhead;
- "associative": a `lax.associative_scan` over the affine maps `y -> c y + x`
  (logarithmic depth, for accelerators and very long sequences).

None of them divides by a product of coefficients, so c = 0 (a reset) and
products that underflow in long stretches are exact.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp

from stepcredit.advantages import native

Method = Literal["auto", "sequential", "chunked", "associative"]
METHODS = ("auto", "sequential", "chunked", "associative")
# Steps per block of the "chunked" method: 3 doubling passes per level, and each
# level shrinks the problem 8-fold.
_BLOCK = 8


def reverse_linear_recurrence(x: jax.Array, c: jax.Array, y_init: jax.Array, *,
                              method: Method = "auto") -> jax.Array:
    """Solves y_t = x_t + c_t y_{t+1} backwards in time, with y_T = y_init.

    Args:
      x: `[B, T]` inputs.
      c: `[B, T]` coefficients (a discount, or 1 to carry a value through a
        masked position, or 0 to reset).
      y_init: `[B]` value after the last time step (a bootstrap).
      method: "auto" (the compiled CPU kernel for float32 on CPU once it is
        built, else "sequential"; `recurrence_method` says which),
        "sequential" (`lax.scan` over time), "chunked" (blocks solved by
        vectorised doubling, recursively) or "associative"
        (`lax.associative_scan`). Every method has a gradient.

    Returns:
      `[B, T]` solution y.

    Example: x = [[1, 1, 1]], c = [[0.5, 0.5, 0.5]], y_init = [0] gives
    y = [[1.75, 1.5, 1.0]].
    """
    x, c, y_init = jnp.asarray(x), jnp.asarray(c), jnp.asarray(y_init)
    if method == "auto":
        return _auto(x, c, y_init)
    if method == "sequential":
        return _sequential(x, c, y_init)
    if method == "chunked":
        return _chunked(x, c, y_init)
    if method == "associative":
        return _associative(x, c, y_init)
    raise ValueError(f"reverse_linear_recurrence: method={method!r}; expected one of {METHODS}")


def recurrence_method(x, c, y_init, *, method: Method = "auto",
                      backend: str | None = None) -> str:
    """Which computation `reverse_linear_recurrence` runs for these arguments.

    Args:
      x, c, y_init: the call's arrays (or their `jax.ShapeDtypeStruct`s).
      method: the call's `method`.
      backend: the platform it will run on (default: `jax.default_backend()`).

    Returns:
      "native" (the compiled CPU kernel), or the scan's method name.
    """
    if method not in METHODS:
        raise ValueError(f"recurrence_method: method={method!r}; expected one of {METHODS}")
    if method != "auto":
        return method
    if ((backend or jax.default_backend()) != "cpu" or not _native_dtypes(x, c, y_init)
            or native.build_error()):
        return "sequential"
    return "native"


def _native_dtypes(*arrays) -> bool:
    return all(jnp.result_type(a) == jnp.float32 for a in arrays)


def _auto(x: jax.Array, c: jax.Array, y_init: jax.Array) -> jax.Array:
    if not _native_dtypes(x, c, y_init):
        return _sequential(x, c, y_init)
    return native.on_cpu(_native, _sequential, x, c, y_init)


@jax.custom_vjp
def _native(x: jax.Array, c: jax.Array, y_init: jax.Array) -> jax.Array:
    return native.linear_recurrence(x, c, y_init, reverse=True)


def _native_forward(x, c, y_init):
    y = _native(x, c, y_init)
    return y, (c, y_init, y)


def _native_backward(residuals, cotangent):
    # The adjoint of a backward recurrence runs forwards: lam_t = g_t + c_{t-1} lam_{t-1},
    # and then dx_t = lam_t, dc_t = lam_t y_{t+1}, dy_init = c_{T-1} lam_{T-1}.
    c, y_init, y = residuals
    shifted = jnp.concatenate([jnp.zeros_like(c[:, :1]), c[:, :-1]], axis=1)
    adjoint = native.linear_recurrence(cotangent, shifted, jnp.zeros_like(y_init), reverse=False)
    y_next = jnp.concatenate([y[:, 1:], y_init[:, None]], axis=1)
    return adjoint, adjoint * y_next, c[:, -1] * adjoint[:, -1]


_native.defvjp(_native_forward, _native_backward)


def _sequential(x: jax.Array, c: jax.Array, y_init: jax.Array) -> jax.Array:
    def body(y_next, xc):
        x_t, c_t = xc
        y = x_t + c_t * y_next
        return y, y

    # Time-major scan: each step touches one contiguous [B] row.
    _, y = jax.lax.scan(body, y_init, (x.T, c.T), reverse=True)
    return y.T


def _chunked(x: jax.Array, c: jax.Array, y_init: jax.Array) -> jax.Array:
    batch, length = x.shape
    if length <= _BLOCK:  # a few steps: unrolled, one fused expression per step
        y, out = y_init, [None] * length
        for t in reversed(range(length)):
            y = x[:, t] + c[:, t] * y
            out[t] = y
        return jnp.stack(out, axis=1)
    # Pad the end with identity maps (x = 0, c = 1): they carry y_init through.
    pad = -length % _BLOCK
    x = jnp.pad(x, ((0, 0), (0, pad)))
    c = jnp.pad(c, ((0, 0), (0, pad)), constant_values=1)
    # Within a block, y_k = local_k + carry_k * (y at the next block's start), where
    # local solves the block with a zero boundary and carry is the product of c
    # from k to the block's end. Doubling: after the pass with shift d, local_k and
    # carry_k cover steps k .. k + 2d - 1 of the block.
    local = x.reshape(batch, -1, _BLOCK)
    carry = c.reshape(batch, -1, _BLOCK)
    shift = 1
    while shift < _BLOCK:
        local, carry = (local + carry * _shift_left(local, shift, 0.0),
                        carry * _shift_left(carry, shift, 1.0))
        # Materialise each pass: fused, XLA would recompute the doubling tree.
        local, carry = jax.lax.optimization_barrier((local, carry))
        shift *= 2
    starts = _chunked(local[:, :, 0], carry[:, :, 0], y_init)
    after = jnp.concatenate([starts[:, 1:], y_init[:, None]], axis=1)
    y = local + carry * after[:, :, None]
    return y.reshape(batch, -1)[:, :length]


def _shift_left(a: jax.Array, shift: int, fill: float) -> jax.Array:
    """a[..., k + shift] along the last axis, `fill` past its end."""
    return jnp.concatenate([a[..., shift:], jnp.full(a.shape[:-1] + (shift,), fill, a.dtype)], axis=-1)


def _associative(x: jax.Array, c: jax.Array, y_init: jax.Array) -> jax.Array:
    # Fold the boundary value into the last input so the scan needs no carry-in.
    x = x.at[:, -1].add(c[:, -1] * y_init)

    def compose(later, earlier):
        # With reverse=True, `later` holds maps nearer the end of time; the
        # composite applies `later` first, then `earlier`.
        c_late, x_late = later
        c_early, x_early = earlier
        return c_early * c_late, x_early + c_early * x_late

    _, y = jax.lax.associative_scan(compose, (c, x), reverse=True, axis=1)
    return y


def zero_carry(x: jax.Array) -> jax.Array:
    """`[B]` zeros of `x`'s dtype for `[B, T]` `x`, T = 0 included: the value after each row's
    last step. Derived from `x` (x[:, 0] needs a column) without reading it (a sum over no
    column), so that under shard_map they vary over the same mesh axes as the data."""
    return jnp.sum(x[:, :0], axis=1)
