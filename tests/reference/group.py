"""NumPy loop references for GRPO, Dr. GRPO, RLOO and REINFORCE++ (float64, dicts of groups)."""

import numpy as np


def _members(group_ids, valid=None):
    groups = {}
    for i, g in enumerate(group_ids):
        if valid is None or valid[i]:
            groups.setdefault(int(g), []).append(i)
    return groups


def group_normalize(scores, group_ids, valid=None, std="unbiased", eps=1e-6, singleton="zero"):
    """(s - mean) / (std + eps) per group, one member at a time; 0 for invalid members.

    Singleton: 0, or verl's mean 0 std 1 ("raw"). All-equal groups: 0.
    """
    scores = np.asarray(scores, np.float64)
    out = np.zeros(len(scores))
    for members in _members(group_ids, valid).values():
        values = scores[members]
        for i in members:
            if len(members) == 1:
                if singleton == "raw":
                    out[i] = scores[i] if std == "none" else scores[i] / (1.0 + eps)
                continue
            if np.all(values == values[0]):
                continue
            mean = sum(values) / len(values)
            if std == "none":
                out[i] = scores[i] - mean
            else:
                ddof = 1 if std == "unbiased" else 0
                spread = np.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - ddof))
                out[i] = (scores[i] - mean) / (spread + eps)
    return out


def grpo(scores, group_ids, std="unbiased", eps=1e-6, singleton="zero"):
    """GRPO advantage per trajectory (Dr. GRPO with std="none")."""
    return group_normalize(scores, group_ids, None, std, eps, singleton)


def rloo(scores, group_ids, singleton="zero"):
    """s_i minus the mean of the other members' scores (explicit leave-one-out sum)."""
    scores = np.asarray(scores, np.float64)
    out = np.zeros(len(scores))
    for members in _members(group_ids).values():
        for i in members:
            others = [scores[j] for j in members if j != i]
            if not others:
                out[i] = scores[i] if singleton == "raw" else 0.0
            elif np.all(scores[members] == scores[i]):
                out[i] = 0.0
            else:
                out[i] = scores[i] - sum(others) / len(others)
    return out


def reinforce_pp_baseline(scores, group_ids, singleton="zero"):
    """s_i minus the group mean of scores."""
    scores = np.asarray(scores, np.float64)
    out = np.zeros(len(scores))
    for members in _members(group_ids).values():
        for i in members:
            if len(members) == 1:
                out[i] = scores[i] if singleton == "raw" else 0.0
            elif not np.all(scores[members] == scores[i]):
                out[i] = scores[i] - sum(scores[members]) / len(members)
    return out


def reinforce_pp(token_rewards, mask, gamma, masked="carry"):
    """verl's loop: running = r_t + gamma running at valid tokens; at a masked position the
    return passes through (masked="carry", verl since PR 7300) or is reset to 0 ("reset")."""
    token_rewards = np.asarray(token_rewards, np.float64)
    out = np.zeros_like(token_rewards)
    for b in range(token_rewards.shape[0]):
        running = 0.0
        for t in reversed(range(token_rewards.shape[1])):
            if mask[b, t]:
                running = token_rewards[b, t] + gamma * running
                out[b, t] = running
            elif masked == "reset":
                running = 0.0
    return out
