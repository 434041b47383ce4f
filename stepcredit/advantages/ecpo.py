"""ECPO: GiGPO's anchor-state step advantages, shrunk towards 0 when the evidence is thin.

GiGPO compares the discounted returns of the steps taken from one anchor state;
with few rollouts an anchor group holds two or three members, and a lucky rare
action gets a step advantage as large as a well-sampled one. ECPO calibrates
that step credit before the update: each anchor group's step advantage is
multiplied by its evidence weight n / (n + kappa), n the group's number of
valid members, so small groups pull their step credit towards 0 (the episode
advantage alone) and large groups keep GiGPO's. Step groups, returns and
normalisation are GiGPO's own helpers (`stepcredit.advantages.gigpo`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from stepcredit.advantages import _checks
from stepcredit.advantages.gigpo import _check_inputs, anchor_terms, fused_on_cpu
from stepcredit.advantages.group import (SINGLETONS, STDS, _check_option,
                                         _dense_ids, _segment_sum)
from stepcredit.advantages.recurrence import Method


def _evidence_weights(step_ids: jax.Array, mask: jax.Array, num_step_groups: int, *,
                     kappa: float, axis_name: str | None = None) -> jax.Array:
    """Per step: n / (n + kappa), n the number of valid members of its step group; 0 if masked."""
    count = _segment_sum(mask.astype(jnp.float32).reshape(-1), step_ids.reshape(-1),
                         num_step_groups, axis_name)[step_ids]
    weight = count / jnp.maximum(count + kappa, jnp.finfo(jnp.float32).tiny)
    return jnp.where(mask, weight, 0.0)


def ecpo(step_rewards, anchors, group_ids, mask, *, gamma: float = 0.95, omega: float = 1.0,
         kappa: float = 1.0, std: str = "unbiased", episode_scores=None, eps: float = 1e-6,
         singleton: str = "zero", num_groups: int | None = None, axis_name: str | None = None,
         method: Method = "auto") -> jax.Array:
    """ECPO's step advantages: GiGPO's, with each anchor group's step term shrunk by n / (n + kappa).

    For trajectory i of episode group g with valid steps t, and A^E, A^S as in
    `gigpo` (episode-group and anchor-group normalised returns):

        n_S      = |S|, S = {valid (j, k) in g : anchor_k^j = anchor_t^i}
        w_S      = n_S / (n_S + kappa)                  (evidence weight)
        A_t^i    = A^E(tau_i) + omega w_S A^S_t^i,      0 at masked steps

    kappa = 0 gives GiGPO exactly (`gigpo`); kappa -> inf drops the step term
    and gives GRPO broadcast over the steps (`grpo`), as do all-distinct
    anchors for any kappa (every step group is a singleton, A^S = 0). A group
    of n members keeps the fraction n / (n + kappa) of its step credit: with
    kappa = 1, a pair keeps 2/3, a group of 8 keeps 8/9.

    Args:
      step_rewards: `[B, T]` step rewards r_t; masked entries may hold NaN.
      anchors: `[B, T]` int32 dense anchor-state ids (`stepcredit.anchors`);
        masked entries are ignored.
      group_ids: `[B]` int episode group (task) of each trajectory.
      mask: `[B, T]` bool, True on real steps, False on padding.
      gamma: step discount in [0, 1] (GiGPO's 0.95).
      omega: weight of the step advantage (GiGPO's 1.0).
      kappa: prior pseudo-count of the evidence weight, >= 0 (1.0; see Notes).
      std: "unbiased", "biased" or "none", at both levels (as in `gigpo`).
      episode_scores: optional `[B]` episode scores; None means the sum of
        the valid step rewards.
      eps: added to the std at both levels (1e-6).
      singleton: "zero" or "raw" for a one-trajectory episode group.
      num_groups: static number of episode groups, or None to remap ids.
      axis_name: mesh axis the batch is sharded over inside `shard_map`.
      method: "auto": on one CPU device, for float32 arrays and hyperparameters known
        when tracing, the whole computation by one compiled kernel (`native.anchor_groups`,
        the same numbers but for the order of each row's reward sum); elsewhere the XLA
        computation, its step returns by `reverse_linear_recurrence`'s "auto". "sequential",
        "chunked" or "associative": the XLA computation, its returns solved that way.

    Returns:
      `[B, T]` advantages, 0 at masked steps.

    Raises:
      ValueError / TypeError: everything `gigpo` raises, and kappa negative
        or not finite (when concrete).

    References:
      Li, Zhou, Duan and Chen, "When Denser Credit Is Not Enough:
      Evidence-Calibrated Policy Optimization for Long-Horizon LLM Agent
      Training", arXiv 2606.05885 (ECPO); builds on GiGPO, arXiv 2505.10978.

    Notes:
      Only the abstract and third-party summaries of arXiv 2606.05885 could
      be read here, not its equations or code. The paper's Evidence-Calibrated
      Action Advantage groups an anchor's rollouts by canonical action and
      shrinks low-count action estimates, and its Variance-Gated Credit
      Weighting down-weights anchors dominated by within-action noise. Neither
      canonical action ids nor the paper's gate formula are available
      (`CreditInputs` holds no action ids), so this implements the stated
      evidence shrinkage n / (n + kappa) of the anchor group's step advantage
      towards 0, with kappa = 1 chosen here, not taken from the paper.

    Example (the `gigpo` example, gamma = 0.5, std="none", kappa = 1: every
    anchor group with a step term has two members, so w = 2/3):

      >>> ecpo(jnp.array([[0., 0., 1.], [0., 0., jnp.nan], [1., 1., jnp.nan]]),
      ...      jnp.array([[0, 1, 2], [0, 3, -1], [0, 0, -1]]), jnp.array([0, 0, 5]),
      ...      jnp.array([[1, 1, 1], [1, 1, 0], [1, 1, 0]], bool), gamma=0.5, std="none")
      [[0.58333, 0.5, 0.5], [-0.58333, -0.5, 0.], [0.16667, -0.16667, 0.]]

    A^E = +-0.5 in group 0 and 0 in the singleton group 5; state 0 of group
    0 has A^S = +-0.125, so 0.5 + (2/3) 0.125 = 0.58333; group 5's state 0
    has A^S = +-0.25, shrunk to +-0.16667.
    """
    fn = "ecpo"
    _check_option(fn, "std", std, STDS)
    _check_option(fn, "singleton", singleton, SINGLETONS)
    _checks.finite_nonnegative(fn, eps=eps, kappa=kappa)
    step_rewards, anchors, group_ids, mask, episode_scores = _check_inputs(
        fn, step_rewards, anchors, group_ids, mask, episode_scores, gamma, omega)
    dense = _dense_ids(fn, group_ids, num_groups, axis_name)

    def xla(step_rewards, anchors, episode_ids, mask, episode_scores):
        advantages, step_ids, num_step_groups, step_advantages = anchor_terms(
            step_rewards, anchors, episode_ids, mask, episode_scores,
            num_groups=dense.num_groups, gamma=gamma, std=std, eps=eps, singleton=singleton,
            method=method, axis_name=axis_name)
        weights = _evidence_weights(step_ids, mask, num_step_groups, kappa=kappa,
                                    axis_name=axis_name).astype(step_advantages.dtype)
        return jnp.where(mask, advantages[:, None] + omega * weights * step_advantages, 0.0)

    return fused_on_cpu(xla, step_rewards, anchors, dense.ids, mask, episode_scores, gamma=gamma,
                        omega=omega, std=std, eps=eps, singleton=singleton, method=method,
                        axis_name=axis_name, kappa=kappa)
