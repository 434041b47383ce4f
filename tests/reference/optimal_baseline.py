"""NumPy loop reference for verl's optimal token baseline (core_algos.py, OTB and TIR-OTB)."""

import numpy as np


def optimal_token_baseline(scores, group_ids, action_mask, ref_logp=None, sum_pi_squared=None,
                           eps=1e-8, align="position", handle_zero_tail=False, singleton="raw"):
    """b_n = sum_j W_jn G_jn / (sum_j W_jn + eps) over the group's valid tokens at n."""
    scores = np.asarray(scores, np.float64)
    mask = np.asarray(action_mask, bool)
    batch, num_tokens = mask.shape
    # Per trajectory: the list of (column, rank, return, W) of its action tokens.
    tokens = []
    for b in range(batch):
        running, rank, row = 0.0, 0, []
        for n in range(num_tokens):
            if not mask[b, n]:
                continue
            if ref_logp is None:
                w = 1.0
            else:
                pi = np.exp(min(float(ref_logp[b, n]), 0.0))
                square = pi if sum_pi_squared is None else float(sum_pi_squared[b, n])
                w = 1.0 - 2.0 * pi + square
            running += w
            row.append((n, rank, scores[b], running))
            rank += 1
        tokens.append(row)
    groups = {}
    for b in range(batch):
        if tokens[b]:
            groups.setdefault(int(group_ids[b]), []).append(b)
    out = np.zeros((batch, num_tokens))
    key = 0 if align == "position" else 1
    for members in groups.values():
        if len(members) == 1:
            for n, _, g, _ in tokens[members[0]]:
                out[members[0], n] = g if singleton == "raw" else 0.0
            continue
        numerator, denominator = {}, {}
        for b in members:
            for entry in tokens[b]:
                numerator[entry[key]] = numerator.get(entry[key], 0.0) + entry[3] * entry[2]
                denominator[entry[key]] = denominator.get(entry[key], 0.0) + entry[3]
        lengths = sorted(len(tokens[b]) for b in members)
        longest = [b for b in members if len(tokens[b]) == lengths[-1]]
        zero_tail = handle_zero_tail and len(longest) == 1 and lengths[-1] > lengths[-2]
        for b in members:
            for entry in tokens[b]:
                baseline = numerator[entry[key]] / (denominator[entry[key]] + eps)
                if zero_tail and b == longest[0] and entry[key] >= lengths[-2]:
                    baseline = 0.0
                out[b, entry[0]] = entry[2] - baseline
    return out
