"""NumPy loop references for GTPO and Kevin: group-relative discounted per-turn returns (float64)."""

import numpy as np


def turn_returns(step_rewards, mask, gamma):
    """G_t = sum over valid k >= t of gamma^(number of valid turns from t to k) r_k; 0 if masked."""
    rewards = np.asarray(step_rewards, np.float64)
    mask = np.asarray(mask, bool)
    out = np.zeros(rewards.shape)
    for b in range(rewards.shape[0]):
        valid = [t for t in range(rewards.shape[1]) if mask[b, t]]
        for position, t in enumerate(valid):
            out[b, t] = sum(gamma ** (later - position) * rewards[b, k]
                            for later, k in enumerate(valid) if later >= position)
    return out


def turn_group_advantages(step_rewards, group_ids, mask, gamma, baseline, std, eps, singleton):
    """(G - mean_S G) / (std_S G + eps) with S the group's valid turns (at the same index)."""
    returns = turn_returns(step_rewards, mask, gamma)
    mask = np.asarray(mask, bool)
    sets = {}
    for b, g in enumerate(group_ids):
        for t in range(mask.shape[1]):
            if mask[b, t]:
                key = (int(g), t) if baseline == "same_turn" else (int(g),)
                sets.setdefault(key, []).append((b, t))
    out = np.zeros(returns.shape)
    for members in sets.values():
        values = np.array([returns[b, t] for b, t in members])
        for b, t in members:
            if len(members) == 1:
                if singleton == "raw":
                    out[b, t] = returns[b, t] if std == "none" else returns[b, t] / (1.0 + eps)
                continue
            if np.all(values == values[0]):
                continue
            mean = values.sum() / len(values)
            if std == "none":
                out[b, t] = returns[b, t] - mean
            else:
                ddof = 1 if std == "unbiased" else 0
                spread = np.sqrt(((values - mean) ** 2).sum() / (len(values) - ddof))
                out[b, t] = (returns[b, t] - mean) / (spread + eps)
    return out


def gtpo(step_rewards, group_ids, mask, gamma=0.9, baseline="same_turn", std="unbiased",
         eps=1e-6, singleton="zero"):
    return turn_group_advantages(step_rewards, group_ids, mask, gamma, baseline, std, eps,
                                 singleton)


def kevin(step_rewards, group_ids, mask, gamma=0.4, baseline="all_turns", std="none", eps=1e-8,
          singleton="zero"):
    return turn_group_advantages(step_rewards, group_ids, mask, gamma, baseline, std, eps,
                                 singleton)
