"""Entropy-Modulated Policy Gradients (EMPG): step advantages scaled by step confidence.

EMPG takes a trajectory-level advantage (GRPO's or DAPO's group-normalised
outcome) and reshapes it per agent step with the policy's step entropy: a
confident (low-entropy) step gets a larger share of the credit, an uncertain
one a smaller share, and a step followed by a confident step earns a small
"future clarity" bonus. All batch statistics are taken over valid steps
(and, with `axis_name`, over the whole sharded batch).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from stepcredit.advantages import _checks, native
from stepcredit.advantages import group as group_lib
from stepcredit.advantages.recurrence import reverse_linear_recurrence


def _batch_sum(x: jax.Array, axis_name: str | None) -> jax.Array:
    total = jnp.sum(x)
    return total if axis_name is None else jax.lax.psum(total, axis_name)


def _batch_min_max(entropy: jax.Array, mask: jax.Array, axis_name: str | None):
    low = jnp.min(jnp.where(mask, entropy, jnp.inf))
    high = jnp.max(jnp.where(mask, entropy, -jnp.inf))
    if axis_name is not None:
        low, high = jax.lax.pmin(low, axis_name), jax.lax.pmax(high, axis_name)
    empty = low > high  # no valid step anywhere: every output is 0 anyway
    return jnp.where(empty, 0.0, low), jnp.where(empty, 0.0, high)


def _next_valid(x: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x at the next valid step of the same row after t, and whether one exists (x >= 0).

    h_t = x_t at valid t, else h_{t+1}, and -1 after the row's last valid step: a
    reverse linear recurrence with coefficient 0 at valid steps (which passes x_t
    exactly) and 1 elsewhere, so CPU runs it as the compiled kernel, where XLA:CPU
    runs a reverse cumulative minimum as a slow reduce-window.
    """
    carried = reverse_linear_recurrence(jnp.where(mask, x, 0.0),
                                        jnp.where(mask, 0.0, 1.0).astype(x.dtype),
                                        jnp.full_like(x[:, 0], -1.0))  # varying as x, under shard_map
    after = jnp.concatenate([carried[:, 1:], jnp.full_like(carried[:, :1], -1.0)], axis=1)
    return after, ~(after < 0)  # a NaN at a valid step stays NaN


def _check_inputs(fn: str, advantages, entropy, mask):
    entropy = _checks.float_array(fn, "entropy", entropy, rank=2)
    mask = _checks.bool_array(fn, "mask", mask, rank=2)
    _checks.same_shape(fn, "[B, T]", entropy=entropy, mask=mask)
    advantages = _checks.float_array(fn, "advantages", advantages)
    if advantages.ndim == 1:
        _checks.leading_dim(fn, entropy.shape[0], advantages=advantages)
        _checks.finite_where(fn, "advantages", advantages, jnp.any(mask, axis=1))
    elif advantages.ndim == 2:
        _checks.same_shape(fn, "[B, T]", advantages=advantages, mask=mask)
        _checks.finite_where(fn, "advantages", advantages, mask)
    else:
        raise ValueError(f"{fn}: advantages has shape {tuple(advantages.shape)}; it must be [B] "
                         f"(per trajectory) or [B, T] (per step) with [B, T] = {tuple(mask.shape)}")
    _checks.finite_where(fn, "entropy", entropy, mask)
    return advantages, entropy, mask


def empg(advantages, entropy, mask, *, k: float = 1.0, k_future: float = 1.0, zeta: float = 0.05,
         eps: float = 1e-8, center: bool = True, axis_name: str | None = None) -> jax.Array:
    """Entropy-modulated step advantages (EMPG).

    Over the valid steps of the batch, with H_{i,t} the mean token entropy of
    step t of trajectory i:

        H~_{i,t} = (H_{i,t} - min H) / (max H - min H + eps)
        g_{i,t}  = exp(-k H~_{i,t}) / mean_{valid (j,s)} exp(-k H~_{j,s})
        f_{i,t}  = exp(-k_future H~_{i,t})
        A'_{i,t} = g_{i,t} A_{i,t} + zeta f_{i,next(t)}
        A_mod    = A' - mean_{valid} A'          (center=True; A' when False)

    where next(t) is the next valid step of trajectory i; the bonus is 0 on a
    trajectory's last valid step. The mean of g over valid steps is 1, so g
    moves credit from uncertain steps to confident ones without changing its
    total. k = k_future = 0 and zeta = 0 give the input, centred.

    Args:
      advantages: `[B]` trajectory advantages (e.g. `grpo` of the scores),
        broadcast over steps, or `[B, T]` step advantages.
      entropy: `[B, T]` step entropy H_{i,t}: the mean over the step's
        action tokens of the policy's token entropy (from the sampling pass).
      mask: `[B, T]` bool, True on real steps; False on padding (whose
        entries may hold anything, NaN included).
      k: sharpness of the confidence scaling g (paper: 1).
      k_future: sharpness of the future-clarity bonus f (ARLArena: 1).
      zeta: weight of the future-clarity bonus (ARLArena: 0.05).
      eps: added to the entropy range in the min-max normalisation (1e-8).
      center: subtract the mean over valid steps (the paper's final
        zero-mean normalisation) or not.
      axis_name: mesh axis the batch is sharded over (inside `shard_map`);
        the batch min, max and means are then combined across devices.

    Returns:
      `[B, T]` modulated advantages, 0 at masked steps. An all-False mask
      gives all zeros.

    Raises:
      ValueError / TypeError: wrong rank, shape or dtype (naming the argument);
        called eagerly, NaN or inf in advantages or entropy at a valid step.

    References:
      Wang et al., "Harnessing Uncertainty: Entropy-Modulated Policy Gradients
      for Long-Horizon LLM Agents", arXiv 2509.09265, Eqs. 8-12; restated in
      ARLArena, arXiv 2602.21534, Appendix A.3.2, Eqs. S20-S23.

    Notes:
      No official code was published. The third-party implementation
      (ARLArena `core_algos.py::compute_EMPG_advantage`, one verl batch row
      per step) matches this function: its `advantages[:, 0]` is the first
      *token* of each step row, so its centring is the batch mean over steps,
      the default here; it divides by the mean of g plus 1e-8, which is
      immaterial because that mean lies in [exp(-k), 1]. The paper's final
      normalisation says "e.g. zero-mean" and divides by no std; whitening,
      if wanted, is the caller's (registry `whiten`).

      On one device (no `axis_name`), for float32 arrays and hyperparameters
      known when tracing, CPU runs the compiled kernel (`native.empg`: four
      passes where XLA:CPU runs about twenty kernels), equal to the XLA
      computation to float32 rounding; otherwise XLA computations. The
      kernel has no derivative: the output is a policy-gradient target.

    Example (k = k_future = 1, zeta = 0.05): advantages [1, -1] per
    trajectory, entropy [[0, 1], [1, NaN]], mask [[T, T], [T, F]]: H~ is
    [[0, 1], [1, -]], g = [[1.72835, 0.63582], [0.63582, -]], the bonus
    0.05 exp(-1) = 0.01839 goes to step 0 of trajectory 0, and after
    subtracting the mean 0.58225:

      [[1.16450, 0.05358], [-1.21807, 0.]]
    """
    fn = "empg"
    if not isinstance(center, bool):
        raise ValueError(f"{fn}: center={center!r}; it must be True (subtract the mean over valid "
                         f"steps) or False")
    advantages, entropy, mask = _check_inputs(fn, advantages, entropy, mask)
    _checks.finite_scalars(fn, k=k, k_future=k_future, zeta=zeta, eps=eps)
    hyper = dict(k=k, k_future=k_future, zeta=zeta, eps=eps, center=center)
    xla = functools.partial(_xla_empg, axis_name=axis_name, **hyper)
    if (axis_name is not None or not _checks.is_concrete(k, k_future, zeta, eps)
            or not all(x.dtype == jnp.float32 for x in (advantages, entropy))):
        return xla(advantages, entropy, mask)

    return native.on_cpu(functools.partial(native.empg, **hyper), xla, advantages, entropy, mask)


def _xla_empg(advantages, entropy, mask, *, k, k_future, zeta, eps, center, axis_name):
    """`empg` as XLA computations (any backend, dtype or mesh axis); `[B]` or `[B, T]`
    advantages."""
    advantages = jnp.broadcast_to(advantages[:, None] if advantages.ndim == 1 else advantages,
                                  entropy.shape)
    dtype = jnp.result_type(advantages.dtype, entropy.dtype)
    # An integer count: XLA:CPU would first write the mask out as floats to sum them.
    count = jnp.maximum(_batch_sum(mask.astype(jnp.int32), axis_name).astype(dtype), 1.0)

    low, high = _batch_min_max(entropy, mask, axis_name)
    normalised = jnp.where(mask, (entropy - low) / (high - low + eps), 0.0).astype(dtype)
    scale = jnp.exp(-k * normalised)
    scale = scale / (_batch_sum(jnp.where(mask, scale, 0.0), axis_name) / count)
    clarity, has_next = _next_valid(jnp.exp(-k_future * normalised), mask)
    modulated = scale * jnp.where(mask, advantages, 0.0) + jnp.where(has_next, zeta * clarity, 0.0)
    if center:
        modulated = modulated - _batch_sum(jnp.where(mask, modulated, 0.0), axis_name) / count
    return jnp.where(mask, modulated, 0.0)


def grpo_empg(scores, group_ids, entropy, mask, *, std: str = "unbiased", grpo_eps: float = 1e-6,
              k: float = 1.0, k_future: float = 1.0, zeta: float = 0.05, eps: float = 1e-8,
              center: bool = True, num_groups: int | None = None,
              axis_name: str | None = None) -> jax.Array:
    """GRPO + EMPG: the group-normalised outcome advantage, entropy-modulated per step.

        A_i     = (s_i - mean_g s) / (std_g s + grpo_eps)            (`grpo`)
        A_mod   = empg(A, entropy, mask)                             (`empg`)

    This is also DAPO + EMPG: DAPO's advantage is GRPO's; its clip-higher
    (0.2 / 0.28), token-mean loss aggregation, dynamic sampling and overlong
    penalty belong to the loss and the trainer.

    Args:
      scores: `[B]` trajectory scores (the sum of the step rewards).
      group_ids: `[B]` int task group (arbitrary unless `num_groups` is given).
      entropy: `[B, T]` step entropies; mask: `[B, T]` bool valid steps.
      std, grpo_eps: GRPO's std ("unbiased", "biased", "none") and eps.
      k, k_future, zeta, eps, center: EMPG's hyperparameters (see `empg`).
      num_groups: static number of groups, or None to remap ids.
      axis_name: mesh axis the batch is sharded over inside `shard_map`.

    Returns:
      `[B, T]` advantages, 0 at masked steps.

    Raises:
      As `grpo` and `empg`.

    References:
      Wang et al., "Harnessing Uncertainty: Entropy-Modulated Policy Gradients
      for Long-Horizon LLM Agents", arXiv 2509.09265 (GRPO+EMPG and DAPO+EMPG
      rows of its Table 1); Shao et al., DeepSeekMath (GRPO), arXiv 2402.03300;
      Yu et al., "DAPO: An Open-Source LLM Reinforcement Learning System at
      Scale", arXiv 2503.14476.

    Example: scores [1, 0] in one group give GRPO advantages [0.7071, -0.7071]
    (unbiased std); with k = k_future = zeta = 0 and equal-length
    trajectories the output is those values on every valid step.
    """
    fn = "grpo_empg"
    mask = _checks.bool_array(fn, "mask", mask, rank=2)
    _checks.leading_dim(fn, mask.shape[0], scores=_checks.float_array(fn, "scores", scores, rank=1))
    advantages = group_lib.grpo(scores, group_ids, num_groups=num_groups, eps=grpo_eps, std=std,
                                axis_name=axis_name)
    return empg(advantages, entropy, mask, k=k, k_future=k_future, zeta=zeta, eps=eps,
                center=center, axis_name=axis_name)
