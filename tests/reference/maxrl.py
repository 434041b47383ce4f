"""NumPy loop reference for MaxRL (arXiv 2602.02710), written from the paper (float64)."""

import numpy as np


def maxrl(scores, group_ids, eps=0.0, divide_by_group_size=False):
    """(s_i - mean) / (mean + eps) per group; 0 for a mean <= 0, singletons, all-equal groups."""
    scores = np.asarray(scores, np.float64)
    out = np.zeros(len(scores))
    for i in range(len(scores)):
        members = [scores[j] for j in range(len(scores)) if group_ids[j] == group_ids[i]]
        mean = sum(members) / len(members)
        if len(members) < 2 or max(members) == min(members) or mean <= 0:
            continue
        out[i] = (scores[i] - mean) / (mean + eps)
        if divide_by_group_size:
            out[i] /= len(members)
    return out
