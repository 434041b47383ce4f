"""GiGPO: group-in-group advantages, episode-level plus anchor-state step-level.

Trajectories of one task form an episode group; inside it, the steps taken
from the same environment state (the same anchor) form a step group, whose
discounted returns are compared with each other. Anchors are dense int32 ids
per batch (see `stepcredit.anchors`, which hashes raw observations on the
host). Step groups are built with static shapes: dense ids of the (group,
anchor) pairs of all B * T positions (a hash table compiled for CPU, a
lexicographic sort elsewhere), so everything compiles.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from stepcredit.advantages import _checks, native
from stepcredit.advantages.group import (SINGLETONS, STDS, _check_option, _dense_ids,
                                         _normalize)
from stepcredit.advantages.recurrence import Method, reverse_linear_recurrence, zero_carry


def _pair_ids(first: jax.Array, second: jax.Array) -> jax.Array:
    """Dense ids of the pairs (first, second) of two flat int32 arrays.

    On CPU, by the compiled hash-table kernel (`native.pair_ids`) once it is
    built; elsewhere by a lexicographic sort. The two number the pairs in
    different orders: only which positions share an id is meaningful.
    """
    first, second = first.astype(jnp.int32), second.astype(jnp.int32)  # the kernel's type
    return native.on_cpu(native.pair_ids, _sorted_pair_ids, first, second)


def _sorted_pair_ids(first: jax.Array, second: jax.Array) -> jax.Array:
    order = jnp.lexsort((second, first))
    first_sorted, second_sorted = first[order], second[order]
    starts = jnp.concatenate([jnp.ones((1,), jnp.bool_),
                              (first_sorted[1:] != first_sorted[:-1])
                              | (second_sorted[1:] != second_sorted[:-1])])
    sorted_ids = jnp.cumsum(starts.astype(jnp.int32)) - 1
    return jnp.zeros_like(sorted_ids).at[order].set(sorted_ids)


def _step_group_ids(episode_ids: jax.Array, anchors: jax.Array,
                    axis_name: str | None) -> tuple[jax.Array, int]:
    """Dense ids of (episode group, anchor) over `[B, T]`, global across `axis_name`."""
    groups = jnp.broadcast_to(episode_ids[:, None], anchors.shape).reshape(-1)
    flat_anchors = anchors.reshape(-1).astype(jnp.int32)
    if axis_name is None:
        return _pair_ids(groups, flat_anchors).reshape(anchors.shape), max(groups.size, 1)
    all_groups = jax.lax.all_gather(groups, axis_name, tiled=True)
    all_anchors = jax.lax.all_gather(flat_anchors, axis_name, tiled=True)
    ids = _pair_ids(all_groups, all_anchors)
    local = jax.lax.dynamic_slice_in_dim(ids, jax.lax.axis_index(axis_name) * groups.size,
                                         groups.size)
    return local.reshape(anchors.shape), max(all_groups.size, 1)


def _check_inputs(fn, step_rewards, anchors, group_ids, mask, episode_scores, gamma, omega):
    step_rewards = _checks.float_array(fn, "step_rewards", step_rewards, rank=2)
    anchors = _checks.int_array(fn, "anchors", anchors, rank=2)
    mask = _checks.bool_array(fn, "mask", mask, rank=2)
    _checks.same_shape(fn, "[B, T]", step_rewards=step_rewards, anchors=anchors, mask=mask)
    group_ids = _checks.int_array(fn, "group_ids", group_ids, rank=1)
    _checks.leading_dim(fn, step_rewards.shape[0], group_ids=group_ids)
    _checks.unit_interval(fn, gamma=gamma)
    if _checks.is_concrete(omega) and not np.isfinite(float(omega)):
        raise ValueError(f"{fn}: omega={float(omega)}; it must be finite")
    _checks.finite_where(fn, "step_rewards", step_rewards, mask)
    if episode_scores is not None:
        episode_scores = _checks.float_array(fn, "episode_scores", episode_scores, rank=1)
        _checks.leading_dim(fn, step_rewards.shape[0], episode_scores=episode_scores)
        _checks.finite_where(fn, "episode_scores", episode_scores, jnp.any(mask, axis=1))
    return step_rewards, anchors, group_ids, mask, episode_scores


def episode_advantages(step_rewards, episode_ids, mask, episode_scores, *, num_groups: int,
                       std: str, eps: float, singleton: str, axis_name: str | None) -> jax.Array:
    """GiGPO's episode advantages A^E `[B]`: the episode scores (by default the masked sum
    of the step rewards) normalised within their episode groups (dense `episode_ids`),
    over the rows with a valid step; shared by the GiGPO family (ECPO, HGPO)."""
    if episode_scores is None:
        episode_scores = jnp.sum(jnp.where(mask, step_rewards, 0.0), axis=1)
    return _normalize(episode_scores, episode_ids, jnp.any(mask, axis=1), num_groups, std=std,
                      eps=eps, singleton=singleton, axis_name=axis_name)


def step_returns(step_rewards, mask, *, gamma, method: Method) -> jax.Array:
    """`[B, T]` discounted returns R_t = r_t + gamma R_{t+1} over the valid steps (an invalid
    step passes R on), 0 after each row's last valid step."""
    clean_rewards = jnp.where(mask, step_rewards, 0.0)
    return reverse_linear_recurrence(
        clean_rewards, jnp.where(mask, gamma, 1.0).astype(step_rewards.dtype),
        zero_carry(clean_rewards), method=method)


def anchor_terms(step_rewards, anchors, episode_ids, mask, episode_scores, *, num_groups: int,
                 gamma, std: str, eps: float, singleton: str, method: Method,
                 axis_name: str | None):
    """GiGPO's two terms by XLA: A^E `[B]`, the step groups' ids `[B, T]` and their static
    count, and A^S `[B, T]` (the discounted returns normalised within the step groups)."""
    advantages = episode_advantages(step_rewards, episode_ids, mask, episode_scores,
                                    num_groups=num_groups, std=std, eps=eps, singleton=singleton,
                                    axis_name=axis_name)
    returns = step_returns(step_rewards, mask, gamma=gamma, method=method)
    step_ids, num_step_groups = _step_group_ids(episode_ids, anchors, axis_name)
    step_advantages = _normalize(returns, step_ids, mask, num_step_groups, std=std, eps=eps,
                                 singleton="zero", axis_name=axis_name)
    return advantages, step_ids, num_step_groups, step_advantages


def fused_on_cpu(xla, step_rewards, anchors, episode_ids, mask, episode_scores, *, gamma,
                 omega, std: str, eps, singleton: str, method: Method, axis_name: str | None,
                 depth_weights: jax.Array | None = None, min_depth: int = 1,
                 kappa=None) -> jax.Array:
    """A GiGPO-family estimator's `[B, T]` advantages.

    `xla(step_rewards, anchors, episode_ids, mask, episode_scores)` is the estimator's own
    computation (`episode_scores` None or `[B]`); on one CPU device, for float32 arrays,
    hyperparameters known when tracing and method "auto", the compiled kernel
    `native.anchor_groups` (one pass per episode group where XLA:CPU runs a dozen over
    the batch) gives the same numbers instead, once it is built (to float32 rounding: it
    sums each row's rewards in step order). `depth_weights` `[D + 1]` and `min_depth` are
    HGPO's (None: GiGPO's single depth), `kappa` ECPO's.
    """
    given = () if episode_scores is None else (episode_scores,)
    hyperparameters = (gamma, omega, eps) + (() if kappa is None else (kappa,))
    if (axis_name is not None or method != "auto" or std not in ("unbiased", "biased", "none")
            or any(x.dtype != jnp.float32 for x in (step_rewards, *given))
            or not _checks.is_concrete(*hyperparameters)):
        return xla(step_rewards, anchors, episode_ids, mask, episode_scores)
    if depth_weights is None:
        depth_weights = jnp.array([0.0, 1.0], jnp.float32)

    def default(step_rewards, anchors, episode_ids, mask, depth_weights, *scores):
        return xla(step_rewards, anchors, episode_ids, mask, scores[0] if scores else None)

    def kernel(step_rewards, anchors, episode_ids, mask, depth_weights, *scores):
        return native.anchor_groups(step_rewards, anchors, episode_ids, mask,
                                    scores[0] if scores else None, depth_weights, gamma=gamma,
                                    omega=omega, std=std, eps=eps, singleton=singleton,
                                    min_depth=min_depth, kappa=kappa)

    return native.on_cpu(kernel, default, step_rewards, anchors, episode_ids, mask,
                         depth_weights.astype(jnp.float32), *given)


def gigpo(step_rewards, anchors, group_ids, mask, *, gamma: float = 0.95, omega: float = 1.0,
          std: str = "unbiased", episode_scores=None, eps: float = 1e-6, singleton: str = "zero",
          num_groups: int | None = None, axis_name: str | None = None,
          method: Method = "auto") -> jax.Array:
    """GiGPO's step advantages: episode-group advantage plus omega times the anchor-group one.

    For trajectory i of episode group g with valid steps t:

        R(tau_i)   = sum_t r_t^i                          (or episode_scores[i])
        A^E(tau_i) = (R(tau_i) - mean_g R) / (std_g R + eps)
        R_t^i      = sum_{k >= t} gamma^{k-t} r_k^i       (discounted step return)
        A^S_t^i    = (R_t^i - mean_S R) / (std_S R + eps), S = {valid (j, k) in g :
                                                            anchor_k^j = anchor_t^i}
        A_t^i      = A^E(tau_i) + omega A^S_t^i,          0 at masked steps

    std="none" drops the division and eps at both levels. A singleton step
    group (a state visited once in the episode group) and an all-equal one
    give A^S = 0; a singleton episode group gives A^E = 0, or verl-agent's
    mean 0, std 1 (the raw score) with singleton="raw"; an all-equal episode
    group gives A^E = 0. A trajectory with no valid step is padding: it is
    left out of its episode group and gets 0 everywhere, so an all-False
    mask gives all zeros. With all anchors distinct, A^S = 0 and GiGPO is
    GRPO (`grpo`) broadcast over the steps.

    Args:
      step_rewards: `[B, T]` step rewards r_t (including any invalid-action
        penalty); masked entries may hold NaN.
      anchors: `[B, T]` int32 dense ids of the environment state each step
        acted from (`stepcredit.anchors.anchor_ids`); equal ids mean the same
        state. Masked entries are ignored. Under `axis_name`, ids must be
        consistent over the whole (global) batch.
      group_ids: `[B]` int episode group (task) of each trajectory; arbitrary
        values unless `num_groups` is given, then in [0, num_groups).
      mask: `[B, T]` bool, True on real steps, False on padding.
      gamma: step discount in [0, 1] (0.95, the authors' scripts).
      omega: weight of the step advantage (1.0, the paper).
      std: "unbiased" (torch.std, the paper's "w/ std", the ALFWorld script),
        "biased", or "none" (the paper's "w/o std", the WebShop script).
      episode_scores: optional `[B]` episode scores R(tau_i); None means the
        undiscounted sum of the valid step rewards.
      eps: added to the std at both levels (1e-6, the authors' code).
      singleton: "zero" or "raw" for a one-trajectory episode group.
      num_groups: static number of episode groups, or None to remap ids.
      axis_name: mesh axis the batch is sharded over inside `shard_map`, so
        that episode and step groups may span devices.
      method: "auto": on one CPU device, for float32 arrays and hyperparameters known
        when tracing, the whole computation by one compiled kernel (`native.anchor_groups`,
        the same numbers but for the order of each row's reward sum); elsewhere the XLA
        computation, its step returns by `reverse_linear_recurrence`'s "auto". "sequential",
        "chunked" or "associative": the XLA computation, its returns solved that way.

    Returns:
      `[B, T]` advantages, 0 at masked steps.

    Raises:
      ValueError / TypeError: wrong rank, shape or dtype (naming the
        argument); unknown std or singleton; gamma outside [0, 1]; called
        eagerly, NaN or inf at a valid step reward or in the episode score of
        a trajectory with valid steps, or a group id outside [0, num_groups).
        Under `jit` only the static checks run, and a NaN at a valid step
        spreads to its own episode and step groups only.

    References:
      Feng et al., "Group-in-Group Policy Optimization for LLM Agent
      Training", arXiv 2505.10978 (Eqs. 3 to 8).

    Notes:
      The authors' code (verl-agent `gigpo/core_gigpo.py`) gives a singleton
      episode group mean 0 and std 1 (singleton="raw"); the default here is 0,
      like the other group estimators. Its `mode="mean_std_norm"` is
      std="unbiased" and `mode="mean_norm"` is std="none". Some versions of
      that code take the episode statistics over step rows
      (`compute_mean_std_cross_steps=True`), weighting each trajectory by its
      number of steps; here each trajectory counts once, as in the paper.
      The paper also describes similarity-based anchors for QA; build those
      on the host with `stepcredit.anchors.similarity_anchor_ids`.

    Example (gamma = 0.5, std="none"; group 0 has two trajectories that both
    start in state 0; group 5 has one trajectory that stays in state 0):

      >>> gigpo(jnp.array([[0., 0., 1.], [0., 0., jnp.nan], [1., 1., jnp.nan]]),
      ...       jnp.array([[0, 1, 2], [0, 3, -1], [0, 0, -1]]), jnp.array([0, 0, 5]),
      ...       jnp.array([[1, 1, 1], [1, 1, 0], [1, 1, 0]], bool), gamma=0.5, std="none")
      [[0.625, 0.5, 0.5], [-0.625, -0.5, 0.], [0.25, -0.25, 0.]]

    Scores 1 and 0 give A^E = +-0.5; state 0 in group 0 has returns 0.25 and
    0 (A^S = +-0.125); group 5 is a singleton (A^E = 0) whose state 0 has
    returns 1.5 and 1 (A^S = +-0.25). With std="unbiased" the first row is
    [1.4142, 0.7071, 0.7071] (to within eps).
    """
    fn = "gigpo"
    _check_option(fn, "std", std, STDS)
    _check_option(fn, "singleton", singleton, SINGLETONS)
    _checks.finite_nonnegative(fn, eps=eps)
    step_rewards, anchors, group_ids, mask, episode_scores = _check_inputs(
        fn, step_rewards, anchors, group_ids, mask, episode_scores, gamma, omega)
    dense = _dense_ids(fn, group_ids, num_groups, axis_name)

    def xla(step_rewards, anchors, episode_ids, mask, episode_scores):
        advantages, _, _, step_advantages = anchor_terms(
            step_rewards, anchors, episode_ids, mask, episode_scores,
            num_groups=dense.num_groups, gamma=gamma, std=std, eps=eps, singleton=singleton,
            method=method, axis_name=axis_name)
        return jnp.where(mask, advantages[:, None] + omega * step_advantages, 0.0)

    return fused_on_cpu(xla, step_rewards, anchors, dense.ids, mask, episode_scores, gamma=gamma,
                        omega=omega, std=std, eps=eps, singleton=singleton, method=method,
                        axis_name=axis_name)
