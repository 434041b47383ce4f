"""stepcredit's step-level estimators on the turns of concatenated multi-turn rows.

verl and tunix train on one row per conversation: the model's turns and the
environment's replies concatenated after the prompt, with a mask that is 1 on
the model's tokens and 0 on the others (verl's `response_mask`, tunix's
`completion_mask`). Here turn k of a row is its k-th maximal run of mask 1.
Turn k's reward is the sum of the token rewards from its first token up to the
next turn's first token (a reward written on an observation token belongs to
the turn before it; tokens before the first turn belong to the first). Its
value is `values` at its first token, its entropy the mean of `entropys` over
its tokens, its implicit reward the sum of `rm_scores` over its span, its
anchor the k-th entry of the row's `anchor_obs`; PRIME reads `rm_scores` as
its token rewards. Step advantages are written to every token of the turn.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import jax.numpy as jnp
import numpy as np

from stepcredit.advantages import normalize, registry
from stepcredit.advantages.inputs import CreditInputs
from stepcredit.compat._arrays import (dense, host, like, number, row_sums, setting, token_matrix,
                                        token_rows)
from stepcredit.keys import dense_ids, stable_keys

# The credit inputs that the rows provide (see the module doc), and the argument (verl's batch
# key) each comes from.
TURN_INPUTS = {
    "scores": "token_level_rewards", "group_ids": "index", "step_rewards": "token_level_rewards",
    "mask": "response_mask", "step_values": "values", "entropy": "entropys",
    "implicit_step_rewards": "rm_scores", "anchors": "anchor_obs", "bootstrap_value": None,
    "base_advantages": None, "prime_token_rewards": "rm_scores", "action_mask": "response_mask",
}


def reads_turn_inputs(entry: registry.Estimator) -> bool:
    return entry.output_level in ("step", "token") and all(
        field in TURN_INPUTS for field in entry.reads.values())


def turn_estimators() -> tuple[str, ...]:
    """stepcredit's step-level estimators (and PRIME's token level) that the rows can feed.

    Those whose every credit input `TURN_INPUTS` can build from the rows;
    trajectory-level ones are left to the framework's own estimators.
    """
    return tuple(name for name in registry.names() if reads_turn_inputs(registry.get(name)))


class Turns:
    """Turn spans of the rows: each token's turn, and per-turn sums, means and first tokens."""

    def __init__(self, mask: np.ndarray):
        starts = mask & ~np.pad(mask, ((0, 0), (1, 0)))[:, :-1]
        self.index = np.cumsum(starts, axis=1) - 1  # -1 before the first turn
        self.count = starts.sum(axis=1)
        self.length = max(int(self.count.max(initial=0)), 1)
        self.valid = np.arange(self.length)[None] < self.count[:, None]
        self.owner = np.maximum(self.index, 0)
        rows, first = np.nonzero(starts)
        self.first = np.zeros((mask.shape[0], self.length), np.int64)
        self.first[rows, self.index[rows, first]] = first
        self.mask = mask

    def sums(self, x: jnp.ndarray) -> jnp.ndarray:
        rows = np.broadcast_to(np.arange(x.shape[0])[:, None], x.shape)
        return jnp.zeros((x.shape[0], self.length), x.dtype).at[rows, self.owner].add(x)

    def means(self, x: jnp.ndarray) -> jnp.ndarray:
        inside = jnp.where(jnp.asarray(self.mask), x, 0.0)
        counts = jnp.asarray(self.sums(jnp.asarray(self.mask, jnp.float32)))
        return self.sums(inside) / jnp.maximum(counts, 1.0)

    def at_first(self, x: jnp.ndarray) -> jnp.ndarray:
        return jnp.take_along_axis(x, jnp.asarray(self.first), axis=1)

    def tokens(self, per_turn: jnp.ndarray) -> jnp.ndarray:
        return jnp.where(jnp.asarray(self.mask),
                         jnp.take_along_axis(per_turn, jnp.asarray(self.owner), axis=1), 0.0)


def _anchor_ids(anchor_obs, turns: Turns, fn: str) -> np.ndarray:
    rows = list(anchor_obs)  # row by row: an equal-length (bs, T) array must not be flattened
    if len(rows) != turns.mask.shape[0]:
        raise ValueError(f"{fn}: anchor_obs has {len(rows)} rows but the batch has "
                         f"{turns.mask.shape[0]}")
    flat, where = [], []
    for b, observations in enumerate(rows):
        if len(observations) != turns.count[b]:
            raise ValueError(f"{fn}: anchor_obs row {b} holds {len(observations)} observations for "
                             f"{turns.count[b]} turns; it needs one per turn (run of response_mask 1)")
        flat += list(observations)
        where += [(b, t) for t in range(len(observations))]
    ids = np.full((turns.mask.shape[0], turns.length), -1, np.int32)
    if flat:
        keys = np.empty(len(flat), dtype=object)
        keys[:] = flat
        dense_anchor = dense_ids(stable_keys(keys), order="first")[0]
        b, t = np.asarray(where).T
        ids[b, t] = dense_anchor
    return ids


def turn_credit_inputs(entry: registry.Estimator, token_level_rewards, response_mask, index=None,
                       values=None, entropys=None, rm_scores=None, anchor_obs=None,
                       fn: str = "turn estimator"):
    """The `CreditInputs` of `entry` built from the rows, and their turns.

    Builds only the fields the entry reads; a missing argument raises a
    ValueError naming it and the verl batch key it comes from.
    """
    rewards, mask = token_rows(token_level_rewards, response_mask, fn)
    turns = Turns(host(mask).astype(bool))
    given = {"index": index, "values": values, "entropys": entropys, "rm_scores": rm_scores,
             "anchor_obs": anchor_obs}
    fields = {}
    for field in entry.reads.values():
        source = TURN_INPUTS[field]
        if source in given and given[source] is None:
            raise ValueError(f"{fn}: estimator {entry.name!r} reads {field}, from {source} "
                             f"(verl's batch key {source!r}); it was not given")
        if field == "scores":
            fields[field] = row_sums(rewards, None)
        elif field == "group_ids":
            fields[field] = jnp.asarray(dense(index, "index", rewards.shape[0]))
        elif field == "step_rewards":
            fields[field] = turns.sums(rewards)
        elif field == "mask":
            fields[field] = jnp.asarray(turns.valid)
        elif field == "step_values":
            fields[field] = turns.at_first(token_matrix(values, "values", rewards.shape, fn))
        elif field == "entropy":
            fields[field] = turns.means(token_matrix(entropys, "entropys", rewards.shape, fn))
        elif field == "implicit_step_rewards":
            fields[field] = turns.sums(token_matrix(rm_scores, "rm_scores", rewards.shape, fn))
        elif field == "anchors":
            fields[field] = jnp.asarray(_anchor_ids(anchor_obs, turns, fn))
        elif field == "prime_token_rewards":
            fields[field] = token_matrix(rm_scores, "rm_scores", rewards.shape, fn)
        elif field == "action_mask":
            fields[field] = mask
    fields.setdefault("mask", jnp.asarray(turns.valid))
    return CreditInputs(**fields), turns, mask


def turn_estimator(name: str, hyperparameters: Mapping[str, Any] | None = None, *,
                   label: str | None = None) -> Callable:
    """A verl-style estimator function running stepcredit's `name` on the turns of the rows.

    The function takes verl's keyword arguments (`token_level_rewards`,
    `response_mask`, `index`, `config`) plus the inputs the estimator reads
    beyond them (`values`, `entropys`, `rm_scores`, `anchor_obs`), and returns
    `(advantages, returns)` of `(bs, response_length)`: each turn's advantage
    on its tokens, whitened over valid turns or tokens where the estimator's
    registry entry says so; returns are the critic targets where the
    estimator has them, else the advantages. Hyperparameters: the entry's
    defaults, then `config.gamma` / `config.lam` where the estimator has
    them, then `hyperparameters`.
    """
    entry = registry.get(name)
    if not reads_turn_inputs(entry):
        raise ValueError(f"turn_estimator: {name!r} reads {sorted(set(entry.reads.values()))} at "
                         f"output level {entry.output_level!r}; the rows provide step-level "
                         f"estimators reading {sorted(TURN_INPUTS)}")
    fixed = dict(hyperparameters or {})
    entry.resolve(fixed)  # an unknown hyperparameter fails here, not at the first batch

    def estimate(token_level_rewards, response_mask, index=None, config=None, values=None,
                 entropys=None, rm_scores=None, anchor_obs=None, **kwargs):
        fn = label or name
        inputs, turns, mask = turn_credit_inputs(entry, token_level_rewards, response_mask, index,
                                                 values, entropys, rm_scores, anchor_obs, fn)
        options = {key: number(fn, key, setting(config, key)) for key in ("gamma", "lam")
                   if key in entry.defaults and setting(config, key) is not None}
        out = registry.apply(entry, inputs, {**options, **fixed})
        on_tokens = turns.tokens if entry.output_level == "step" else (lambda x: x)
        advantages = out.advantages
        if entry.whiten == "steps":
            advantages = normalize.masked_whiten(advantages, inputs.mask)
        advantages = on_tokens(advantages)
        if entry.whiten == "tokens":
            advantages = normalize.masked_whiten(advantages, mask)
        returns = advantages if out.returns is None else on_tokens(out.returns)
        return like(advantages, token_level_rewards), like(returns, token_level_rewards)

    estimate.__name__ = label or name
    estimate.__doc__ = f"stepcredit's {name!r} on the turns of multi-turn rows (`stepcredit.compat._turns`)."
    return estimate
