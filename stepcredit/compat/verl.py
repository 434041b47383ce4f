"""verl-compatible advantage functions, computed by stepcredit's registered estimators.

Drop-in replacements for the `compute_*` functions of verl's `core_algos.py`
and its agentic forks (verl-agent's GiGPO, StepPO/Agent-R1's step rows,
ARLArena's EMPG): the same argument names and conventions, returning
`(advantages, returns)` of shape `(bs, response_length)`. Each runs its
estimator by name through the registry binding (`stepcredit.advantages.apply`)
on the `CreditInputs` it builds from verl's arrays.

Conventions (verl's):
  - `token_level_rewards`, `values`, `response_mask`: `(bs, response_length)`
    NumPy arrays or PyTorch tensors; the outputs have the inputs' type (and,
    for torch, device), passed through DLPack without a copy where possible.
    torch is imported only when a tensor is given.
  - `index`: `(bs,)` object array of group uids (the prompt's uid);
    `traj_index`: `(bs,)` trajectory uids; `step_index`: `(bs,)` int step of
    each row; `anchor_obs`: `(bs,)` raw observations (strings, numbers, arrays,
    lists or dicts of these).
  - Step rows: in agentic verl each row of `(bs, response_length)` is ONE
    step of a trajectory; rows sharing `traj_index` form the trajectory, in
    `step_index` order (0, 1, ..., n - 1 with none missing). A row's step
    reward is the sum of its masked token rewards; its step value is
    `values[:, 0]` (the critic at the last prompt token, after verl's shifted
    critic slice).
  - Group statistics: the unbiased std (`torch.std`), `epsilon` added to the
    std, and a singleton group keeping its raw score (mean 0, std 1).
  - Outputs are 0 where `response_mask` is 0 (verl leaves carried values
    there, which its losses mask out).
"""

from __future__ import annotations

from typing import Any, Sequence

import jax.numpy as jnp
import numpy as np

from stepcredit.advantages import gae, normalize
from stepcredit.advantages.inputs import CreditInputs
from stepcredit.advantages.registry import apply
from stepcredit.keys import dense_ids, stable_keys


# ---------------------------------------------------------------- array plumbing


def _is_torch(x: Any) -> bool:
    return type(x).__module__.split(".")[0] == "torch"


def _to_jax(x: Any) -> jnp.ndarray:
    if _is_torch(x):
        import jax.dlpack

        x = x.detach()
        try:
            return jax.dlpack.from_dlpack(x.contiguous())
        except (RuntimeError, TypeError, ValueError, BufferError):
            return jnp.asarray(x.cpu().numpy())
    return jnp.asarray(x)


def _like(x: jnp.ndarray, reference: Any, dtype=None):
    """`x` as the type of `reference`: a torch tensor on its device, or a NumPy array."""
    if _is_torch(reference):
        import torch

        out = torch.from_dlpack(x)
        return out.to(device=reference.device, dtype=dtype or reference.dtype)
    return np.array(x, dtype=dtype or np.asarray(reference).dtype)  # writable, as verl's tensors


def _host(x: Any) -> np.ndarray:
    if _is_torch(x):
        x = x.detach().cpu().numpy()
    return np.asarray(x)


def _dense(uids: Any, name: str, size: int) -> np.ndarray:
    """Dense int32 ids of `size` uids in order of first appearance (equal uids, equal ids).

    Object arrays (strings, arrays, lists or dicts of these) are compared by
    `stepcredit.keys.stable_key`, so 1 and 1.0 are different uids.
    """
    values = _host(uids).reshape(-1)
    if values.shape[0] != size:
        raise ValueError(f"{name} has {values.shape[0]} entries but the batch has {size} rows")
    if values.dtype == object:
        try:
            values = stable_keys(values)
        except TypeError as error:
            raise TypeError(f"{name}: {error}") from None
    return dense_ids(values, order="first")[0]


def _rows(token_level_rewards, response_mask, name: str):
    rewards = _to_jax(token_level_rewards)
    mask = _to_jax(response_mask).astype(bool)
    if rewards.ndim != 2 or rewards.shape != mask.shape:
        raise ValueError(f"{name}: token_level_rewards has shape {tuple(rewards.shape)} and "
                         f"response_mask {tuple(mask.shape)}; both must be (bs, response_length)")
    return rewards.astype(jnp.float32), mask


def _row_scores(rewards, mask):
    return jnp.sum(jnp.where(mask, rewards, 0.0), axis=1)


class _Layout:
    """Step rows -> `[num_trajectories, T]` step arrays, and back."""

    def __init__(self, traj_index, step_index, size: int, name: str):
        self.traj = _dense(traj_index, "traj_index", size)
        self.step = _host(step_index).reshape(-1).astype(np.int64)
        if self.step.shape[0] != size:
            raise ValueError(f"{name}: step_index has {self.step.shape[0]} entries for {size} rows")
        self.count = int(self.traj.max(initial=-1)) + 1
        self.length = int(self.step.max(initial=-1)) + 1
        if size and self.step.min() < 0:
            raise ValueError(f"{name}: step_index holds {self.step.min()}; steps start at 0")
        seen = np.zeros((self.count, self.length), np.int32)
        np.add.at(seen, (self.traj, self.step), 1)
        if (seen > 1).any():
            b, t = np.argwhere(seen > 1)[0]
            raise ValueError(f"{name}: trajectory {_host(traj_index)[self.traj == b][0]!r} has "
                             f"step {t} on two rows")
        self.mask = seen == 1
        lengths = self.mask.sum(axis=1)
        if (self.mask != (np.arange(self.length) < lengths[:, None])).any():
            b = int(np.flatnonzero((self.mask != (np.arange(self.length) < lengths[:, None])).any(1))[0])
            raise ValueError(f"{name}: trajectory {_host(traj_index)[self.traj == b][0]!r} has steps "
                             f"{sorted(self.step[self.traj == b].tolist())}; they must run 0, 1, ..., n - 1")

    def steps(self, per_row: jnp.ndarray) -> jnp.ndarray:
        return jnp.zeros((self.count, self.length), per_row.dtype).at[self.traj, self.step].set(per_row)

    def rows(self, per_step: jnp.ndarray) -> jnp.ndarray:
        return per_step[self.traj, self.step]


def _grpo(scores, group_ids, **config) -> jnp.ndarray:
    return apply("grpo", CreditInputs(scores=scores, group_ids=group_ids), config).advantages


def _broadcast(per_row: jnp.ndarray, mask: jnp.ndarray) -> jnp.ndarray:
    return jnp.where(mask, per_row[:, None], 0.0)


def _trajectory_scores(scores, index, traj_index, size: int):
    """Per-trajectory total scores, their group ids, and each row's trajectory."""
    if traj_index is None:
        return scores, _dense(index, "index", size), np.arange(size)
    traj = _dense(traj_index, "traj_index", size)
    count = int(traj.max(initial=-1)) + 1
    totals = jnp.zeros(count, scores.dtype).at[traj].add(scores)
    groups = _dense(index, "index", size)
    first = np.full(count, -1)
    first[traj[::-1]] = np.arange(size)[::-1]
    return totals, groups[first], traj


# ---------------------------------------------------------------- estimators


def compute_gae_advantage_return(token_level_rewards, values, response_mask, gamma=1.0, lam=1.0):
    """verl's token-level GAE, whitened over valid tokens (`stepcredit.token_gae`).

        delta_n = r_n + gamma V_{next(n)} - V_n,   A_n = delta_n + gamma lam A_{next(n)}

    with next(n) the next token where `response_mask` is 1 (masked tokens do
    not advance the recursion), V after the last one 0. Returns R = A + V
    (before whitening); advantages are `masked_whiten`ed over the mask.

    Args:
      token_level_rewards, values, response_mask: `(bs, response_length)`.
      gamma, lam: discount and GAE lambda (verl's defaults 1, 1).

    Returns:
      `(advantages, returns)`, `(bs, response_length)`, the inputs' type.
    """
    rewards, mask = _rows(token_level_rewards, response_mask, "compute_gae_advantage_return")
    inputs = CreditInputs(token_rewards=rewards, action_mask=mask,
                          token_values=_to_jax(values).astype(jnp.float32))
    out = apply("token_gae", inputs, {"gamma": float(gamma), "lam": float(lam)})
    advantages = normalize.masked_whiten(out.advantages, mask)
    return _like(advantages, token_level_rewards), _like(out.returns, token_level_rewards)


def compute_step_gae_advantage_return(token_level_rewards, values, response_mask, traj_index,
                                      step_index, gamma=1.0, lam=1.0):
    """StepPO's step-level GAE on verl step rows (`stepcredit.step_gae`).

    Rows are grouped into trajectories by `traj_index` and ordered by
    `step_index` on the host; each step's reward is its row's masked reward
    sum, its value `values[:, 0]`. After the recursion over steps
    (A_t = delta_t + gamma lam A_{t+1}, V after the last step 0), the step
    advantages are whitened over all step rows (not tokens: StepPO's "avoid
    counting duplicated values") and A_t, R_t = A_t + V_t are written to every
    masked-in token of the step's row.

    Args:
      token_level_rewards, values, response_mask: `(bs, response_length)`.
      traj_index: `(bs,)` trajectory uids; step_index: `(bs,)` int steps.
      gamma, lam: discount and lambda (StepPO's scripts: 1, 1).

    Returns:
      `(advantages, returns)`, `(bs, response_length)`.

    References:
      StepPO, arXiv 2604.18401, `arft/core_algos.py::compute_gae_advantage_return`.
    """
    name = "compute_step_gae_advantage_return"
    rewards, mask = _rows(token_level_rewards, response_mask, name)
    layout = _Layout(traj_index, step_index, rewards.shape[0], name)
    step_values = _to_jax(values).astype(jnp.float32)[:, 0]
    inputs = CreditInputs(step_rewards=layout.steps(_row_scores(rewards, mask)),
                          step_values=layout.steps(step_values), mask=layout.mask)
    out = apply("step_gae", inputs, {"gamma": float(gamma), "lam": float(lam)})
    advantages = normalize.masked_whiten(out.advantages, jnp.asarray(layout.mask))
    return (_like(_broadcast(layout.rows(advantages), mask), token_level_rewards),
            _like(_broadcast(layout.rows(out.returns), mask), token_level_rewards))


def compute_step_discounted_returns(token_level_rewards, response_mask, traj_index, step_index,
                                    gamma=1.0):
    """Per-row discounted step returns R_t = sum_{k >= t} gamma^{k-t} r_k (GiGPO's Eq. 5).

    Returns:
      `(bs,)` returns of each row's step, the inputs' type.
    """
    name = "compute_step_discounted_returns"
    rewards, mask = _rows(token_level_rewards, response_mask, name)
    layout = _Layout(traj_index, step_index, rewards.shape[0], name)
    returns = gae.discounted_returns(layout.steps(_row_scores(rewards, mask)), layout.mask,
                                     gamma=float(gamma))
    return _like(layout.rows(returns), token_level_rewards)


def compute_grpo_outcome_advantage(token_level_rewards, response_mask, index, traj_index=None,
                                   epsilon=1e-6, norm_adv_by_std_in_grpo=True):
    """GRPO: (s - mean_g) / (std_g + epsilon) per group of `index` (`stepcredit.grpo`).

    Without `traj_index` each row is a response scored by its reward sum
    (verl). With it, rows are steps and each trajectory's score is the sum
    over its rows, one member per trajectory (StepPO's multi-step layout).
    A singleton group keeps its raw score; `norm_adv_by_std_in_grpo=False`
    drops the std (Dr. GRPO). The advantage is broadcast to every masked-in token.

    Returns:
      `(advantages, returns)`, both the same `(bs, response_length)` scores.
    """
    rewards, mask = _rows(token_level_rewards, response_mask, "compute_grpo_outcome_advantage")
    scores, groups, row_traj = _trajectory_scores(_row_scores(rewards, mask), index, traj_index,
                                                  rewards.shape[0])
    advantages = _grpo(scores, groups, eps=float(epsilon), singleton="raw",
                       std="unbiased" if norm_adv_by_std_in_grpo else "none")
    out = _like(_broadcast(advantages[row_traj], mask), token_level_rewards)
    return out, out


def compute_rloo_outcome_advantage(token_level_rewards, response_mask, index, traj_index=None):
    """RLOO: N/(N-1) (s - mean_g) per group (`stepcredit.rloo`); a singleton keeps its score.

    Rows and `traj_index` as in `compute_grpo_outcome_advantage`.

    Returns:
      `(advantages, returns)`, both the same `(bs, response_length)` scores.
    """
    rewards, mask = _rows(token_level_rewards, response_mask, "compute_rloo_outcome_advantage")
    scores, groups, row_traj = _trajectory_scores(_row_scores(rewards, mask), index, traj_index,
                                                  rewards.shape[0])
    advantages = apply("rloo", CreditInputs(scores=scores, group_ids=groups),
                       {"singleton": "raw"}).advantages
    out = _like(_broadcast(advantages[row_traj], mask), token_level_rewards)
    return out, out


def compute_reinforce_plus_plus_outcome_advantage(token_level_rewards, response_mask, gamma=1.0):
    """REINFORCE++: token returns G_n = r_n + gamma G_{n+1} m_{n+1}, whitened over valid tokens.

    Returns:
      `(advantages, returns)`: whitened G and G, `(bs, response_length)`.
    """
    rewards, mask = _rows(token_level_rewards, response_mask,
                          "compute_reinforce_plus_plus_outcome_advantage")
    # verl 0.8's rule: the return restarts wherever response_mask is 0.
    returns = apply("reinforce_pp", CreditInputs(token_rewards=rewards, action_mask=mask),
                    {"gamma": float(gamma), "masked": "reset"}).advantages
    advantages = normalize.masked_whiten(returns, mask)
    return _like(advantages, token_level_rewards), _like(returns, token_level_rewards)


def compute_reinforce_plus_plus_baseline_outcome_advantage(token_level_rewards, response_mask, index,
                                                           traj_index=None):
    """REINFORCE++-baseline: s - mean_g, broadcast to tokens, whitened over valid tokens.

    A singleton group keeps its raw score. Rows and `traj_index` as in
    `compute_grpo_outcome_advantage`.

    Returns:
      `(advantages, returns)`, both the same `(bs, response_length)` values.
    """
    rewards, mask = _rows(token_level_rewards, response_mask,
                          "compute_reinforce_plus_plus_baseline_outcome_advantage")
    scores, groups, row_traj = _trajectory_scores(_row_scores(rewards, mask), index, traj_index,
                                                  rewards.shape[0])
    centred = apply("reinforce_pp_baseline", CreditInputs(scores=scores, group_ids=groups),
                    {"singleton": "raw"}).advantages
    advantages = normalize.masked_whiten(_broadcast(centred[row_traj], mask), mask)
    out = _like(jnp.where(mask, advantages, 0.0), token_level_rewards)
    return out, out


def compute_gigpo_outcome_advantage(token_level_rewards, step_rewards, response_mask, anchor_obs,
                                    index, traj_index, epsilon=1e-6, step_advantage_w=1.0,
                                    mode="mean_norm", compute_mean_std_cross_steps=True):
    """GiGPO on verl-agent step rows: episode advantage plus w times the anchor-state one.

        A = A^E + step_advantage_w * A^S

    A^E normalises the rows' scores (each row's masked reward sum; verl-agent
    writes the episode reward on every step row) within `index` groups. With
    `compute_mean_std_cross_steps=True` (verl-agent's default) every step row
    is a member of its group's statistics, so a trajectory weighs as many
    times as it has steps; with False each trajectory (`traj_index`) counts
    once. A singleton group keeps its raw score. A^S normalises `step_rewards`
    (the discounted step returns, `compute_step_discounted_returns`) within
    the rows of one `index` group whose `anchor_obs` are equal (exact match); a
    singleton step group gives 0. mode "mean_std_norm" divides by
    (unbiased std + epsilon) at both levels; "mean_norm" only subtracts the mean.

    Args:
      token_level_rewards, response_mask: `(bs, response_length)`.
      step_rewards: `(bs,)` discounted step returns.
      anchor_obs: `(bs,)` raw observations; index, traj_index: `(bs,)` uids.
      epsilon, step_advantage_w, mode, compute_mean_std_cross_steps: as verl-agent.

    Returns:
      `(advantages, returns)`, both the same `(bs, response_length)` values.

    References:
      Feng et al., arXiv 2505.10978; verl-agent `gigpo/core_gigpo.py`. For
      similarity-based anchors, map observations to ids first with
      `stepcredit.anchors.similarity_anchor_ids` and pass the ids.
    """
    if mode not in ("mean_norm", "mean_std_norm"):
        raise ValueError(f"compute_gigpo_outcome_advantage: mode={mode!r}; it must be 'mean_norm' "
                         f"or 'mean_std_norm'")
    std = "unbiased" if mode == "mean_std_norm" else "none"
    rewards, mask = _rows(token_level_rewards, response_mask, "compute_gigpo_outcome_advantage")
    size = rewards.shape[0]
    row_scores = _row_scores(rewards, mask)
    if compute_mean_std_cross_steps:
        episode = _grpo(row_scores, _dense(index, "index", size), eps=float(epsilon), std=std,
                        singleton="raw")
    else:
        traj = _dense(traj_index, "traj_index", size)
        first = np.full(int(traj.max(initial=-1)) + 1, -1)
        first[traj[::-1]] = np.arange(size)[::-1]
        per_trajectory = _grpo(row_scores[first], _dense(index, "index", size)[first],
                               eps=float(epsilon), std=std, singleton="raw")
        episode = per_trajectory[traj]
    groups = _dense(index, "index", size)
    anchors = _dense(anchor_obs, "anchor_obs", size)
    step_groups = _dense(groups.astype(np.int64) * (int(anchors.max(initial=0)) + 1) + anchors,
                         "anchor_obs", size)
    step = _grpo(_to_jax(step_rewards).astype(jnp.float32).reshape(-1), step_groups,
                 eps=float(epsilon), std=std, singleton="zero")
    out = _like(_broadcast(episode + float(step_advantage_w) * step, mask), token_level_rewards)
    return out, out


def compute_empg_advantage(advantages, old_entropy, response_mask, traj_index, step_index, k=1.0,
                           k_f=1.0, zeta=0.05):
    """EMPG on verl step rows (`stepcredit.empg`): entropy-modulated step advantages.

    Each row's step entropy H is the mean of `old_entropy` over its masked-in
    tokens, its advantage `advantages[:, 0]` (a step-constant advantage such as
    GRPO's or GiGPO's). Over all rows: H~ = (H - min) / (max - min + 1e-8),
    g = exp(-k H~) / mean(exp(-k H~)), A' = g A + zeta exp(-k_f H~_next) with
    H~_next of the next step of the same trajectory (none on its last step),
    then A' minus its mean over rows, broadcast to the masked-in tokens.

    Returns:
      `(advantages, returns)`, both the same `(bs, response_length)` values.

    References:
      Wang et al., arXiv 2509.09265; ARLArena (arXiv 2602.21534)
      `compute_EMPG_advantage`.
    """
    name = "compute_empg_advantage"
    values, mask = _rows(advantages, response_mask, name)
    entropy = _to_jax(old_entropy).astype(jnp.float32)
    count = jnp.maximum(jnp.sum(mask, axis=1), 1)
    step_entropy = jnp.sum(jnp.where(mask, entropy, 0.0), axis=1) / count
    layout = _Layout(traj_index, step_index, values.shape[0], name)
    inputs = CreditInputs(base_advantages=layout.steps(values[:, 0]),
                          entropy=layout.steps(step_entropy), mask=layout.mask)
    modulated = apply("empg", inputs, {"k": float(k), "k_future": float(k_f),
                                       "zeta": float(zeta)}).advantages
    out = _like(_broadcast(layout.rows(modulated), mask), advantages)
    return out, out


def compute_istar_advantage(token_level_rewards, step_rewards, response_mask, index, traj_index,
                            step_index, step_advantage_w=1.0, mode="rloo", step_baseline="first_step",
                            epsilon=1e-6, norm_adv_by_std_in_grpo=False):
    """iStar on verl-agent step rows: episode advantage plus w times the implicit step advantage.

        A = A^E + step_advantage_w * A^S

    The episode score of a trajectory is its first step row's masked reward
    sum (verl-agent writes the episode reward on every step row). A^E is RLOO
    (N/(N-1)(s - mean)) or GRPO over the `index` group's trajectories; A^S
    normalises each row's implicit step reward (`step_rewards`, beta times the
    step's summed PRM-minus-old log-ratio, `stepcredit.implicit_step_rewards`)
    the same way against the group's baseline: with step_baseline="first_step"
    (iStar's code, which de-duplicates rows by (uid, traj_uid)) the first step
    of each trajectory, with "all_steps" (the paper) every step. GRPO divides by
    (std + epsilon) only when `norm_adv_by_std_in_grpo` (the code's default
    istar_grpo mode is mean_norm). Singleton groups give 0.

    Args:
      token_level_rewards, response_mask: `(bs, response_length)`.
      step_rewards: `(bs,)` implicit step rewards.
      index, traj_index, step_index: `(bs,)` group uids, trajectory uids, steps.
      step_advantage_w: alpha (iStar's scripts: 1.0).
      mode: "rloo" (istar_rloo, the main results) or "grpo" (istar_grpo).
      step_baseline, epsilon, norm_adv_by_std_in_grpo: as above.

    Returns:
      `(advantages, returns)`, both the same `(bs, response_length)` values.

    References:
      Liu et al., "Agentic RL with Implicit Step Rewards" (iStar), arXiv
      2509.19199; `CharacterRL-iStar/istar/core_istar.py`.
    """
    name = "compute_istar_advantage"
    if mode not in ("rloo", "grpo"):
        raise ValueError(f"{name}: mode={mode!r}; it must be 'rloo' or 'grpo'")
    rewards, mask = _rows(token_level_rewards, response_mask, name)
    size = rewards.shape[0]
    layout = _Layout(traj_index, step_index, size, name)
    episode_scores = layout.steps(_row_scores(rewards, mask))[:, 0]
    groups = _dense(index, "index", size)
    first = np.zeros(layout.count, np.int64)
    first[layout.traj[layout.step == 0]] = np.flatnonzero(layout.step == 0)
    step_rewards = _to_jax(step_rewards).astype(jnp.float32).reshape(-1)
    std = "unbiased" if mode == "rloo" or norm_adv_by_std_in_grpo else "none"
    inputs = CreditInputs(scores=episode_scores, implicit_step_rewards=layout.steps(step_rewards),
                          group_ids=groups[first], mask=layout.mask)
    per_step = apply("istar", inputs, {"alpha": float(step_advantage_w), "episode": mode,
                                       "step_baseline": step_baseline, "std": std,
                                       "eps": float(epsilon)}).advantages
    out = _like(_broadcast(layout.rows(per_step), mask), token_level_rewards)
    return out, out


__all__: Sequence[str] = (
    "compute_empg_advantage",
    "compute_gae_advantage_return",
    "compute_gigpo_outcome_advantage",
    "compute_grpo_outcome_advantage",
    "compute_istar_advantage",
    "compute_reinforce_plus_plus_baseline_outcome_advantage",
    "compute_reinforce_plus_plus_outcome_advantage",
    "compute_rloo_outcome_advantage",
    "compute_step_discounted_returns",
    "compute_step_gae_advantage_return",
)
