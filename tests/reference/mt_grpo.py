"""NumPy loop reference for MT-GRPO (arXiv 2505.11821), written from the paper (float64)."""

import math

import numpy as np


def _normalize(value, members, std, eps):
    """GRPO normalisation of `value` against the list `members`; 0 for < 2 or all-equal."""
    n = len(members)
    if n < 2 or max(members) == min(members):
        return 0.0
    mean = sum(members) / n
    if std == "none":
        return value - mean
    dof = n - 1 if std == "unbiased" else n
    spread = math.sqrt(sum((m - mean) ** 2 for m in members) / dof)
    return (value - mean) / (spread + eps)


def mt_grpo(step_rewards, scores, group_ids, mask, lam=1.0, turn_baseline="per_turn",
            final_turn="outcome", std="unbiased", eps=1e-6):
    """A^T_{i,t} + lam A^O_i at credited turns, A^O_i at the last turn; `[B, T]`."""
    step_rewards = np.asarray(step_rewards, np.float64)
    scores = np.asarray(scores, np.float64)
    mask = np.asarray(mask, bool)
    batch, length = mask.shape
    ids = [int(g) for g in group_ids]
    outcome = []
    for i in range(batch):
        members = [scores[j] for j in range(batch) if ids[j] == ids[i]]
        outcome.append(_normalize(scores[i], members, std, eps))
    credited = np.zeros_like(mask)
    for i in range(batch):
        valid = [t for t in range(length) if mask[i, t]]
        for t in valid:
            if final_turn == "both" or t != valid[-1]:
                credited[i, t] = True
    out = np.zeros((batch, length))
    for i in range(batch):
        for t in range(length):
            if not mask[i, t]:
                continue
            if not credited[i, t]:
                out[i, t] = outcome[i]
                continue
            if turn_baseline == "per_turn":
                members = [step_rewards[j, t] for j in range(batch)
                           if ids[j] == ids[i] and credited[j, t]]
            else:
                members = [step_rewards[j, u] for j in range(batch) for u in range(length)
                           if ids[j] == ids[i] and credited[j, u]]
            out[i, t] = _normalize(step_rewards[i, t], members, std, eps) + lam * outcome[i]
    return out
