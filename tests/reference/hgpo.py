"""NumPy loop reference for HGPO (arXiv 2602.22817): history-nested step groups, mixed by depth."""

import numpy as np

from tests.reference.gigpo import episode_and_returns
from tests.reference.group import group_normalize


def hgpo(step_rewards, anchors, group_ids, mask, gamma=0.95, omega=1.0, max_depth=3,
         min_depth=1, alpha=1.0, std="unbiased", episode_scores=None, eps=1e-6,
         singleton="zero"):
    """Episode advantage plus omega times the weighted mean of the depths' step advantages."""
    episode, returns, mask = episode_and_returns(step_rewards, group_ids, mask, gamma, std,
                                                 episode_scores, eps, singleton)
    batch, steps = returns.shape

    def history(b, t, depth):  # the last `depth` states of row b ending at t (None: before it)
        return tuple(int(anchors[b, t - l]) if t - l >= 0 else None for l in range(depth))

    total, weight = np.zeros((batch, steps)), np.zeros((batch, steps))
    for depth in range(min_depth, max_depth + 1):
        groups = {}
        for b in range(batch):
            for t in range(steps):
                if mask[b, t]:
                    groups.setdefault((int(group_ids[b]), history(b, t, depth)), []).append((b, t))
        for members in groups.values():
            if len(members) < 2:
                continue
            values = [returns[b, t] for b, t in members]
            normalized = group_normalize(values, [0] * len(values), None, std, eps, "zero")
            w = float(depth - min_depth + 1) ** alpha
            for (b, t), value in zip(members, normalized):
                total[b, t] += w * value
                weight[b, t] += w
    step = np.divide(total, weight, out=np.zeros_like(total), where=weight > 0)
    return np.where(mask, episode[:, None] + omega * step, 0.0)
