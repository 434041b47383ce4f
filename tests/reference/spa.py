"""NumPy loop references for SPA-RL (arXiv 2505.20732): fused step rewards, PPO's token GAE
on them, and the progress estimator's sum-to-outcome loss."""

import numpy as np

from tests.reference.gae import gae


def fused_rewards(progress, grounding, mask, alpha, beta):
    """r_t = alpha c_t + beta g_t on valid steps, 0 elsewhere."""
    out = np.zeros(np.shape(progress))
    for b in range(out.shape[0]):
        for t in range(out.shape[1]):
            if mask[b, t]:
                out[b, t] = alpha * float(progress[b, t]) + beta * float(grounding[b, t])
    return out


def spa(progress, grounding, mask, step_index, token_values, bootstrap, alpha, beta, gamma, lam):
    """Each step's fused reward on its last action token, then GAE along the action tokens."""
    rewards = fused_rewards(progress, grounding, mask, alpha, beta)
    token_rewards = np.zeros(np.shape(step_index))
    for b, row in enumerate(step_index):
        for n, step in enumerate(row):
            last = n + 1 == len(row) or row[n + 1] != step
            if step >= 0 and last:
                token_rewards[b, n] = rewards[b, step]
    return gae(token_rewards, token_values, np.asarray(step_index) >= 0, gamma, lam, bootstrap)


def progress_loss(progress, mask, outcomes):
    """Mean over trajectories with a valid step of (sum of their contributions - outcome)^2."""
    errors = []
    for row, valid, outcome in zip(progress, mask, outcomes):
        if valid.any():
            errors.append((sum(float(c) for c, v in zip(row, valid) if v) - outcome) ** 2)
    return float(np.mean(errors)) if errors else 0.0
