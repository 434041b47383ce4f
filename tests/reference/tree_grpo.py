"""NumPy loop reference for Tree-GRPO (arXiv 2509.21240), written from the paper (float64)."""

import numpy as np


def _normalized(scores, i, members, std, eps, singleton):
    """(s_i - mean) / (std + eps) over `members`, with GRPO's small-group rules."""
    values = [scores[j] for j in members]
    if len(values) == 1:
        if singleton == "raw":
            return scores[i] if std == "none" else scores[i] / (1.0 + eps)
        return 0.0
    if max(values) == min(values):
        return 0.0
    mean = sum(values) / len(values)
    if std == "none":
        return scores[i] - mean
    ddof = 1 if std == "unbiased" else 0
    spread = np.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - ddof))
    return (scores[i] - mean) / (spread + eps)


def tree_grpo(scores, group_ids, tree_ids, std="unbiased", eps=1e-6, singleton="zero"):
    """A_intra (over the leaves of the leaf's tree) + A_inter (over all leaves of its task)."""
    scores = np.asarray(scores, np.float64)
    n = len(scores)
    out = np.zeros(n)
    for i in range(n):
        tree = [j for j in range(n) if tree_ids[j] == tree_ids[i]]
        task = [j for j in range(n) if group_ids[j] == group_ids[i]]
        out[i] = (_normalized(scores, i, tree, std, eps, singleton)
                  + _normalized(scores, i, task, std, eps, singleton))
    return out
