"""NumPy loop reference for VinePPO (arXiv 2410.01679), written from the paper's definitions."""

import numpy as np


def mc_values(returns):
    """V_MC(s) = (1 / K) sum_k G_k: `[P, K]` continuation returns -> `[P]`."""
    returns = np.asarray(returns, np.float64)
    return np.array([sum(row) / len(row) for row in returns])


def vineppo(rewards, values, mask, gamma=1.0):
    """A_t = r_t + gamma V_MC(s_{t+1}) - V_MC(s_t) along each row's valid steps, with
    V_MC = 0 after the last valid step; 0 at masked steps. float64 `[B, T]`."""
    rewards, values = np.asarray(rewards, np.float64), np.asarray(values, np.float64)
    out = np.zeros_like(rewards)
    for b in range(len(rewards)):
        valid = [t for t in range(rewards.shape[1]) if mask[b][t]]
        for i, t in enumerate(valid):
            following = values[b, valid[i + 1]] if i + 1 < len(valid) else 0.0
            out[b, t] = rewards[b, t] + gamma * following - values[b, t]
    return out
