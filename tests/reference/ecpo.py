"""NumPy loop reference for ECPO (arXiv 2606.05885): GiGPO with step terms shrunk by n / (n + kappa)."""

import numpy as np

from tests.reference.gigpo import episode_and_returns
from tests.reference.group import group_normalize


def ecpo(step_rewards, anchors, group_ids, mask, gamma=0.95, omega=1.0, kappa=1.0,
         std="unbiased", episode_scores=None, eps=1e-6, singleton="zero"):
    """Episode advantage plus omega * n_S / (n_S + kappa) * the anchor-group step advantage."""
    episode, returns, mask = episode_and_returns(step_rewards, group_ids, mask, gamma, std,
                                                 episode_scores, eps, singleton)
    batch, steps = returns.shape

    step_groups = {}
    for b in range(batch):
        for t in range(steps):
            if mask[b, t]:
                step_groups.setdefault((int(group_ids[b]), int(anchors[b, t])), []).append((b, t))
    out = np.zeros((batch, steps))
    for members in step_groups.values():
        n = len(members)
        weight = n / (n + kappa) if n + kappa > 0 else 0.0
        values = [returns[b, t] for b, t in members]
        normalized = group_normalize(values, [0] * n, None, std, eps, "zero")
        for (b, t), value in zip(members, normalized):
            out[b, t] = episode[b] + omega * weight * value
    return out
