"""Step rows for the model, and the bridge between rows and the token view.

A step row is one agent step as the model saw it: the step's prompt ids
followed by its sampled action ids; the environment side builds each step's
prompt (Agent-R1's step MDP), so rows are not one long concatenation. The
estimators run on
the trajectory views (`StepBatch` `[B, T]`, `TokenBatch` `[B, N]` of action
tokens); `RowIndex` remembers where each row's action tokens sit in the token
view, so per-token credit is gathered onto rows and per-row model outputs are
scattered back, both as plain indexing that `jit` and `grad` see through.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import jax.numpy as jnp
import numpy as np

from stepcredit.batch import Trajectory


class StepRowBatch(NamedTuple):
    """`[R, L]` step rows (R padded to a multiple of the minibatch size).

    Attributes:
      tokens: prompt ids then action ids, right-padded.
      mask: True on real tokens.
      action_mask: True on sampled action tokens.
      behav_logp: the sampling policy's log-prob of each action token.
      first_action: True on each row's first action token (where V(s_t) sits).
      valid: `[R]` True on real rows.
      trajectory, step: `[R]` the (b, t) each row belongs to (0 on padding rows).
    """

    tokens: np.ndarray
    mask: np.ndarray
    action_mask: np.ndarray
    behav_logp: np.ndarray
    first_action: np.ndarray
    valid: np.ndarray
    trajectory: np.ndarray
    step: np.ndarray


class RowIndex(NamedTuple):
    """For each row position, its place in the `[B, N]` token view (0 off actions)."""

    b: np.ndarray
    n: np.ndarray


ROW_WIDTH_QUANTUM = 64
"""Row widths are rounded up to a multiple of this, bounding the compiled shapes.

Every new (width, shared rows, label slots) shape compiles the update step anew,
about 6.5 s on a 2-core CPU at d_model 64, against about 0.05 s to run it. On 40
iterations of the README's HotpotQA command, 64 rather than 32 took 11 update
shapes instead of 16 for 7% more padded columns."""


def _row_width(longest: int, limit: int) -> int:
    """`longest` tokens rounded up to a multiple of `ROW_WIDTH_QUANTUM` (at least one of
    them), at most `limit`."""
    return min(limit, max(1, -(-longest // ROW_WIDTH_QUANTUM)) * ROW_WIDTH_QUANTUM)


def build_rows(trajectories: Sequence[Trajectory], *, num_steps: int, row_length: int,
               pad_id: int, multiple: int) -> tuple[StepRowBatch, RowIndex]:
    """Packs every step (up to `num_steps` per trajectory) into right-padded rows.

    The token view this indexes into is `collate(..., with_observations=False)`
    with T = `num_steps`: trajectory b's action tokens in step order. Rows are
    as wide as the longest step rounded up to `ROW_WIDTH_QUANTUM` (at most
    `row_length`), and their number is rounded up to a multiple of `multiple`,
    so a few compiled shapes serve every batch.
    """
    rows = [(b, t, step) for b, trajectory in enumerate(trajectories)
            for t, step in enumerate(list(trajectory.steps)[:num_steps])]
    count = -(-max(len(rows), 1) // multiple) * multiple
    longest = max((len(step.prompt_ids or ()) + len(step.action_ids) for _, _, step in rows),
                  default=1)
    if longest <= row_length:
        row_length = _row_width(longest, row_length)
    tokens = np.full((count, row_length), pad_id, np.int32)
    mask = np.zeros((count, row_length), bool)
    action_mask = np.zeros((count, row_length), bool)
    first_action = np.zeros((count, row_length), bool)
    behav_logp = np.zeros((count, row_length), np.float32)
    index_b = np.zeros((count, row_length), np.int32)
    index_n = np.zeros((count, row_length), np.int32)
    trajectory_of = np.zeros(count, np.int32)
    step_of = np.zeros(count, np.int32)
    offsets = [0] * len(trajectories)
    for r, (b, t, step) in enumerate(rows):
        if step.prompt_ids is None:
            raise ValueError(f"build_rows: trajectories[{b}].steps[{t}] has no prompt_ids; step "
                             f"rows need the exact prompt the policy saw")
        prompt, action = list(step.prompt_ids), list(step.action_ids)
        total = len(prompt) + len(action)
        if total > row_length:
            raise ValueError(f"build_rows: trajectories[{b}].steps[{t}] needs {total} tokens "
                             f"> row_length {row_length}")
        span = slice(len(prompt), total)
        tokens[r, :total] = prompt + action
        mask[r, :total] = True
        action_mask[r, span] = True
        first_action[r, len(prompt)] = True
        behav_logp[r, span] = step.action_logp
        index_b[r, span] = b
        index_n[r, span] = np.arange(offsets[b], offsets[b] + len(action))
        offsets[b] += len(action)
        trajectory_of[r], step_of[r] = b, t
    valid = np.arange(count) < len(rows)
    return (StepRowBatch(tokens, mask, action_mask, behav_logp, first_action, valid, trajectory_of,
                         step_of), RowIndex(index_b, index_n))


def length_groups(lengths: np.ndarray, size: int, *, limit: int,
                  rng: np.random.Generator | None = None) -> list[tuple[np.ndarray, int]]:
    """Splits rows into chunks of `size` rows of similar length, each with its own width.

    Rows are sorted by length (`[R]`, R a multiple of `size`) and cut into
    consecutive chunks; a chunk's width is its longest row rounded up to
    `ROW_WIDTH_QUANTUM` (at most `limit`, the rows' full width). Step prompts
    vary several-fold in length within a batch, so a chunk cut to its own width
    costs a fraction of one padded to the batch's longest row. With `rng`,
    rows of equal length are taken in random order and the chunks are returned
    shuffled (the minibatches of one epoch); without it the order is fixed.

    Returns:
      (row indices, width) per chunk; the indices of all chunks partition range(R).
    """
    count = len(lengths)
    if count % size:
        raise ValueError(f"length_groups: {count} rows is not a multiple of size {size}")
    order = np.arange(count) if rng is None else rng.permutation(count)
    order = order[np.argsort(lengths[order], kind="stable")]
    chunks = [order[start:start + size] for start in range(0, count, size)]
    if rng is not None:
        chunks = [chunks[i] for i in rng.permutation(len(chunks))]
    return [(chunk, _row_width(int(lengths[chunk].max()), limit)) for chunk in chunks]


def rows_from_tokens(view, index: RowIndex, action_mask) -> jnp.ndarray:
    """Gathers a `[B, N]` token-view array onto `[R, L]` rows (0 off action tokens)."""
    return jnp.where(action_mask, jnp.asarray(view)[index.b, index.n], 0.0)


def tokens_from_rows(rows, index: RowIndex, action_mask, shape: tuple[int, int]) -> jnp.ndarray:
    """Scatters `[R, L]` row values at action tokens into a `[B, N]` token view."""
    values = jnp.where(action_mask, rows, 0.0)
    # Off-action positions add 0 at (0, 0), leaving the view unchanged.
    return jnp.zeros(shape, values.dtype).at[index.b, index.n].add(values)
