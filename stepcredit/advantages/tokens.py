"""Moving credit between the token view `[B, N]` and the step view `[B, T]`.

In the token view, `step_index[b, n]` names the agent step of action token n
of trajectory b, and is -1 on observation, prompt and padding tokens. The
step view has one entry per agent step. These functions are the only bridge
between the two, so token-level and step-level estimators can be compared on
the same trajectories.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from stepcredit.advantages import _checks, native


def _check_token_view(fn: str, name: str, token_values, step_index, num_steps: int):
    token_values = _checks.float_array(fn, name, token_values, rank=2)
    step_index = _checks.int_array(fn, "step_index", step_index, rank=2)
    _checks.same_shape(fn, "[B, N]", **{name: token_values, "step_index": step_index})
    if not isinstance(num_steps, int) or num_steps < 1:
        raise ValueError(f"{fn}: num_steps={num_steps!r}; it must be a positive Python int (static T)")
    if _checks.is_concrete(step_index) and step_index.size and int(step_index.max()) >= num_steps:
        raise ValueError(f"{fn}: step_index holds {int(step_index.max())} but num_steps={num_steps}; "
                         f"step indices must lie in [-1, num_steps)")
    return token_values, step_index


def _row_segments(step_index: jax.Array, num_steps: int) -> jax.Array:
    """Flat segment ids: step t of row b -> b (T + 1) + t; non-action tokens -> b (T + 1) + T."""
    rows = jnp.arange(step_index.shape[0], dtype=step_index.dtype)[:, None]
    local = jnp.where(step_index >= 0, step_index, num_steps)
    return (rows * (num_steps + 1) + local).reshape(-1)


def step_rewards_from_tokens(token_rewards, step_index, num_steps: int) -> jax.Array:
    """Sums each step's action-token rewards: r_t = sum_{n : step_index[n] = t} r_n.

    Args:
      token_rewards: `[B, N]` token rewards; entries where step_index is -1 are
        ignored (they may hold anything, NaN included).
      step_index: `[B, N]` int, the step of each action token, -1 elsewhere.
      num_steps: static number of steps T of the output.

    Returns:
      `[B, T]` step rewards (0 for a step with no action tokens). On CPU, for
      float32, the compiled kernel `native.tokens_to_steps` computes them (the
      same numbers bit for bit); elsewhere a segment sum.

    References:
      StepPO (arXiv 2604.18401), its step-level GAE: the environment's
      scalar sits on the step's last token, so the sum recovers it.

    Example: token_rewards [[0, 0, 1, 0, 2]], step_index [[0, 0, 0, -1, 1]],
    num_steps 2 gives [[1, 2]].
    """
    fn = "step_rewards_from_tokens"
    token_rewards, step_index = _check_token_view(fn, "token_rewards", token_rewards, step_index,
                                                  num_steps)
    return _on_cpu_if_float32(_native_step_sums, _xla_step_sums, token_rewards, step_index,
                              num_steps=num_steps)


def _on_cpu_if_float32(kernel, xla, values, step_index, **static):
    """`kernel` on CPU for float32 values once the kernels are built, else `xla`; both take
    (values, step_index, **static) and give the same numbers."""
    xla = functools.partial(xla, **static)
    if values.dtype != jnp.float32:
        return xla(values, step_index)

    def on_cpu(values, step_index):
        return kernel(values, step_index.astype(jnp.int32), *static.values())

    return native.on_cpu(on_cpu, xla, values, step_index)


def _xla_step_sums(token_rewards, step_index, num_steps):
    batch = token_rewards.shape[0]
    clean = jnp.where(step_index >= 0, token_rewards, 0.0).reshape(-1)
    sums = jax.ops.segment_sum(clean, _row_segments(step_index, num_steps),
                               num_segments=batch * (num_steps + 1))
    return sums.reshape(batch, num_steps + 1)[:, :num_steps]


def _xla_broadcast(step_values, step_index, last_only=False):
    num_steps = step_values.shape[1]
    gathered = jnp.take_along_axis(step_values, jnp.clip(step_index, 0, num_steps - 1), axis=1)
    return jnp.where(step_index >= 0, gathered, 0.0)


# The kernels have no derivative of their own: each is the other's transpose (the
# preference losses differentiate through the step sums).
@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _native_step_sums(token_values, step_index, num_steps):
    return native.tokens_to_steps(token_values, step_index, num_steps)


def _step_sums_forward(token_values, step_index, num_steps):
    return _native_step_sums(token_values, step_index, num_steps), step_index


def _step_sums_backward(num_steps, step_index, cotangent):
    counted = jnp.where(step_index < num_steps, step_index, -1)
    return _native_broadcast(cotangent, counted, False), None


_native_step_sums.defvjp(_step_sums_forward, _step_sums_backward)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _native_broadcast(step_values, step_index, last_only):
    return native.steps_to_tokens(step_values, step_index, last_only=last_only)


def _broadcast_forward(step_values, step_index, last_only):
    return (_native_broadcast(step_values, step_index, last_only),
            (step_index, step_values.shape[1]))


def _broadcast_backward(last_only, residuals, cotangent):
    step_index, num_steps = residuals
    counted = (step_index >= 0) & (last_action_tokens(step_index) | (not last_only))
    clipped = jnp.where(counted, jnp.minimum(step_index, num_steps - 1), -1)
    return _native_step_sums(cotangent, clipped, num_steps), None


_native_broadcast.defvjp(_broadcast_forward, _broadcast_backward)


def last_action_tokens(step_index) -> jax.Array:
    """`[B, N]` bool: True at the last action token of each step (where its reward sits)."""
    step_index = jnp.asarray(step_index)
    following = jnp.concatenate([step_index[:, 1:], jnp.full_like(step_index[:, :1], -1)], axis=1)
    return (step_index >= 0) & (following != step_index)


def token_rewards_from_steps(step_rewards, step_index) -> jax.Array:
    """`[B, N]`: each step's reward `[B, T]` on its last action token, 0 elsewhere.

    On CPU, for float32, one pass of the compiled kernel `native.steps_to_tokens`;
    elsewhere a gather and a select (the same numbers).
    """
    step_rewards, step_index = _check_step_view("token_rewards_from_steps", step_rewards,
                                                step_index, "step_rewards")
    return _on_cpu_if_float32(_native_broadcast, _xla_last_tokens, step_rewards, step_index,
                              last_only=True)


def _xla_last_tokens(step_rewards, step_index, last_only):
    return jnp.where(last_action_tokens(step_index), _xla_broadcast(step_rewards, step_index),
                     0.0)


def first_token_positions(step_index, num_steps: int) -> tuple[jax.Array, jax.Array]:
    """Position of each step's first action token.

    Args:
      step_index: `[B, N]` int, the step of each action token, -1 elsewhere.
      num_steps: static number of steps T.

    Returns:
      `(positions, present)`: `[B, T]` int32 positions (0 where a step has no
      action token) and `[B, T]` bool, True where the step has one.
    """
    step_index = jnp.asarray(step_index)
    batch, length = step_index.shape
    positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length)).reshape(-1)
    first = jax.ops.segment_min(positions, _row_segments(step_index, num_steps),
                                num_segments=batch * (num_steps + 1))
    first = first.reshape(batch, num_steps + 1)[:, :num_steps]
    present = first < length
    return jnp.where(present, first, 0), present


def step_values_from_tokens(token_values, step_index, num_steps: int) -> jax.Array:
    """Reads StepPO's step value V(s_t) from token-aligned values.

    `token_values[b, n]` estimates the state before token n is generated (the
    critic output at position n - 1, verl's shifted slice), so the value at a
    step's first action token is the critic at the last prompt token:

        V_t = token_values[b, min{n : step_index[b, n] = t}].

    Args:
      token_values: `[B, N]` token-aligned values.
      step_index: `[B, N]` int, the step of each action token, -1 elsewhere.
      num_steps: static number of steps T.

    Returns:
      `[B, T]` step values (0 for a step with no action tokens).

    References:
      StepPO (arXiv 2604.18401): `values[:, 0]` after verl's critic slice
      `values[:, -L-1:-1]`.

    Example: token_values [[9, 0.5, 0.4, 9, 0.6]], step_index [[-1, 0, 0, -1, 1]],
    num_steps 2 gives [[0.5, 0.6]].
    """
    fn = "step_values_from_tokens"
    token_values, step_index = _check_token_view(fn, "token_values", token_values, step_index,
                                                 num_steps)
    positions, present = first_token_positions(step_index, num_steps)
    gathered = jnp.take_along_axis(token_values, positions, axis=1)
    return jnp.where(present, gathered, 0.0)


def broadcast_to_tokens(step_values, step_index) -> jax.Array:
    """Writes each step's value to all of its action tokens: x_n = x_{step_index[n]}.

    Args:
      step_values: `[B, T]` per-step values (advantages, returns).
      step_index: `[B, N]` int, the step of each action token, -1 elsewhere.

    Returns:
      `[B, N]`, 0 where step_index is -1. On CPU, for float32, by the compiled
      kernel `native.steps_to_tokens`; elsewhere a gather (the same numbers).

    References:
      The broadcast shared by StepPO (arXiv 2604.18401), GiGPO (arXiv
      2505.10978), EMPG (arXiv 2509.09265) and iStar (arXiv 2509.19199).

    Example: step_values [[1, 2]], step_index [[-1, 0, 0, -1, 1]] gives
    [[0, 1, 1, 0, 2]].
    """
    step_values, step_index = _check_step_view("broadcast_to_tokens", step_values, step_index)
    return _on_cpu_if_float32(_native_broadcast, _xla_broadcast, step_values, step_index,
                              last_only=False)


def _check_step_view(fn: str, step_values, step_index, name: str = "step_values"):
    """`[B, T]` step values (the argument `name`) and `[B, N]` step indices below T."""
    step_values = _checks.float_array(fn, name, step_values, rank=2)
    step_index = _checks.int_array(fn, "step_index", step_index, rank=2)
    if step_values.shape[0] != step_index.shape[0]:
        raise ValueError(f"{fn}: {name} has shape {tuple(step_values.shape)} but step_index has "
                         f"shape {tuple(step_index.shape)}; both need the same B")
    num_steps = step_values.shape[1]
    if _checks.is_concrete(step_index) and step_index.size and int(step_index.max()) >= num_steps:
        raise ValueError(f"{fn}: step_index holds {int(step_index.max())} but {name} has only "
                         f"{num_steps} steps")
    return step_values, step_index
