"""Generalised advantage estimation over tokens and over agent steps.

Both estimators run the same masked backward recursion; they differ in what a
time step is. `token_gae` runs along a trajectory's concatenated tokens and
skips observation tokens (verl's multi-turn GAE); `step_gae` runs along agent
steps, one reward and one value per step (StepPO, arXiv 2604.18401).

Masked positions (mask False) pass the next value and the running advantage
through unchanged, apply no discount and output 0. They may hold any value,
NaN included, because they are only ever read through `jnp.where`.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp

from stepcredit.advantages import _checks, native
from stepcredit.advantages.recurrence import (METHODS, Method, reverse_linear_recurrence,
                                              zero_carry)

GaeMethod = Literal["auto", "sequential", "chunked", "associative", "native"]
# "native" exists for GAE only: a compiled kernel of the whole masked recursion; "auto"
# (the default) takes it wherever it applies and the sequential scan elsewhere.
GAE_METHODS = (*METHODS, "native")


class AdvantagesAndReturns(NamedTuple):
    """`advantages` and critic targets `returns`, both `[B, T]` (or `[B, N]`)."""

    advantages: jax.Array
    returns: jax.Array


def _check_inputs(fn: str, rewards, values, mask, bootstrap_value, **hyper):
    rewards = _checks.float_array(fn, "rewards", rewards, rank=2)
    mask = _checks.bool_array(fn, "mask", mask, rank=2)
    arrays = {"rewards": rewards, "mask": mask}
    if values is not None:
        values = _checks.float_array(fn, "values", values, rank=2)
        arrays["values"] = values
    _checks.same_shape(fn, "[B, T]", **arrays)
    if bootstrap_value is None:
        bootstrap_value = zero_carry(rewards)
    else:
        bootstrap_value = _checks.float_array(fn, "bootstrap_value", bootstrap_value, rank=1)
        _checks.leading_dim(fn, rewards.shape[0], bootstrap_value=bootstrap_value)
    _checks.unit_interval(fn, **hyper)
    _checks.finite_where(fn, "rewards", rewards, mask)
    if values is not None:
        _checks.finite_where(fn, "values", values, mask)
    _checks.finite_where(fn, "bootstrap_value", bootstrap_value)
    return rewards, values, mask, bootstrap_value.astype(rewards.dtype)


def _next_valid(x: jax.Array, mask: jax.Array, after_last: jax.Array, method: Method) -> jax.Array:
    """For each position t, the entry of `x` at the next valid position after t.

    Positions past the last valid one read `after_last` (`[B]`).
    """
    # h_t = x_t at valid t, else h_{t+1}; shifting h by one gives "next valid after t".
    carried = reverse_linear_recurrence(jnp.where(mask, x, 0.0), jnp.where(mask, 0.0, 1.0).astype(x.dtype),
                                        after_last, method=method)
    return jnp.concatenate([carried[:, 1:], after_last[:, None]], axis=1)


def gae_method(rewards, values, bootstrap_value=None, *, gamma, lam,
               method: GaeMethod = "auto", backend: str | None = None) -> str:
    """Which computation `step_gae` / `token_gae` run for these arguments.

    "auto" and "native" run the compiled kernel (`stepcredit.advantages.native`)
    on CPU for float32 rewards, values and bootstrap value with gamma and lam
    known when tracing, once the kernel is built; otherwise the sequential scan.
    "sequential", "chunked" and "associative" always run as named.

    Args:
      rewards, values: `[B, T]` arrays (or their `jax.ShapeDtypeStruct`s).
      bootstrap_value: `[B]`, or None (0, in the dtype of rewards).
      gamma, lam: the call's hyperparameters.
      method: the call's `method`.
      backend: the platform it will run on (default: `jax.default_backend()`).

    Returns:
      "native", or the scan's method name.
    """
    if method not in GAE_METHODS:
        raise ValueError(f"gae_method: method={method!r}; expected one of {GAE_METHODS}")
    if method not in ("auto", "native"):
        return method
    if bootstrap_value is None:
        bootstrap_value = jax.ShapeDtypeStruct(jnp.shape(rewards)[:1], jnp.result_type(rewards))
    if ((backend or jax.default_backend()) != "cpu"
            or not native.supports(rewards, values, bootstrap_value, gamma, lam)
            or native.build_error()):
        return "sequential"
    return "native"


def _masked_gae(fn, rewards, values, mask, bootstrap_value, gamma, lam, method):
    if method not in GAE_METHODS:
        raise ValueError(f"{fn}: method={method!r}; expected one of {GAE_METHODS}")
    if method not in ("auto", "native"):
        return _scan_gae(rewards, values, mask, bootstrap_value, gamma, lam, method)

    def sequential(*arrays):
        return _scan_gae(*arrays, gamma, lam, "sequential")

    if not native.supports(rewards, values, bootstrap_value, gamma, lam):
        return sequential(rewards, values, mask, bootstrap_value)

    def kernel(*arrays):
        return AdvantagesAndReturns(*native.masked_gae(*arrays, gamma=gamma, lam=lam))

    # Only a caller who asked for the kernel by name hears that it is missing.
    warn_as = f"{fn}: running the sequential scan instead" if method == "native" else None
    return native.on_cpu(kernel, sequential, rewards, values, mask, bootstrap_value,
                         warn_as=warn_as)


def _scan_gae(rewards, values, mask, bootstrap_value, gamma, lam, method):
    # One recurrence instead of two (next valid value, then advantage): with
    # z_t = gamma V_t + gamma lam A_t at valid t, carried through masked t,
    #     A_t = r_t - V_t + z_{next(t)}
    #     z_t = gamma lam r_t + gamma (1 - lam) V_t + gamma lam z_{next(t)},
    # and z after the last valid step = gamma * bootstrap_value (A there is 0).
    decay = gamma * lam
    z_end = gamma * bootstrap_value
    z = reverse_linear_recurrence(
        jnp.where(mask, decay * rewards + (gamma - decay) * values, 0.0),
        jnp.where(mask, decay, 1.0).astype(rewards.dtype), z_end, method=method)
    z_next = jnp.concatenate([z[:, 1:], z_end[:, None]], axis=1)
    advantages = jnp.where(mask, rewards - values + z_next, 0.0)
    returns = jnp.where(mask, rewards + z_next, 0.0)
    return AdvantagesAndReturns(advantages, returns)


def step_gae(rewards, values, mask, *, gamma: float = 1.0, lam: float = 1.0,
             bootstrap_value=None, method: GaeMethod = "auto") -> AdvantagesAndReturns:
    """Step-level GAE: one advantage per agent step (StepPO's critic-based credit).

    With V_{T} = `bootstrap_value` after a trajectory's last valid step:

        delta_t = r_t + gamma V_{t+1} - V_t
        A_t     = delta_t + gamma lam A_{t+1},        A_{T} = 0
        R_t     = A_t + V_t                           (critic target)

    lam = 1 gives Monte Carlo returns minus values; lam = 0 gives one-step TD
    errors. Masked steps are skipped: they neither advance the recursion nor
    receive an advantage (their outputs are 0), so padding anywhere is safe.

    Args:
      rewards: `[B, T]` step rewards r_t (the sum of a step's token rewards; see
        `step_rewards_from_tokens`).
      values: `[B, T]` step values V(s_t), the critic at the last prompt token
        before the step's first action token (see `step_values_from_tokens`).
      mask: `[B, T]` bool, True on real steps; False on padding.
      gamma: discount in [0, 1]. Default 1 (StepPO's ALFWorld and WebShop scripts).
      lam: GAE lambda in [0, 1]. Default 1 (verl's default, used by StepPO).
      bootstrap_value: `[B]` value after the last valid step: V(s_next) when the
        trajectory was truncated, 0 when it terminated. None means 0.
      method: "auto" (the default) runs a compiled CPU kernel of the whole
        recursion (`stepcredit.advantages.native`, built with the system C++
        compiler on first use; the fastest on CPU) wherever it applies, and
        "sequential" on other backends, for dtypes other than float32, for
        gamma or lam traced under `jit` and where no kernel can be built;
        `gae_method` says which a call runs. "native" is "auto" that warns when
        the kernel cannot be built. "sequential" (`lax.scan`), "chunked"
        (blocks solved by vectorised doubling, recursively) and "associative"
        (`lax.associative_scan`) name a scan (`reverse_linear_recurrence`).
        The kernel has no derivative: to differentiate through GAE, pass a scan.

    Returns:
      `AdvantagesAndReturns` of `[B, T]` arrays, 0 at masked steps.

    Raises:
      ValueError / TypeError: wrong rank, shape or dtype (naming the argument);
        gamma or lam outside [0, 1]; called eagerly, NaN or inf at a valid step
        of rewards or values (naming the first bad index). Under `jit` only the
        static checks run; to check values in compiled code, use checkify:

            from jax.experimental import checkify

            def checked(rewards, values, mask):
                finite = jnp.isfinite(jnp.where(mask, rewards + values, 0.0))
                checkify.check(jnp.all(finite), "step_gae: non-finite rewards or values")
                return step_gae(rewards, values, mask)

            error, out = jax.jit(checkify.checkify(checked))(rewards, values, mask)
            error.throw()

    References:
      Wang et al., "Step-Aligned Policy Optimization for Agentic RL" (StepPO),
      arXiv 2604.18401; Schulman et al., "High-Dimensional Continuous Control
      Using Generalized Advantage Estimation", arXiv 1506.02438.

    Notes:
      The StepPO figure draws the backward arrows with gamma only; the authors'
      code (`arft/core_algos.py`) uses gamma * lam, as here. Whitening over
      valid steps is applied by the caller (`masked_whiten`), not here.

    Example (gamma = 0.9, lam = 0.5, terminated after three steps):

      >>> out = step_gae(jnp.array([[0., 0., 1.]]), jnp.array([[0.5, 0.6, 0.8]]),
      ...                jnp.array([[True, True, True]]), gamma=0.9, lam=0.5)
      >>> out.advantages   # deltas 0.04, 0.12, 0.2
      [[0.1345, 0.21, 0.2]]
      >>> out.returns
      [[0.6345, 0.81, 1.0]]
    """
    rewards, values, mask, bootstrap_value = _check_inputs(
        "step_gae", rewards, values, mask, bootstrap_value, gamma=gamma, lam=lam)
    return _masked_gae("step_gae", rewards, values, mask, bootstrap_value, gamma, lam, method)


def token_gae(rewards, values, mask, *, gamma: float, lam: float, bootstrap_value=None,
              method: GaeMethod = "auto") -> AdvantagesAndReturns:
    """Token-level GAE along a trajectory's tokens, skipping non-action tokens.

    The recursion of `step_gae` with one time step per token: for action
    tokens n (mask True), with V after the last action token = `bootstrap_value`,

        delta_n = r_n + gamma V_{next(n)} - V_n
        A_n     = delta_n + gamma lam A_{next(n)}

    where next(n) is the next action token of the trajectory, possibly in a
    later agent step: observation tokens between steps are skipped, so the value
    carried back into a step is the value at the first action token of the next
    step. This is verl's multi-turn GAE (the `token_gae` baseline of StepPO).

    Args:
      rewards: `[B, N]` token rewards (an environment's step reward sits on the
        step's last action token).
      values: `[B, N]` values; the value at token n estimates the state before
        token n is generated (the critic output at position n - 1, verl's
        shifted slice).
      mask: `[B, N]` bool, True on action tokens; False on observation, prompt
        and padding tokens.
      gamma: discount in [0, 1] (verl's default is 1).
      lam: GAE lambda in [0, 1] (verl's default is 1).
      bootstrap_value: `[B]` value after the last action token (0 when the
        episode terminated; None means 0).
      method: "auto", "sequential", "chunked", "associative" or "native" (as
        `step_gae`).

    Returns:
      `AdvantagesAndReturns` of `[B, N]` arrays, 0 where mask is False.

    Raises:
      As `step_gae`.

    References:
      Schulman et al., arXiv 1506.02438; the multi-turn convention of verl
      (`compute_gae_advantage_return`) as used by StepPO, arXiv 2604.18401.

    Example: with one action token per step, `token_gae` equals `step_gae`;
    with observation tokens between the action tokens of the three-step example
    of `step_gae` (mask [T, F, T, F, F, T]) the action tokens get the same
    advantages [0.1345, 0.21, 0.2] and the observation tokens get 0.
    """
    rewards, values, mask, bootstrap_value = _check_inputs(
        "token_gae", rewards, values, mask, bootstrap_value, gamma=gamma, lam=lam)
    return _masked_gae("token_gae", rewards, values, mask, bootstrap_value, gamma, lam, method)


def lambda_returns(rewards, values, mask, *, gamma: float, lam: float, bootstrap_value=None,
                   method: Method = "auto") -> jax.Array:
    """TD(lambda) returns, skipping masked positions.

        G_t = r_t + gamma [(1 - lam) V_{t+1} + lam G_{t+1}],    G after the last
        valid step = `bootstrap_value`.

    lam = 1 gives discounted returns; lam = 0 gives one-step targets
    r_t + gamma V_{t+1}. They equal `step_gae(...).returns`, computed here by
    their own recursion.

    Args:
      rewards, values, mask: `[B, T]` as in `step_gae`.
      gamma, lam: in [0, 1].
      bootstrap_value: `[B]`, None means 0.
      method: "auto", "sequential", "chunked" or "associative"
        (`reverse_linear_recurrence`).

    Returns:
      `[B, T]` lambda returns, 0 at masked positions.

    References:
      Sutton and Barto, "Reinforcement Learning: An Introduction", 2nd ed., §12.1.

    Example: the three-step example of `step_gae` gives [[0.6345, 0.81, 1.0]].
    """
    rewards, values, mask, bootstrap_value = _check_inputs(
        "lambda_returns", rewards, values, mask, bootstrap_value, gamma=gamma, lam=lam)
    next_values = _next_valid(values, mask, bootstrap_value, method)
    inputs = rewards + gamma * (1.0 - lam) * next_values
    returns = reverse_linear_recurrence(jnp.where(mask, inputs, 0.0),
                                        jnp.where(mask, gamma * lam, 1.0).astype(rewards.dtype),
                                        bootstrap_value, method=method)
    return jnp.where(mask, returns, 0.0)


def discounted_returns(rewards, mask, *, gamma: float, bootstrap_value=None,
                       method: Method = "auto") -> jax.Array:
    """Discounted returns G_t = r_t + gamma G_{t+1}, skipping masked positions.

    G after the last valid step is `bootstrap_value` (0 by default: the
    episode terminated).

    Args:
      rewards: `[B, T]` rewards.
      mask: `[B, T]` bool, True at valid positions.
      gamma: discount in [0, 1].
      bootstrap_value: `[B]`, None means 0.
      method: "auto", "sequential", "chunked" or "associative"
        (`reverse_linear_recurrence`).

    Returns:
      `[B, T]` returns, 0 at masked positions.

    References:
      Sutton and Barto, "Reinforcement Learning: An Introduction", 2nd ed., §3.3.

    Example: rewards [[0, 0, 1]], gamma 0.9 gives [[0.81, 0.9, 1.0]].
    """
    rewards, _, mask, bootstrap_value = _check_inputs(
        "discounted_returns", rewards, None, mask, bootstrap_value, gamma=gamma)
    returns = reverse_linear_recurrence(jnp.where(mask, rewards, 0.0),
                                        jnp.where(mask, gamma, 1.0).astype(rewards.dtype),
                                        bootstrap_value, method=method)
    return jnp.where(mask, returns, 0.0)
