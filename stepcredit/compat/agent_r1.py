"""StepPO / Agent-R1: step-level estimators on step rows, with Agent-R1's names and rules.

Agent-R1 (and StepPO, built on it) trains on step rows: each row of
`(bs, response_length)` is one agent step; `trajectory_uids` `(bs,)` names its
trajectory and `step_indices` `(bs,)` its 0-based position (rows may come in
any order; the step index, not the batch order, orders a trajectory), `index`
the task group. Its rules, followed here:

  - A step's reward is the sum of `token_level_rewards` over the row's
    masked-in tokens; its value `values[:, 0]` (the critic at the prompt's last
    token); a trajectory's score is the sum of its steps' rewards, one group
    member per trajectory.
  - Step-level results are written to every masked-in token of the row.
  - Group statistics: unbiased std, `epsilon` added to it; a singleton group
    has mean 0 and std 1; GiGPO's singleton step groups give 0.

References: StepPO, arXiv 2604.18401 (`arft/core_algos.py`); Agent-R1
(`agent_r1/trainer/ppo/core_algos.py`); GiGPO, arXiv 2505.10978.
"""

from __future__ import annotations

from typing import Sequence

import jax.numpy as jnp
import numpy as np

from stepcredit.advantages import gae, normalize, registry
from stepcredit.advantages.inputs import CreditInputs
from stepcredit.compat import verl_agent
from stepcredit.compat._arrays import (
    StepLayout,
    broadcast,
    dense,
    first_rows,
    like,
    normalize_by_members,
    number,
    row_sums,
    row_vector,
    token_matrix,
    token_rows,
)


def _layout(token_level_rewards, response_mask, trajectory_uids, step_indices, fn):
    rewards, mask = token_rows(token_level_rewards, response_mask, fn)
    layout = StepLayout(trajectory_uids, step_indices, rewards.shape[0], fn,
                        traj_name="trajectory_uids", step_name="step_indices")
    return rewards, mask, layout


def compute_gae_advantage_return(token_level_rewards, values, response_mask, trajectory_uids,
                                 step_indices, gamma, lam):
    """StepPO's step-level GAE ("sequence = action"), whitened over step rows.

        delta_t = r_t + gamma V_{t+1} - V_t,   A_t = delta_t + gamma lam A_{t+1},   R_t = A_t + V_t

    over each trajectory's steps in `step_indices` order, V after the last
    step 0; A is whitened over all step rows (StepPO: not over tokens, to
    avoid counting a step once per token).

    Args:
      token_level_rewards, values, response_mask: `(bs, response_length)`.
      trajectory_uids, step_indices: `(bs,)`.
      gamma, lam: discount and lambda (StepPO's scripts: 1, 1).

    Returns:
      `(advantages, returns)`, `(bs, response_length)`.
    """
    fn = "compute_gae_advantage_return"
    gamma = number(fn, "gamma", gamma)
    lam = number(fn, "lam", lam)
    rewards, mask, layout = _layout(token_level_rewards, response_mask, trajectory_uids, step_indices, fn)
    step_values = token_matrix(values, "values", rewards.shape, fn)[:, 0]
    inputs = CreditInputs(step_rewards=layout.steps(row_sums(rewards, mask)),
                          step_values=layout.steps(step_values), mask=layout.mask)
    out = registry.apply("step_gae", inputs, {"gamma": gamma, "lam": lam})
    advantages = normalize.masked_whiten(out.advantages, jnp.asarray(layout.mask))
    return (like(broadcast(layout.rows(advantages), mask), token_level_rewards),
            like(broadcast(layout.rows(out.returns), mask), token_level_rewards))


def compute_token_gae_advantage_return(token_level_rewards, values, response_mask, trajectory_uids,
                                       step_indices, gamma, lam):
    """Token-level GAE along a trajectory's action tokens across its steps.

    A trajectory's rows, in `step_indices` order, form one token sequence;
    GAE runs over its masked-in tokens (observation and padding tokens do not
    advance it; the value after a step's last action token is the next step's
    first action-token value), then advantages are whitened over all valid
    tokens. Returns are A + V, unwhitened.

    Returns:
      `(advantages, returns)`, `(bs, response_length)`.
    """
    fn = "compute_token_gae_advantage_return"
    gamma = number(fn, "gamma", gamma)
    lam = number(fn, "lam", lam)
    rewards, mask, layout = _layout(token_level_rewards, response_mask, trajectory_uids, step_indices, fn)
    values = token_matrix(values, "values", rewards.shape, fn)
    length = rewards.shape[1]

    def chained(x, fill):
        table = jnp.full((layout.count, layout.length, length), fill, x.dtype)
        return table.at[layout.traj, layout.step].set(x).reshape(layout.count, -1)

    inputs = CreditInputs(token_rewards=chained(rewards, 0.0), token_values=chained(values, 0.0),
                          action_mask=chained(mask, False))
    out = registry.apply("token_gae", inputs, {"gamma": gamma, "lam": lam})

    def unchained(x):
        return x.reshape(layout.count, layout.length, length)[layout.traj, layout.step]

    advantages = normalize.masked_whiten(unchained(out.advantages), mask)
    return (like(advantages, token_level_rewards),
            like(jnp.where(mask, unchained(out.returns), 0.0), token_level_rewards))


def _trajectory_scores(token_level_rewards, response_mask, index, trajectory_uids, fn):
    rewards, mask = token_rows(token_level_rewards, response_mask, fn)
    size = rewards.shape[0]
    traj = dense(trajectory_uids, "trajectory_uids", size)
    first = first_rows(traj)
    totals = jnp.zeros(first.shape[0]).at[traj].add(row_sums(rewards, mask))
    groups = dense(index, "index", size)[first]
    return totals, groups, traj, mask


def compute_grpo_outcome_advantage(token_level_rewards, response_mask, index, trajectory_uids,
                                   epsilon=1e-6, norm_adv_by_std_in_grpo=True):
    """GRPO over trajectories: (S - m_g) / (sd_g + epsilon), S a trajectory's summed step rewards.

    One member per trajectory (its group from its first row); the advantage
    is written to every row of the trajectory. `norm_adv_by_std_in_grpo=False`
    drops the std.

    Returns:
      `(advantages, returns)`, the same `(bs, response_length)` values.
    """
    fn = "compute_grpo_outcome_advantage"
    epsilon = number(fn, "epsilon", epsilon)
    totals, groups, traj, mask = _trajectory_scores(token_level_rewards, response_mask, index,
                                                    trajectory_uids, fn)
    advantages = registry.apply("grpo", CreditInputs(scores=totals, group_ids=groups),
                                {"eps": epsilon, "singleton": "raw",
                                 "std": "unbiased" if norm_adv_by_std_in_grpo else "none"}).advantages
    out = like(broadcast(advantages[traj], mask), token_level_rewards)
    return out, out


def compute_rloo_outcome_advantage(token_level_rewards, response_mask, index, trajectory_uids):
    """RLOO over trajectories: N/(N-1) (S - m_g); a singleton keeps its raw S.

    Returns:
      `(advantages, returns)`, the same `(bs, response_length)` values.
    """
    totals, groups, traj, mask = _trajectory_scores(token_level_rewards, response_mask, index,
                                                    trajectory_uids, "compute_rloo_outcome_advantage")
    advantages = registry.apply("rloo", CreditInputs(scores=totals, group_ids=groups),
                                {"singleton": "raw"}).advantages
    out = like(broadcast(advantages[traj], mask), token_level_rewards)
    return out, out


def compute_reinforce_plus_plus_baseline_outcome_advantage(token_level_rewards, response_mask, index,
                                                           trajectory_uids):
    """REINFORCE++-baseline over trajectories: S - m_g on every valid token, whitened over them.

    Returns:
      `(advantages, returns)`, the same `(bs, response_length)` values.
    """
    fn = "compute_reinforce_plus_plus_baseline_outcome_advantage"
    totals, groups, traj, mask = _trajectory_scores(token_level_rewards, response_mask, index,
                                                    trajectory_uids, fn)
    centred = registry.apply("reinforce_pp_baseline", CreditInputs(scores=totals, group_ids=groups),
                             {"singleton": "raw"}).advantages
    out = like(normalize.masked_whiten(broadcast(centred[traj], mask), mask), token_level_rewards)
    return out, out


compute_reinforce_plus_plus_outcome_advantage = verl_agent.compute_reinforce_plus_plus_outcome_advantage


def compute_step_discounted_returns(token_level_rewards, response_mask, trajectory_uids, step_indices,
                                    gamma):
    """Per-row discounted step returns R_t = sum_{k >= t} gamma^{k-t} r_k, in `step_indices` order.

    Returns:
      `(bs,)` returns, the rewards' type.
    """
    fn = "compute_step_discounted_returns"
    gamma = number(fn, "gamma", gamma)
    rewards, mask, layout = _layout(token_level_rewards, response_mask, trajectory_uids, step_indices, fn)
    returns = gae.discounted_returns(layout.steps(row_sums(rewards, mask)), layout.mask,
                                     gamma=gamma)
    return like(layout.rows(returns), token_level_rewards)


def compute_gigpo_outcome_advantage(token_level_rewards, step_rewards, response_mask, anchor_obs,
                                    index, trajectory_uids, epsilon=1e-6, step_advantage_w=1.0,
                                    mode="mean_std_norm", enable_similarity=False,
                                    similarity_thresh=0.95):
    """GiGPO on Agent-R1 step rows: A = A^E + step_advantage_w A^S.

    A^E normalises each trajectory's summed step rewards over its group's
    trajectories (one member each, a singleton keeping its raw score); A^S
    normalises `step_rewards` within the rows of one group whose anchor
    observations are equal or similar (`verl_agent.build_step_group`), a
    singleton giving 0. mode "mean_std_norm" (Agent-R1's default) divides by
    (sd + epsilon) at both levels, "mean_norm" only subtracts the mean.

    Returns:
      `(advantages, returns)`, the same `(bs, response_length)` values.
    """
    fn = "compute_gigpo_outcome_advantage"
    epsilon = number(fn, "epsilon", epsilon)
    step_advantage_w = number(fn, "step_advantage_w", step_advantage_w)
    if enable_similarity:
        similarity_thresh = number(fn, "similarity_thresh", similarity_thresh)
    if mode not in ("mean_norm", "mean_std_norm"):
        raise ValueError(f"{fn}: mode={mode!r}; it must be 'mean_norm' or 'mean_std_norm'")
    rule = "std" if mode == "mean_std_norm" else "mean"
    totals, groups, traj, mask = _trajectory_scores(token_level_rewards, response_mask, index,
                                                    trajectory_uids, fn)
    episode = normalize_by_members(totals, groups, np.arange(totals.shape[0]), rule=rule,
                                   eps=epsilon)[traj]
    size = mask.shape[0]
    scores = row_vector(step_rewards, "step_rewards", size, fn)
    step_groups = verl_agent.build_step_group(anchor_obs, index, enable_similarity, similarity_thresh)
    step = normalize_by_members(scores, dense(step_groups, "step groups", size), np.arange(size),
                                rule=rule, eps=epsilon, singleton="zero")
    out = like(broadcast(episode + step_advantage_w * step, mask), token_level_rewards)
    return out, out


__all__: Sequence[str] = (
    "compute_gae_advantage_return",
    "compute_gigpo_outcome_advantage",
    "compute_grpo_outcome_advantage",
    "compute_reinforce_plus_plus_baseline_outcome_advantage",
    "compute_reinforce_plus_plus_outcome_advantage",
    "compute_rloo_outcome_advantage",
    "compute_step_discounted_returns",
    "compute_token_gae_advantage_return",
)
