"""Every registered estimator's step credit on the same sampled episodes.

Each estimator runs through the trainer's own call
(`stepcredit.credit.compiled_compute_advantages`, whitening included), so a
diagnosis grades exactly the advantages a stepcredit policy loss would see.
Credit is compared per step: trajectory-level advantages are broadcast over
the trajectory's steps, token-level ones are averaged over each step's action
tokens.

The token view: with an implicit PRM (`stepcredit.diagnose.prm`), its
tokenisation; otherwise one token per whitespace-separated word of each
action. Shapes are padded to powers of two so that one compilation serves
every simulator.
"""

from __future__ import annotations

from typing import Any, Mapping, NamedTuple, Sequence

import numpy as np

from stepcredit import advantages as adv
from stepcredit.batch import StepBatch, TokenBatch
from stepcredit.credit import compiled_compute_advantages
from stepcredit.diagnose.episodes import Episode, Stacked

# Reference rows graded beside the estimators: the truth itself (an upper
# bound) and credit drawn at random (the floor).
REFERENCES = ("mc_advantage", "random")


class TokenView(NamedTuple):
    """`[B, N]` action tokens of each episode; PRM log-probs when fitted."""

    step_index: np.ndarray
    prm_logp: np.ndarray | None = None
    ref_logp: np.ndarray | None = None


def bucket(n: int) -> int:
    """The power of two at or above `n` (at least 1)."""
    return 1 << max(0, int(n) - 1).bit_length()


def word_tokens(episodes: Sequence[Episode]) -> TokenView:
    """One action token per whitespace-separated word of each step's action (at least one)."""
    rows = [np.repeat(np.arange(e.length), [max(1, len(a.split())) for a in e.actions])
            for e in episodes]
    step_index = np.full((len(rows), max(len(r) for r in rows)), -1, dtype=np.int32)
    for i, r in enumerate(rows):
        step_index[i, :len(r)] = r
    return TokenView(step_index)


def _pad(x: np.ndarray, shape: tuple[int, ...], fill) -> np.ndarray:
    out = np.full(shape, fill, dtype=x.dtype)
    out[tuple(slice(0, s) for s in x.shape)] = x
    return out


def _batches(stacked: Stacked, values: np.ndarray, tokens: TokenView, t_pad: int, n_pad: int):
    b, t = stacked.mask.shape
    b_pad = bucket(b)
    mask = _pad(stacked.mask, (b_pad, t_pad), False)
    lengths = stacked.mask.sum(1)
    last = np.zeros((b, t), bool)
    last[np.arange(b), lengths - 1] = True
    truncated = last & stacked.truncated[:, None]
    steps = StepBatch(
        reward=_pad(stacked.rewards, (b_pad, t_pad), 0.0), mask=mask,
        done=_pad(last & ~truncated, (b_pad, t_pad), False),
        truncated=_pad(truncated, (b_pad, t_pad), False),
        value=_pad(values.astype(np.float32), (b_pad, t_pad), 0.0),
        entropy=_pad(stacked.entropy, (b_pad, t_pad), 0.0),
        logp=np.zeros((b_pad, t_pad), np.float32),
        anchor=_pad(stacked.anchors, (b_pad, t_pad), -1),
        # Padding rows form their own singleton groups, which every group
        # estimator gives zero advantage.
        group_id=np.concatenate([stacked.group_ids,
                                 stacked.group_ids.max() + 1 + np.arange(b_pad - b)]).astype(np.int32),
        score=_pad(np.where(stacked.mask, stacked.rewards, 0).sum(1).astype(np.float32), (b_pad,), 0.0),
        bootstrap_value=np.zeros(b_pad, np.float32))
    step_index = _pad(tokens.step_index, (b_pad, n_pad), -1)
    zeros = np.zeros((b_pad, n_pad), np.float32)
    token_batch = TokenBatch(tokens=np.zeros((b_pad, n_pad), np.int32), action_mask=step_index >= 0,
                             step_index=step_index, logp=zeros, entropy=zeros)
    token_values = np.asarray(adv.broadcast_to_tokens(steps.value, step_index))
    prm = {}
    if tokens.prm_logp is not None:
        prm = {"prm_logp": _pad(tokens.prm_logp.astype(np.float32), (b_pad, n_pad), 0.0),
               "ref_logp": _pad(tokens.ref_logp.astype(np.float32), (b_pad, n_pad), 0.0)}
    return steps, token_batch, token_values, prm


def step_means(token_credit: np.ndarray, step_index: np.ndarray, num_steps: int) -> np.ndarray:
    """`[B, T]` mean of each step's action-token credit `[B, N]` (0 for a step without tokens)."""
    b = token_credit.shape[0]
    rows = np.repeat(np.arange(b), step_index.shape[1]).reshape(step_index.shape)
    on = step_index >= 0
    sums = np.zeros((b, num_steps))
    counts = np.zeros((b, num_steps))
    np.add.at(sums, (rows[on], step_index[on]), token_credit[on])
    np.add.at(counts, (rows[on], step_index[on]), 1.0)
    return np.where(counts > 0, sums / np.maximum(counts, 1.0), 0.0)


def step_credit(names: Sequence[str], stacked: Stacked, values: np.ndarray, tokens: TokenView, *,
                num_steps: int | None = None, num_tokens: int | None = None,
                config: Mapping[str, Mapping[str, Any]] | None = None) -> dict[str, np.ndarray]:
    """Each estimator's `[B, T]` step credit (0 on padding).

    Args:
      names: registered estimator names.
      stacked: the episodes (`stack`).
      values: `[B, T]` V(s_t) for the critic-based estimators.
      tokens: the token view (PRM log-probs for iStar and PRIME).
      num_steps, num_tokens: pad T and N to these (default: the next power of
        two); give the same across simulators to compile once.
      config: per-estimator hyperparameter overrides.

    Returns:
      name -> `[B, T]` float64 credit.
    """
    b, t = stacked.mask.shape
    t_pad = num_steps or bucket(t)
    n_pad = num_tokens or bucket(tokens.step_index.shape[1])
    steps, token_batch, token_values, prm = _batches(stacked, values, tokens, t_pad, n_pad)
    out = {}
    for name in names:
        credit = compiled_compute_advantages(steps, token_batch, name, token_values=token_values,
                                             **prm, **dict((config or {}).get(name, {})))
        if credit.step_advantages is not None:
            per_step = np.asarray(credit.step_advantages, dtype=np.float64)
        else:
            per_step = step_means(np.asarray(credit.token_advantages, dtype=np.float64),
                                  token_batch.step_index, t_pad)
        out[name] = np.where(stacked.mask, per_step[:b, :t], 0.0)
    return out


def reference_credit(stacked: Stacked, seed: int) -> dict[str, np.ndarray]:
    """The reference rows: the Monte Carlo A^pi itself, and standard normal noise."""
    noise = np.random.default_rng([seed, 7]).standard_normal(stacked.mask.shape)
    truth = np.where(stacked.mask, np.nan_to_num(stacked.advantage), 0.0)
    return {"mc_advantage": truth, "random": np.where(stacked.mask, noise, 0.0)}
