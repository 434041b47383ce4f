"""Rows that share a context, computed once.

The 8 rollouts of a task start from the same prompt, and a policy that has
learned a task keeps choosing the same actions, so many step rows of a batch
are the same prompt (on the README's HotpotQA run, a third of the rows are
distinct). What the learner reads of a row, its log-probs, entropies and
values at the action tokens, depends only on the tokens before its last
action token: under causal attention the last token is a target, never an
input. Rows that agree on those tokens (and on where their action starts) get
the same model outputs, so the model runs on one row of each kind and the
outputs are gathered back; each row then scores its own action tokens. The
results equal the unshared computation up to float rounding, and the
gradient through the gather sums the shared rows' terms exactly as separate
rows would.

`shared_rows` finds the kinds on the host (NumPy), and rounds their number up
to a power of two so that a few compiled shapes serve every batch.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import numpy as np

MIN_SHARED_ROWS = 8
"""The fewest rows a shared computation runs (bounds the compiled shapes from below)."""


class SharedRows(NamedTuple):
    """Which rows the model runs on and where each row's outputs come from.

    Attributes:
      unique: `[U]` int32 row indices the model runs on (U a power of two, at
        least `MIN_SHARED_ROWS`, at most B; entries past the distinct rows
        repeat the first and are read by no row).
      inverse: `[B]` int32, row b's outputs are those of row `unique[inverse[b]]`.
    """

    unique: np.ndarray
    inverse: np.ndarray


def every_row(batch: int) -> SharedRows:
    """The unshared computation: every row is its own kind."""
    rows = np.arange(batch, dtype=np.int32)
    return SharedRows(rows, rows)


def _bucket(count: int, batch: int) -> int:
    return min(batch, max(MIN_SHARED_ROWS, 1 << max(count - 1, 0).bit_length()))


def _kinds(keys: np.ndarray) -> SharedRows:
    """Groups equal rows of `keys` `[B, K]`."""
    batch = keys.shape[0]
    kind_of: dict[bytes, int] = {}  # a row's bytes -> its kind, kinds numbered by first row
    inverse = np.array([kind_of.setdefault(row.tobytes(), len(kind_of)) for row in keys],
                       np.int32)
    size = _bucket(len(kind_of), batch)
    if size == batch:
        return every_row(batch)
    _, first = np.unique(inverse, return_index=True)
    unique = np.full(size, first[0], np.int32)
    unique[:len(first)] = first
    return SharedRows(unique, inverse)


def shared_rows(tokens, mask, action_mask, *, markers: Sequence[int] = ()) -> SharedRows:
    """Groups step rows whose model outputs at the action tokens are equal.

    Two rows are of one kind when their real tokens agree everywhere but at
    their last action token, and their action tokens sit in the same columns.
    With `markers` (the pointer's label markers, `TransformerPolicy.choice_logits`),
    a last action token that is a marker is an input (it makes the token before
    it a label), so it must agree too.

    Args:
      tokens: `[B, L]` int ids.
      mask: `[B, L]` bool, true on real tokens.
      action_mask: `[B, L]` bool, true on the action tokens.
      markers: the ids that follow a label, or () without the pointer.

    Returns:
      `SharedRows`; `every_row(B)` when the kinds would not fit in fewer rows.
    """
    tokens, mask = np.asarray(tokens), np.asarray(mask, bool)
    action_mask = np.asarray(action_mask, bool)
    if tokens.ndim != 2 or mask.shape != tokens.shape or action_mask.shape != tokens.shape:
        raise ValueError(f"shared_rows: tokens {tokens.shape}, mask {mask.shape} and action_mask "
                         f"{action_mask.shape} must be one [B, L] shape")
    context = np.where(mask, tokens, -1).astype(np.int64)
    rows = np.nonzero(action_mask.any(axis=1))[0]
    last = tokens.shape[1] - 1 - np.argmax(action_mask[rows, ::-1], axis=1)
    target_only = ~np.isin(tokens[rows, last], np.asarray(markers, tokens.dtype))
    context[rows[target_only], last[target_only]] = -2
    return _kinds(np.concatenate([context, action_mask.astype(np.int64)], axis=1))


def shared_prompts(tokens, mask) -> SharedRows:
    """Groups equal prompts (`[B, P]` tokens and mask), for sampling: every token of a
    prompt is an input."""
    tokens, mask = np.asarray(tokens), np.asarray(mask, bool)
    return _kinds(np.where(mask, tokens, -1))
