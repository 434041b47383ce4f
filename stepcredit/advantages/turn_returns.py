"""Group-relative advantages of discounted per-turn returns: GTPO and Kevin.

Both estimators give each agent turn (step) t of trajectory i its discounted
return-to-go over the trajectory's valid turns,

    G_t^i = sum_{k >= t, valid} gamma^{k-t} r_k^i,

(`discounted_returns`), and compare it with the returns of the other
trajectories of the same group (task). They differ in their defaults: GTPO
normalises (mean and std) over the group's turns at the same turn index,
Kevin subtracts the mean over all turns of the group. The comparison set is
an option of both (`baseline`): "same_turn" (the valid turns of the group at
index t) or "all_turns" (every valid turn of the group). Statistics are
segment sums with static segment counts, so both compile with static shapes.

Conventions (never NaN), as `grpo`: a comparison set with one member gives 0
(singleton="zero") or its raw return (singleton="raw"); a set whose returns are
all equal gives 0; masked turns get 0 and may hold anything, NaN included.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from stepcredit.advantages import _checks, native
from stepcredit.advantages.gae import discounted_returns
from stepcredit.advantages.group import (SINGLETONS, STDS, _check_option, _dense_ids,
                                         _normalize, _normalize_per_turn)
from stepcredit.advantages.recurrence import Method

BASELINES = ("same_turn", "all_turns")


def _check_inputs(fn, step_rewards, group_ids, mask, gamma, baseline, std, eps, singleton):
    step_rewards = _checks.float_array(fn, "step_rewards", step_rewards, rank=2)
    mask = _checks.bool_array(fn, "mask", mask, rank=2)
    _checks.same_shape(fn, "[B, T]", step_rewards=step_rewards, mask=mask)
    group_ids = _checks.int_array(fn, "group_ids", group_ids, rank=1)
    _checks.leading_dim(fn, step_rewards.shape[0], group_ids=group_ids)
    _checks.unit_interval(fn, gamma=gamma)
    _check_option(fn, "baseline", baseline, BASELINES)
    _check_option(fn, "std", std, STDS)
    _check_option(fn, "singleton", singleton, SINGLETONS)
    _checks.finite_nonnegative(fn, eps=eps)
    _checks.finite_where(fn, "step_rewards", step_rewards, mask)
    return step_rewards, group_ids, mask


def _turn_group_advantages(fn, step_rewards, group_ids, mask, *, gamma, baseline, std, eps,
                           singleton, num_groups, method):
    """Discounted returns normalised within (group) or (group, turn index) segments."""
    step_rewards, group_ids, mask = _check_inputs(fn, step_rewards, group_ids, mask, gamma,
                                                  baseline, std, eps, singleton)
    dense = _dense_ids(fn, group_ids, num_groups, None)

    def xla(step_rewards, episode_ids, mask):
        returns = discounted_returns(step_rewards, mask, gamma=gamma, method=method)
        if baseline == "same_turn":
            return _normalize_per_turn(returns, episode_ids, mask, dense.num_groups, std=std,
                                       eps=eps, singleton=singleton)
        ids = jnp.broadcast_to(episode_ids[:, None], step_rewards.shape)
        return _normalize(returns, ids, mask, dense.num_groups, std=std, eps=eps,
                          singleton=singleton, axis_name=None)

    if (method != "auto" or step_rewards.dtype != jnp.float32
            or not _checks.is_concrete(gamma, eps)):
        return xla(step_rewards, dense.ids, mask)

    kernel = functools.partial(native.turn_groups, std=std, eps=eps, singleton=singleton,
                               pooled=baseline == "all_turns", gamma=gamma)
    return native.on_cpu(kernel, xla, step_rewards, dense.ids, mask)


def gtpo(step_rewards, group_ids, mask, *, gamma: float = 0.9, baseline: str = "same_turn",
         std: str = "unbiased", eps: float = 1e-6, singleton: str = "zero",
         num_groups: int | None = None, method: Method = "auto") -> jax.Array:
    """GTPO's turn advantages: group-normalised discounted per-turn returns.

    For trajectory i of group g and its valid turns t:

        G_t^i = r_t^i + gamma G_{next(t)}^i,        G after the last valid turn = 0
        A_t^i = (G_t^i - mean_S G) / (std_S G + eps),
        S     = {valid (j, t) : j in g}               (baseline="same_turn")
                {valid (j, k) : j in g, any k}        (baseline="all_turns")

    std="none" drops the division and eps (A = G - mean). With one turn per
    trajectory, G_0 is the trajectory's score and GTPO is GRPO (`grpo`) on
    it, for either baseline and any gamma. With gamma = 1 and the reward only
    on the last turn, every G_t is the score; with "same_turn", or with
    "all_turns", equal lengths and std "biased" or "none" (the unbiased std
    of each score repeated T times is not GRPO's), the advantage is then
    GRPO's with that std, broadcast over the turns.

    Args:
      step_rewards: `[B, T]` turn rewards r_t (masked entries may hold NaN).
      group_ids: `[B]` int group (task) of each trajectory; arbitrary values
        unless `num_groups` is given, then in [0, num_groups).
      mask: `[B, T]` bool, True on real turns; False on padding.
      gamma: turn discount in [0, 1] (default 0.9, see Notes).
      baseline: "same_turn" (default) or "all_turns", the comparison set S.
      std: "unbiased" (default), "biased" or "none".
      eps: added to the std (1e-6, as `grpo`).
      singleton: "zero" or "raw" for a comparison set with one member.
      num_groups: static number of groups, or None to remap ids.
      method: "auto": on one CPU device, for float32 rewards and gamma and eps known when
        tracing, the returns and their normalisation by one compiled kernel
        (`native.turn_groups`: the same numbers per turn, to float32 rounding over all
        turns, whose sums it adds turn by turn); elsewhere the returns by
        `discounted_returns`' "auto". "sequential", "chunked" or "associative": how the
        returns are solved (`reverse_linear_recurrence`).

    Returns:
      `[B, T]` advantages, 0 at masked turns.

    Raises:
      ValueError / TypeError: wrong rank, shape or dtype (naming the
        argument); gamma outside [0, 1]; an unknown baseline, std or
        singleton; called eagerly, NaN or inf at a valid turn reward or a
        group id outside [0, num_groups).

    References:
      Ding et al., "Empowering Multi-Turn Tool-Integrated Reasoning with Group
      Turn Policy Optimization" (GTPO), arXiv 2511.14846 (return-based
      advantage estimation).

    Notes:
      Only the abstract of the paper could be read here ("normalized
      discounted returns are calculated as advantages"); the comparison set
      (same turn index), the unbiased std, eps and gamma 0.9 are this
      library's reading, not checked against the paper's equations or the
      authors' code. baseline="all_turns" normalises over every turn of the
      group instead. The paper's self-supervised reward shaping of the turn
      rewards is the caller's step (fold it into `step_rewards`).

    Example (gamma = 0.5; one group of three trajectories, the last one turn long):

      >>> gtpo(jnp.array([[0., 1.], [0., 0.], [1., jnp.nan]]), jnp.array([0, 0, 0]),
      ...      jnp.array([[1, 1], [1, 1], [1, 0]], bool), gamma=0.5)
      [[0., 0.7071], [-1., -0.7071], [1., 0.]]

    Returns [[0.5, 1], [0, 0], [1, -]]: turn 0 has mean 0.5 and std 0.5, turn 1
    mean 0.5 and std 0.7071. With baseline="all_turns" (mean 0.5, std 0.5 over
    the five turns) it gives [[0, 1], [-1, -1], [1, 0]].
    """
    return _turn_group_advantages("gtpo", step_rewards, group_ids, mask, gamma=gamma,
                                  baseline=baseline, std=std, eps=eps, singleton=singleton,
                                  num_groups=num_groups, method=method)


def kevin(step_rewards, group_ids, mask, *, gamma: float = 0.4, baseline: str = "all_turns",
          std: str = "none", eps: float = 1e-8, singleton: str = "zero",
          num_groups: int | None = None, method: Method = "auto") -> jax.Array:
    """Kevin's turn advantages: discounted per-turn returns minus the group's mean return.

    For trajectory i of group g and its valid turns t, with s_k the score of turn k:

        G_t^i = sum_{k >= t} gamma^{k-t} s_k^i
        A_t^i = G_t^i - mean_S G,
        S     = {valid (j, k) : j in g, any k}        (baseline="all_turns")
                {valid (j, t) : j in g}               (baseline="same_turn")

    and with std="biased" or "unbiased", A_t^i = (G_t^i - mean_S G) / (std_S G
    + eps). gamma = 0 scores each turn by its own kernel; gamma = 1 with the
    score only on the last turn gives every turn the trajectory's score, and
    then, with equal lengths, Dr. GRPO (`grpo` with std="none") broadcast over
    the turns. With one turn per trajectory it is Dr. GRPO on the scores.

    Args:
      step_rewards: `[B, T]` per-turn scores s_t (masked entries may hold NaN).
      group_ids: `[B]` int group (task) of each trajectory; arbitrary values
        unless `num_groups` is given, then in [0, num_groups).
      mask: `[B, T]` bool, True on real turns; False on padding.
      gamma: turn discount in [0, 1] (0.4, the paper's best reward formulation).
      baseline: "all_turns" (default) or "same_turn", the comparison set S.
      std: "none" (default), "biased" or "unbiased".
      eps: added to the std (1e-8); ignored under std="none".
      singleton: "zero" or "raw" for a comparison set with one member.
      num_groups: static number of groups, or None to remap ids.
      method: "auto": on one CPU device, for float32 rewards and gamma and eps known when
        tracing, the returns and their normalisation by one compiled kernel
        (`native.turn_groups`: the same numbers per turn, to float32 rounding over all
        turns, whose sums it adds turn by turn); elsewhere the returns by
        `discounted_returns`' "auto". "sequential", "chunked" or "associative": how the
        returns are solved (`reverse_linear_recurrence`).

    Returns:
      `[B, T]` advantages, 0 at masked turns.

    Raises:
      As `gtpo`.

    References:
      Baronio et al., "Kevin: Multi-Turn RL for Generating CUDA Kernels",
      arXiv 2507.11948 (reward attribution across turns; gamma 0.4, the
      "sum" aggregation).

    Notes:
      The paper's discount (0.4, the discounted sum rather than the max of
      future scores) is from its reward-formulation ablation; whether its
      baseline is the mean over all turns of the group and whether it
      divides by the std could not be read here, so the defaults follow the
      formula as stated (mean over all turns, no std). The Kevin-based
      implementation in verifiers (PrimeIntellect-ai/verifiers pull request
      536, `use_stepwise_advantage`) uses the mean over all m x n turn
      samples of a prompt and divides by their population std + 1e-8:
      std="biased", eps=1e-8 reproduces it. Its "max" aggregation is not
      implemented here.

    Example (gamma = 0.5; one group of three trajectories, the last one turn long):

      >>> kevin(jnp.array([[0., 1.], [0., 0.], [1., jnp.nan]]), jnp.array([0, 0, 0]),
      ...       jnp.array([[1, 1], [1, 1], [1, 0]], bool), gamma=0.5)
      [[0., 0.5], [-0.5, -0.5], [0.5, 0.]]

    Returns [[0.5, 1], [0, 0], [1, -]] have mean 0.5 over the five turns.
    """
    return _turn_group_advantages("kevin", step_rewards, group_ids, mask, gamma=gamma,
                                  baseline=baseline, std=std, eps=eps, singleton=singleton,
                                  num_groups=num_groups, method=method)
