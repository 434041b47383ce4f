"""NumPy loop references for IGPO (arXiv 2510.14967): information gain and turn advantages."""

import numpy as np


def information_gain(answer_logp, mask, gain="probability"):
    """IG_t = P_{t+1} - P_t, P_t = exp(mean answer log-prob before turn t) (or the log-probs)."""
    logp = np.asarray(answer_logp, np.float64)
    mask = np.asarray(mask, bool)
    out = np.zeros(logp.shape)
    for b in range(logp.shape[0]):
        turns = [t for t in range(logp.shape[1]) if mask[b, t]]
        for t, after in zip(turns[:-1], turns[1:]):
            if gain == "probability":
                out[b, t] = np.exp(logp[b, after]) - np.exp(logp[b, t])
            else:
                out[b, t] = logp[b, after] - logp[b, t]
    return out


def _z_scores(values):
    """{key: value} -> {key: (value - mean) / (std + eps)}, 0 for fewer than two or all equal."""
    def normalise(members, std, eps):
        numbers = np.array([values[k] for k in members])
        if len(members) < 2 or np.all(numbers == numbers[0]):
            return {k: 0.0 for k in members}
        mean = numbers.mean()
        if std == "none":
            return {k: values[k] - mean for k in members}
        spread = numbers.std(ddof=1 if std == "unbiased" else 0)
        return {k: (values[k] - mean) / (spread + eps) for k in members}
    return normalise


def igpo(information_gain, scores, group_ids, mask, gamma=1.0, normalize="joint",
         order="normalize_first", std="biased", eps=1e-6):
    """r = IG before the last turn, the score at it; z-score within the group; discounted sums."""
    gains = np.asarray(information_gain, np.float64)
    mask = np.asarray(mask, bool)
    turns = {b: [t for t in range(mask.shape[1]) if mask[b, t]] for b in range(mask.shape[0])}
    rewards = {}
    for b, valid in turns.items():
        for t in valid:
            rewards[b, t] = float(scores[b]) if t == valid[-1] else gains[b, t]

    def discounted(values):
        out = {}
        for b, valid in turns.items():
            for i, t in enumerate(valid):
                out[b, t] = sum(gamma ** (j - i) * values[b, k] for j, k in enumerate(valid)
                                if j >= i)
        return out

    def normalised(values):
        sets = {}
        for b, t in values:
            kind = "all" if normalize == "joint" else (t == turns[b][-1])
            sets.setdefault((int(group_ids[b]), kind), []).append((b, t))
        out = {}
        for members in sets.values():
            out.update(_z_scores(values)(members, std, eps))
        return out

    result = (discounted(normalised(rewards)) if order == "normalize_first"
              else normalised(discounted(rewards)))
    out = np.zeros(mask.shape)
    for (b, t), value in result.items():
        out[b, t] = value
    return out
