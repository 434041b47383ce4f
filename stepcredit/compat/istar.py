"""iStar: implicit step rewards on verl-agent step rows, with iStar's entry points.

iStar's functions take a verl `DataProto` and read `batch["token_level_rewards"]`
(the episode reward), `batch["rm_scores"]` (the implicit PRM's token rewards,
beta log pi_PRM / pi_old), `batch["response_mask"]` and
`non_tensor_batch["uid"]` / `["traj_uid"]`. A row's episode score is its
`token_level_rewards` summed over all tokens, its step score its `rm_scores`
summed. Both terms take their group statistics over ONE row per trajectory
of the uid and then normalise every row's own score:

    A_i = A^E(s_i) + step_advantage_w A^S(r_i)

Which row represents a trajectory (`step_baseline`):
  - "first_step" (default): its step-0 row, the documented intent. It needs
    each row's step, from `non_tensor_batch[step_key]` (default
    "step_indices").
  - "batch_order": its first row in batch order, iStar's code exactly. Its
    result changes when verl balances the batch over ranks (rows reorder).
  - "all_steps": every step row is a member of the step term's statistics
    (the paper's batch of all step rewards); the episode term still counts
    each trajectory once (its step-0 row).

Statistics: unbiased std with `epsilon` added; RLOO's n is the number of
trajectories; a uid with one trajectory keeps raw scores (mean 0, std 1).

References: Liu et al., "Agentic RL with Implicit Step Rewards" (iStar),
arXiv 2509.19199; `istar/core_istar.py`.
"""

from __future__ import annotations

from typing import Sequence

import jax.numpy as jnp
import numpy as np

from stepcredit.advantages import normalize
from stepcredit.compat._arrays import (
    broadcast,
    dense,
    host,
    like,
    normalize_by_members,
    number,
    read,
    row_sums,
    step_indices,
    token_matrix,
    token_rows,
    trajectory_members,
    trajectory_pairs,
)

_BASELINES = ("first_step", "batch_order", "all_steps")


class _Rows:
    """The iStar batch: row scores, groups, and each trajectory's representative rows."""

    def __init__(self, data, fn: str, step_baseline: str, step_key: str):
        if step_baseline not in _BASELINES:
            raise ValueError(f"{fn}: step_baseline={step_baseline!r}; it must be one of {_BASELINES}")
        self.reference = read(data, "token_level_rewards", fn)
        rewards, self.mask = token_rows(self.reference, read(data, "response_mask", fn), fn)
        size = rewards.shape[0]
        self.episode = row_sums(rewards, None)
        self.step = (row_sums(token_matrix(read(data, "rm_scores", fn), "rm_scores", rewards.shape, fn),
                              None))
        self.groups = dense(read(data, "uid", fn), "uid", size)
        traj = dense(read(data, "traj_uid", fn), "traj_uid", size)
        if step_baseline == "batch_order":
            self.members = trajectory_members(self.groups, traj)
        else:
            steps = read(data, step_key, fn, required=False)
            if steps is None:
                raise KeyError(f"{fn}: step_baseline={step_baseline!r} needs each row's step in "
                               f"non_tensor_batch[{step_key!r}]; pass step_key=, or "
                               f"step_baseline='batch_order' for iStar's batch-order rule")
            starts = np.flatnonzero(step_indices(steps, step_key, size, fn) == 0)
            pairs = trajectory_pairs(self.groups, traj)
            repeated = np.flatnonzero(np.bincount(pairs[starts]) > 1)
            if repeated.size:
                row = int(starts[pairs[starts] == repeated[0]][0])
                raise ValueError(f"{fn}: traj_uid {host(read(data, 'traj_uid', fn))[row]!r} has {step_key} 0 "
                                 f"on two rows; each trajectory has one step-0 row")
            self.members = np.full(int(pairs.max(initial=-1)) + 1, -1)
            self.members[pairs[starts]] = starts
            if (self.members < 0).any():
                missing = int(np.flatnonzero(pairs == np.flatnonzero(self.members < 0)[0])[0])
                raise ValueError(f"{fn}: traj_uid {host(read(data, 'traj_uid', fn))[missing]!r} has no "
                                 f"row with {step_key} 0")
        self.step_members = np.arange(size) if step_baseline == "all_steps" else self.members

    def out(self, advantages):
        out = like(broadcast(advantages, self.mask), self.reference)
        return out, out


def compute_istar_rloo_advantage(data, step_advantage_w=1.0, use_process_only=False,
                                 step_baseline="first_step", step_key="step_indices"):
    """iStar with RLOO at both levels (the paper's main results).

        A_i = n/(n-1) (s_i - m^E) + step_advantage_w n'/(n'-1) (r_i - m^S)

    `use_process_only=True` keeps the step term alone.

    Returns:
      `(advantages, returns)`, the same `(bs, response_length)` values.
    """
    fn = "compute_istar_rloo_advantage"
    rows = _Rows(data, fn, step_baseline, step_key)
    step = normalize_by_members(rows.step, rows.groups, rows.step_members, rule="rloo")
    if use_process_only:
        return rows.out(step)
    step_advantage_w = number(fn, "step_advantage_w", step_advantage_w)
    episode = normalize_by_members(rows.episode, rows.groups, rows.members, rule="rloo")
    return rows.out(episode + step_advantage_w * step)


def compute_istar_grpo_advantage(data, step_advantage_w=1.0, epsilon=1e-6, mode="mean_norm",
                                 step_baseline="first_step", step_key="step_indices"):
    """iStar with GRPO at both levels: mode "mean_std_norm" divides by (sd + epsilon), "mean_norm" not.

    Returns:
      `(advantages, returns)`, the same `(bs, response_length)` values.
    """
    fn = "compute_istar_grpo_advantage"
    epsilon = number(fn, "epsilon", epsilon)
    step_advantage_w = number(fn, "step_advantage_w", step_advantage_w)
    if mode not in ("mean_norm", "mean_std_norm"):
        raise ValueError(f"{fn}: mode={mode!r}; it must be 'mean_norm' or 'mean_std_norm'")
    rule = "std" if mode == "mean_std_norm" else "mean"
    rows = _Rows(data, fn, step_baseline, step_key)
    episode = normalize_by_members(rows.episode, rows.groups, rows.members, rule=rule, eps=epsilon)
    step = normalize_by_members(rows.step, rows.groups, rows.step_members, rule=rule, eps=epsilon)
    return rows.out(episode + step_advantage_w * step)


def compute_istar_reinforce_plus_baseline_advantage(data, step_advantage_w=1.0,
                                                    step_baseline="first_step",
                                                    step_key="step_indices"):
    """iStar with REINFORCE++-baseline at both levels: each term s - m, whitened over valid tokens.

    Returns:
      `(advantages, returns)`, the same `(bs, response_length)` values.
    """
    fn = "compute_istar_reinforce_plus_baseline_advantage"
    step_advantage_w = number(fn, "step_advantage_w", step_advantage_w)
    rows = _Rows(data, fn, step_baseline, step_key)

    def whitened(scores, members):
        centred = broadcast(normalize_by_members(scores, rows.groups, members, rule="mean"), rows.mask)
        return normalize.masked_whiten(centred, rows.mask)

    total = whitened(rows.episode, rows.members) + step_advantage_w * whitened(
        rows.step, rows.step_members)
    out = like(jnp.where(rows.mask, total, 0.0), rows.reference)
    return out, out


def process_outcome_combined_advantage(data, step_advantage_w=1.0, step_baseline="first_step",
                                       step_key="step_indices"):
    """iStar's "merged rewards" ablation: RLOO of s_i + step_advantage_w r_i, one term.

    Returns:
      `(advantages, returns)`, the same `(bs, response_length)` values.
    """
    fn = "process_outcome_combined_advantage"
    step_advantage_w = number(fn, "step_advantage_w", step_advantage_w)
    rows = _Rows(data, fn, step_baseline, step_key)
    merged = rows.episode + step_advantage_w * rows.step
    return rows.out(normalize_by_members(merged, rows.groups, rows.members, rule="rloo"))


__all__: Sequence[str] = (
    "compute_istar_grpo_advantage",
    "compute_istar_reinforce_plus_baseline_advantage",
    "compute_istar_rloo_advantage",
    "process_outcome_combined_advantage",
)
