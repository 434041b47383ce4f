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


def bucket_size(count: int, batch: int) -> int:
    """The rows a computation over `count` kinds runs: a power of two, at least
    `MIN_SHARED_ROWS`, at most `batch`."""
    return min(batch, max(MIN_SHARED_ROWS, 1 << max(count - 1, 0).bit_length()))


def _kinds(keys: np.ndarray) -> SharedRows:
    """Groups equal rows of `keys` `[B, K]`."""
    batch = keys.shape[0]
    kind_of: dict[bytes, int] = {}  # a row's bytes -> its kind, kinds numbered by first row
    inverse = np.array([kind_of.setdefault(row.tobytes(), len(kind_of)) for row in keys],
                       np.int32)
    size = bucket_size(len(kind_of), batch)
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


WIDTH_QUANTUM = 64
"""Prefill widths are multiples of this, so that a few compiled shapes serve every batch."""

ROW_QUANTUM = 64
"""Past this many kinds a prefill pass runs a multiple of it rows (below it a power of
two): a pass of 700 prompts runs 704 rows, not 1024, for at most B / 64 shapes a width."""

SPLIT_SAVING = 0.25
"""The least fraction of the prefill's estimated work a split by width must save; below
it one pass at the full width is kept (a second pass costs a dispatch, and its shape
perhaps a compilation)."""


class PrefillPass(NamedTuple):
    """Rows of a prompt batch that run together, at the last `width` columns.

    Attributes:
      rows: `[U]` int32 row indices (U from `pass_rows`; entries past the pass's kinds
        repeat its first row and are read by no row).
      width: the columns the pass runs on, the last `width` of the batch's P; every
        real token of its rows lies in them (the prompts are left-padded).
    """

    rows: np.ndarray
    width: int


def pass_rows(count: int, batch: int) -> int:
    """The rows a prefill pass over `count` kinds runs (at most `batch`): `bucket_size`
    up to `ROW_QUANTUM`, then the next multiple of `ROW_QUANTUM`."""
    if count <= ROW_QUANTUM:
        return bucket_size(count, batch)
    return min(batch, -(-count // ROW_QUANTUM) * ROW_QUANTUM)


def _prefill_cost(rows: int, width: int) -> float:
    """Relative work of a prefill: the per-token layers grow with the width and causal
    attention with its square (the constant weighs the two as measured on the small
    policies: 704 columns cost 1.9 times 448, and 448 twice 256)."""
    return rows * width * (width + 1024)


def prefill_passes(mask, shared: SharedRows | None = None) -> tuple[list[PrefillPass], np.ndarray]:
    """Splits a left-padded prompt batch's kinds into one or two prefill passes by length.

    A batch is padded to its longest prompt, so short prompts (a continuation's early
    steps beside long search pages) spend most of their prefill on padding. The kinds
    (`shared`'s, or every row) whose real tokens fit in the last w columns run at width
    w, the others at the full width P, for the w (a multiple of `WIDTH_QUANTUM`) that
    saves the most estimated work (`_prefill_cost`, each pass's rows rounded by
    `pass_rows`), when it saves at least `SPLIT_SAVING` of one pass of every kind at
    width P; otherwise that one pass. A row's outputs do not depend on the padding
    columns or the other rows of its pass, up to float rounding.

    Args:
      mask: `[B, P]` bool, true on real prompt tokens (left-padded rows).
      shared: the batch's kinds (`shared_prompts`), or None: every row its own kind.

    Returns:
      `(passes, inverse)`: the passes, and `[B]` int32 where row b's outputs sit in
      the passes' outputs concatenated in order.
    """
    mask = np.asarray(mask, bool)
    batch, width = mask.shape
    shared = shared if shared is not None else every_row(batch)
    unique, inverse = np.asarray(shared.unique, np.int32), np.asarray(shared.inverse, np.int32)
    if batch == 0:
        return [PrefillPass(unique, width)], inverse
    kinds = int(inverse.max()) + 1
    lengths = mask[unique[:kinds]].sum(axis=1)
    split, split_cost = width, (1.0 - SPLIT_SAVING) * _prefill_cost(pass_rows(kinds, batch), width)
    for short in range(WIDTH_QUANTUM, width, WIDTH_QUANTUM):
        fit = int(np.count_nonzero(lengths <= short))
        if 0 < fit < kinds:
            cost = (_prefill_cost(pass_rows(fit, batch), short)
                    + _prefill_cost(pass_rows(kinds - fit, batch), width))
            if cost < split_cost:
                split, split_cost = short, cost
    fits = lengths <= split
    position = np.empty(kinds, np.int32)
    passes, offset = [], 0
    for members, pass_width in ((np.nonzero(fits)[0], split), (np.nonzero(~fits)[0], width)):
        if len(members) == 0:
            continue
        rows = np.full(pass_rows(len(members), batch), unique[members[0]], np.int32)
        rows[:len(members)] = unique[members]
        position[members] = offset + np.arange(len(members), dtype=np.int32)
        passes.append(PrefillPass(rows, pass_width))
        offset += len(rows)
    return passes, position[inverse]
