"""verl-agent: GiGPO and its step-row GRPO family, with verl-agent's names and rules.

verl-agent (the GiGPO authors' fork of verl) trains on step rows: each row of
`(bs, response_length)` is one step of an episode, `index` (the `uid`) names
the task group and `traj_index` (the `traj_uid`) the episode. Its rules,
followed here:

  - A row's score is the sum of `token_level_rewards` over ALL its tokens;
    verl-agent writes the episode reward on every step row.
  - `compute_mean_std_cross_steps=True` (its default): every step row is a
    member of its group's statistics, so an episode weighs as many times as
    it has steps. False: only the first row, in batch order, of each
    (uid, traj_uid) pair is a member. Either way every row is normalised
    with its own score.
  - Group statistics: unbiased std, `epsilon` added to it; a group with one
    member has mean 0 and std 1 (RLOO keeps the raw score).
  - GiGPO's step groups (equal anchor observations within a uid) give 0 to a
    singleton.

Inputs are NumPy arrays or torch tensors (uids as object arrays); outputs
have the rewards' type. References: Feng et al., "Group-in-Group Policy
Optimization for LLM Agent Training", arXiv 2505.10978; verl-agent
`gigpo/core_gigpo.py` and `verl/trainer/ppo/core_algos.py`.
"""

from __future__ import annotations

import difflib
from typing import Sequence

import jax.numpy as jnp
import numpy as np

from stepcredit.advantages import gae, normalize, registry
from stepcredit.advantages.inputs import CreditInputs
from stepcredit.compat._arrays import (
    StepLayout,
    broadcast,
    dense,
    host,
    is_torch,
    like,
    mask_rows,
    normalize_by_members,
    number,
    read,
    row_sums,
    row_vector,
    token_matrix,
    token_rows,
    trajectory_members,
)
from stepcredit.keys import dense_ids, stable_keys


def _members(index, traj_index, size: int, cross_steps: bool):
    groups = dense(index, "index", size)
    if cross_steps:
        return groups, np.arange(size)
    return groups, trajectory_members(groups, dense(traj_index, "traj_index", size))


def compute_gae_advantage_return(token_level_rewards, values, response_mask, gamma, lam):
    """verl-agent's (older verl's) token GAE: the recursion runs over every position.

        delta_n = r_n + gamma V_{n+1} - V_n,   A_n = delta_n + gamma lam A_{n+1}

    with V and A after the last position 0 and no skipping of masked tokens;
    advantages whitened over `response_mask`, returns A + V.

    Returns:
      `(advantages, returns)`, `(bs, response_length)`.
    """
    fn = "compute_gae_advantage_return"
    gamma = number(fn, "gamma", gamma)
    lam = number(fn, "lam", lam)
    rewards, mask = token_rows(token_level_rewards, response_mask, fn)
    inputs = CreditInputs(token_rewards=rewards, action_mask=jnp.ones_like(mask),
                          token_values=token_matrix(values, "values", rewards.shape, fn))
    out = registry.apply("token_gae", inputs, {"gamma": gamma, "lam": lam})
    advantages = normalize.masked_whiten(out.advantages, mask)
    return like(advantages, token_level_rewards), like(out.returns, token_level_rewards)


def compute_grpo_outcome_advantage(token_level_rewards, response_mask, index, traj_index,
                                   epsilon=1e-6, norm_adv_by_std_in_grpo=True,
                                   compute_mean_std_cross_steps=True):
    """GRPO on step rows: (s_i - m_g) / (sd_g + epsilon), statistics over the group's members.

    Members as in the module doc (`compute_mean_std_cross_steps`);
    `norm_adv_by_std_in_grpo=False` drops the std (Dr. GRPO).

    Args:
      token_level_rewards, response_mask: `(bs, response_length)`.
      index, traj_index: `(bs,)` group and episode uids.

    Returns:
      `(advantages, returns)`, the same `(bs, response_length)` values.
    """
    fn = "compute_grpo_outcome_advantage"
    epsilon = number(fn, "epsilon", epsilon)
    rewards, mask = token_rows(token_level_rewards, response_mask, fn)
    groups, members = _members(index, traj_index, rewards.shape[0], compute_mean_std_cross_steps)
    advantages = normalize_by_members(row_sums(rewards, None), groups, members,
                                      rule="std" if norm_adv_by_std_in_grpo else "mean",
                                      eps=epsilon)
    out = like(broadcast(advantages, mask), token_level_rewards)
    return out, out


def compute_rloo_outcome_advantage(token_level_rewards, response_mask, index, traj_index,
                                   epsilon=1e-6, compute_mean_std_cross_steps=True):
    """RLOO on step rows: n_g / (n_g - 1) (s_i - m_g) over the members; one member keeps s_i.

    With cross steps (the default) n_g counts step rows, not episodes.

    Returns:
      `(advantages, returns)`, the same `(bs, response_length)` values.
    """
    rewards, mask = token_rows(token_level_rewards, response_mask, "compute_rloo_outcome_advantage")
    groups, members = _members(index, traj_index, rewards.shape[0], compute_mean_std_cross_steps)
    advantages = normalize_by_members(row_sums(rewards, None), groups, members, rule="rloo")
    out = like(broadcast(advantages, mask), token_level_rewards)
    return out, out


def compute_reinforce_plus_plus_baseline_outcome_advantage(token_level_rewards, response_mask, index,
                                                           traj_index, epsilon=1e-6,
                                                           compute_mean_std_cross_steps=True):
    """REINFORCE++-baseline on step rows: s_i - m_g on the valid tokens, whitened over all of them.

    Returns:
      `(advantages, returns)`, the same `(bs, response_length)` values.
    """
    rewards, mask = token_rows(token_level_rewards, response_mask,
                               "compute_reinforce_plus_plus_baseline_outcome_advantage")
    groups, members = _members(index, traj_index, rewards.shape[0], compute_mean_std_cross_steps)
    centred = normalize_by_members(row_sums(rewards, None), groups, members, rule="mean")
    out = like(normalize.masked_whiten(broadcast(centred, mask), mask), token_level_rewards)
    return out, out


def compute_reinforce_plus_plus_outcome_advantage(token_level_rewards, response_mask, gamma):
    """REINFORCE++ with the return reset at every masked token (verl before 0.9).

        G_n = r_n + gamma G_{n+1} mask_{n+1}, whitened over valid tokens.

    Returns:
      `(advantages, returns)`: whitened G and G on the valid tokens, 0 off them.
    """
    fn = "compute_reinforce_plus_plus_outcome_advantage"
    gamma = number(fn, "gamma", gamma)
    rewards, mask = token_rows(token_level_rewards, response_mask, fn)
    returns = registry.apply("reinforce_pp", CreditInputs(token_rewards=rewards, action_mask=mask),
                             {"gamma": gamma, "masked": "reset"}).advantages
    advantages = normalize.masked_whiten(returns, mask)
    return like(advantages, token_level_rewards), like(returns, token_level_rewards)


def compute_step_discounted_returns(batch, gamma):
    """GiGPO's step returns R_t = sum_{k >= t} gamma^{k-t} r_k (Eq. 5) from a verl-agent batch.

    Reads `rewards` (each step row's environment reward), `traj_uid` and
    `active_masks` from `batch.non_tensor_batch`. A trajectory's steps are its
    rows in batch order (verl-agent calls this right after the rollout,
    before the batch is balanced over ranks); every row of a trajectory must
    be active.

    Returns:
      `(bs,)` float32 returns, a torch tensor on `batch.batch["input_ids"]`'s
      device when the batch holds tensors, else a NumPy array.
    """
    fn = "compute_step_discounted_returns"
    gamma = number(fn, "gamma", gamma)
    rewards = host(read(batch, "rewards", fn)).astype(np.float32).reshape(-1)
    size = rewards.shape[0]
    active = host(read(batch, "active_masks", fn)).astype(np.float32).reshape(-1)
    if active.shape[0] != size:
        raise ValueError(f"{fn}: active_masks has {active.shape[0]} entries for {size} rows")
    if size and active.min() < 1:
        row = int(np.flatnonzero(active < 1)[0])
        raise ValueError(f"{fn}: row {row} of traj_uid {host(read(batch, 'traj_uid', fn))[row]!r} "
                         f"is inactive (active_masks 0); verl-agent's rows must all be active")
    layout = StepLayout(read(batch, "traj_uid", fn), None, size, fn, traj_name="traj_uid")
    returns = gae.discounted_returns(layout.steps(jnp.asarray(rewards)), layout.mask,
                                     gamma=gamma)
    out = layout.rows(returns)
    input_ids = read(batch, "input_ids", fn, required=False)
    if input_ids is not None and is_torch(input_ids):
        import torch

        return torch.from_dlpack(out).to(device=input_ids.device, dtype=torch.float32)
    return np.asarray(out, np.float32)


def _hashable_ids(anchor_obs, rows: np.ndarray) -> np.ndarray:
    return dense_ids(stable_keys(anchor_obs[rows]), order="first")[0]


def _similar_ids(anchor_obs, rows: np.ndarray, threshold: float) -> np.ndarray:
    """Greedy clusters in batch order: a row joins the first cluster whose first member is similar."""
    representatives, ids = [], np.empty(len(rows), np.int64)
    for position, row in enumerate(rows):
        observation = anchor_obs[row]
        if not isinstance(observation, str):
            raise TypeError(f"build_step_group: anchor_obs[{row}] is {type(observation).__name__}; "
                            f"similarity grouping compares strings")
        for cluster, representative in enumerate(representatives):
            if difflib.SequenceMatcher(None, observation, representative).ratio() >= threshold:
                ids[position] = cluster
                break
        else:
            ids[position] = len(representatives)
            representatives.append(observation)
    return ids


def build_step_group(anchor_obs, index, enable_similarity=False, similarity_thresh=0.95,
                     summarize=False):
    """GiGPO's step groups: rows of one uid whose anchor observations are equal (or similar).

    Exact mode groups equal observations (compared by `stepcredit.keys.stable_key`:
    strings, numbers, arrays, lists or dicts of these). Similarity mode
    (`enable_similarity`, 0 < `similarity_thresh` < 1) clusters each uid's
    rows greedily in batch order: a row joins the first cluster whose first
    member has `difflib.SequenceMatcher` ratio >= the threshold.

    Returns:
      `(bs,)` object array of step-group ids, unique across uids. verl-agent
      draws a fresh uuid4 string per group; these are "uid-position:cluster"
      strings, equal where its groups are equal and reproducible. `summarize`
      is accepted and ignored (verl-agent prints a histogram).
    """
    fn = "build_step_group"
    size = len(index)
    if len(anchor_obs) != size:
        raise ValueError(f"{fn}: anchor_obs has {len(anchor_obs)} entries but index has {size} "
                         "rows; one observation per row")
    observations = np.empty(size, dtype=object)  # one observation per row, whatever its shape
    for row, observation in enumerate(anchor_obs):
        observations[row] = observation
    if enable_similarity:  # read only when clustering (verl-agent's default 0.95 stays unused)
        similarity_thresh = number(fn, "similarity_thresh", similarity_thresh)
        if not 0.0 < similarity_thresh < 1.0:
            raise ValueError(f"{fn}: similarity_thresh={similarity_thresh}; it must lie in (0, 1)")
    groups = dense(index, "index", size)
    out = np.empty(size, dtype=object)
    for group in range(int(groups.max(initial=-1)) + 1):
        rows = np.flatnonzero(groups == group)
        ids = (_similar_ids(observations, rows, similarity_thresh) if enable_similarity
               else _hashable_ids(observations, rows))
        out[rows] = [f"{group}:{cluster}" for cluster in ids]
    return out


def episode_norm_reward(token_level_rewards, response_mask, index, traj_index, epsilon=1e-6,
                        remove_std=True, compute_mean_std_cross_steps=True):
    """GiGPO's episode advantage A^E: GRPO over the group's members (module doc), `(bs, L)`."""
    advantages, _ = compute_grpo_outcome_advantage(token_level_rewards, response_mask, index,
                                                   traj_index, epsilon, not remove_std,
                                                   compute_mean_std_cross_steps)
    return advantages


def step_norm_reward(step_rewards, response_mask, index, epsilon=1e-6, remove_std=True):
    """GiGPO's step advantage A^S: `step_rewards` normalised within step groups `index`.

    Every row is a member; a singleton step group gives 0.

    Args:
      step_rewards: `(bs,)` discounted step returns; response_mask: `(bs, L)`;
      index: `(bs,)` step-group ids (`build_step_group`).

    Returns:
      `(bs, response_length)` advantages.
    """
    fn = "step_norm_reward"
    epsilon = number(fn, "epsilon", epsilon)
    mask = mask_rows(response_mask, fn)
    size = mask.shape[0]
    scores = row_vector(step_rewards, "step_rewards", size, fn)
    advantages = normalize_by_members(scores, dense(index, "index", size), np.arange(size),
                                      rule="mean" if remove_std else "std", eps=epsilon,
                                      singleton="zero")
    return like(broadcast(advantages, mask), step_rewards)


def compute_gigpo_outcome_advantage(token_level_rewards, step_rewards, response_mask, anchor_obs,
                                    index, traj_index, epsilon=1e-6, step_advantage_w=1.0,
                                    mode="mean_norm", enable_similarity=False,
                                    similarity_thresh=0.95):
    """GiGPO: A = A^E + step_advantage_w A^S on verl-agent step rows.

    A^E: `episode_norm_reward` (every step row a member); A^S:
    `step_norm_reward` over `build_step_group(anchor_obs, index, ...)`.
    mode "mean_std_norm" divides by (sd + epsilon) at both levels,
    "mean_norm" only subtracts the mean.

    Args:
      token_level_rewards, response_mask: `(bs, response_length)`.
      step_rewards: `(bs,)` discounted step returns (`compute_step_discounted_returns`).
      anchor_obs, index, traj_index: `(bs,)` observations, uids, episode uids.

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
    remove_std = mode == "mean_norm"
    rewards, mask = token_rows(token_level_rewards, response_mask, fn)
    row_vector(step_rewards, "step_rewards", rewards.shape[0], fn)
    episode = episode_norm_reward(rewards, mask, index, traj_index, epsilon, remove_std)
    step_groups = build_step_group(anchor_obs, index, enable_similarity, similarity_thresh)
    step = step_norm_reward(host(step_rewards), mask, step_groups, epsilon, remove_std)
    out = like(jnp.asarray(episode) + step_advantage_w * jnp.asarray(step), token_level_rewards)
    return out, out


__all__: Sequence[str] = (
    "build_step_group",
    "compute_gae_advantage_return",
    "compute_gigpo_outcome_advantage",
    "compute_grpo_outcome_advantage",
    "compute_reinforce_plus_plus_baseline_outcome_advantage",
    "compute_reinforce_plus_plus_outcome_advantage",
    "compute_rloo_outcome_advantage",
    "compute_step_discounted_returns",
    "episode_norm_reward",
    "step_norm_reward",
)
