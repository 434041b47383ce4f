"""Boundary checks shared by the estimators.

Shape, rank and dtype checks run at trace time, so they also hold under `jit`.
Value checks (NaN, inf) need concrete arrays: they run when the function is
called eagerly and are skipped on tracers, so they never force a device sync
inside compiled code.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def is_concrete(*arrays: Any) -> bool:
    """True when no argument is a JAX tracer (the call runs eagerly)."""
    return not any(isinstance(x, jax.core.Tracer) for x in arrays)


def _with_rank(fn: str, name: str, x: jax.Array, rank: int | None) -> jax.Array:
    if rank is not None and x.ndim != rank:
        raise ValueError(f"{fn}: {name} has shape {tuple(x.shape)} (rank {x.ndim}); "
                         f"it must have rank {rank}")
    return x


def float_array(fn: str, name: str, x: Any, *, rank: int | None = None) -> jax.Array:
    """Returns `x` as a floating array, or raises naming `fn`, `name` and what was wrong."""
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"{fn}: {name} has dtype {x.dtype}; it must be floating point")
    return _with_rank(fn, name, x, rank)


def bool_array(fn: str, name: str, x: Any, *, rank: int | None = None) -> jax.Array:
    """Returns `x` as a boolean array; integer 0/1 masks are accepted and converted."""
    x = jnp.asarray(x)
    if x.dtype != jnp.bool_:
        if not jnp.issubdtype(x.dtype, jnp.integer):
            raise TypeError(f"{fn}: {name} has dtype {x.dtype}; it must be bool (or 0/1 integers)")
        x = x != 0
    return _with_rank(fn, name, x, rank)


def int_array(fn: str, name: str, x: Any, *, rank: int | None = None) -> jax.Array:
    """Returns `x` as an integer array, or raises naming `fn` and `name`.

    Host ids of 64 bits must fit int32 unless `jax_enable_x64` is set: JAX's conversion
    would wrap them without a word, and two different ids could become one group.
    """
    if not isinstance(x, (jax.Array, jax.core.Tracer)) and not jax.config.jax_enable_x64:
        host = np.asarray(x)
        if host.dtype.kind in "iu" and host.dtype.itemsize > 4 and host.size:
            outside = (host < -2**31) | (host >= 2**31)
            if outside.any():
                index = np.unravel_index(int(np.argmax(outside)), host.shape)
                raise ValueError(f"{fn}: {name} holds {host[index]} at index "
                                 f"{tuple(int(i) for i in index)}, outside int32; number the ids "
                                 "from 0 (stepcredit.keys.dense_ids)")
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(f"{fn}: {name} has dtype {x.dtype}; it must be an integer type")
    return _with_rank(fn, name, x, rank)


def same_shape(fn: str, expected: str, **arrays: jax.Array) -> None:
    """Raises unless all `arrays` share one shape; `expected` names it (e.g. '[B, T]')."""
    items = list(arrays.items())
    first_name, first = items[0]
    for name, x in items[1:]:
        if x.shape != first.shape:
            raise ValueError(f"{fn}: {first_name} has shape {tuple(first.shape)} but {name} has "
                             f"shape {tuple(x.shape)}; both must be {expected}")


def leading_dim(fn: str, batch_size: int, **arrays: jax.Array) -> None:
    """Raises unless every array is `[B]` with B = `batch_size`."""
    for name, x in arrays.items():
        if x.shape != (batch_size,):
            raise ValueError(f"{fn}: {name} has shape {tuple(x.shape)}; it must be [B] = "
                             f"({batch_size},), one entry per trajectory")


def step_and_group_arrays(fn: str, name: str, steps: Any, mask: Any, scores: Any,
                          group_ids: Any) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """The shape and dtype checks of a group estimator of `[B, T]` float `name` (`steps`)
    with its `[B, T]` bool mask and `[B]` float scores and int group ids; returns the four
    as arrays (steps, mask, scores, group_ids)."""
    steps = float_array(fn, name, steps, rank=2)
    mask = bool_array(fn, "mask", mask, rank=2)
    same_shape(fn, "[B, T]", **{name: steps, "mask": mask})
    scores = float_array(fn, "scores", scores, rank=1)
    group_ids = int_array(fn, "group_ids", group_ids, rank=1)
    leading_dim(fn, mask.shape[0], scores=scores, group_ids=group_ids)
    return steps, mask, scores, group_ids


def number(fn: str, name: str, value: Any) -> float:
    """A concrete hyperparameter as a float; a string, a bool, None or several values are
    named."""
    try:
        if isinstance(value, (str, bool, np.bool_)):
            raise TypeError
        return float(value)
    except (TypeError, ValueError):
        kind = type(value).__name__
        article = "an" if kind[0].lower() in "aeiou" else "a"
        raise ValueError(f"{fn}: {name}={value!r} is {article} {kind}; it must be a "
                         "number") from None


def unit_interval(fn: str, **scalars: Any) -> None:
    """Raises `ValueError` for a concrete hyperparameter outside [0, 1] or not a number."""
    for name, value in scalars.items():
        if is_concrete(value) and not 0.0 <= number(fn, name, value) <= 1.0:
            raise ValueError(f"{fn}: {name}={float(value)} is outside [0, 1]")


def finite_scalars(fn: str, **scalars: Any) -> None:
    """Raises `ValueError` for a concrete hyperparameter that is NaN, infinite or not a number
    (a NaN weight would turn every advantage into NaN without a word)."""
    for name, value in scalars.items():
        if is_concrete(value) and not math.isfinite(number(fn, name, value)):
            raise ValueError(f"{fn}: {name}={float(value)}; it must be finite")


def finite_nonnegative(fn: str, **scalars: Any) -> None:
    """Raises `ValueError` for a concrete hyperparameter (an eps, a prior count) that is NaN,
    infinite, negative or not a number."""
    for name, value in scalars.items():
        if is_concrete(value):
            x = number(fn, name, value)
            if not (math.isfinite(x) and x >= 0.0):
                raise ValueError(f"{fn}: {name}={x}; it must be finite and >= 0")


def finite_where(fn: str, name: str, x: jax.Array, valid: jax.Array | None = None) -> None:
    """Raises `ValueError` naming the first non-finite entry of `x` at a valid position.

    Skipped when `x` or `valid` is traced: under `jit` use `jax.experimental.checkify`.
    """
    if not is_concrete(x, valid):
        return
    bad = ~np.isfinite(np.asarray(x))
    if valid is not None:
        bad &= np.broadcast_to(np.asarray(valid), bad.shape)
    if bad.any():
        index = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(f"{fn}: {name} is not finite at index {index} "
                         f"(value {np.asarray(x)[index]}); masked positions may hold anything, "
                         f"valid ones must be finite")


def one_of(fn: str, name: str, value: Any, options: tuple[Any, ...]) -> None:
    """Raises `ValueError` unless the option `value` is one of `options`, listing them."""
    if value not in options:
        raise ValueError(f"{fn}: {name}={value!r}; it must be one of "
                         f"{', '.join(map(repr, options))}")
