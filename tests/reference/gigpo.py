"""NumPy loop reference for GiGPO (arXiv 2505.10978, Eqs. 3 to 8), with dicts of groups."""

import numpy as np

from tests.reference.group import group_normalize


def episode_and_returns(step_rewards, group_ids, mask, gamma, std, episode_scores, eps,
                        singleton):
    """GiGPO's episode advantage `[B]` (trajectories with a valid step) and the discounted
    step returns `[B, T]` that its step groups normalise, with the float64 mask."""
    step_rewards = np.asarray(step_rewards, np.float64)
    mask = np.asarray(mask, bool)
    batch, steps = step_rewards.shape
    has_steps = mask.any(axis=1)
    if episode_scores is None:
        episode_scores = [sum(step_rewards[b, t] for t in range(steps) if mask[b, t])
                          for b in range(batch)]
    episode_scores = np.where(has_steps, np.asarray(episode_scores, np.float64), 0.0)
    episode = group_normalize(episode_scores, group_ids, has_steps, std, eps, singleton)

    returns = np.zeros((batch, steps))
    for b in range(batch):
        running = 0.0
        for t in reversed(range(steps)):
            if mask[b, t]:
                running = step_rewards[b, t] + gamma * running
                returns[b, t] = running
    return episode, returns, mask


def gigpo(step_rewards, anchors, group_ids, mask, gamma=0.95, omega=1.0, std="unbiased",
          episode_scores=None, eps=1e-6, singleton="zero"):
    """Episode advantage (trajectories with a valid step) plus omega times the anchor-group one."""
    episode, returns, mask = episode_and_returns(step_rewards, group_ids, mask, gamma, std,
                                                 episode_scores, eps, singleton)
    batch, steps = returns.shape

    step_groups = {}
    for b in range(batch):
        for t in range(steps):
            if mask[b, t]:
                step_groups.setdefault((int(group_ids[b]), int(anchors[b, t])), []).append((b, t))
    step = np.zeros((batch, steps))
    for members in step_groups.values():
        values = [returns[b, t] for b, t in members]
        normalized = group_normalize(values, [0] * len(values), None, std, eps, "zero")
        for (b, t), value in zip(members, normalized):
            step[b, t] = value
    return np.where(mask, episode[:, None] + omega * step, 0.0)
