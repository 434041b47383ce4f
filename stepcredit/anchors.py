"""Anchor states for GiGPO, built on the host from raw observations.

GiGPO groups the steps taken from the same environment state. The state is
the raw observation the environment returned (not the prompt with history).
This module turns observations into

  - stable 64-bit keys (`observation_keys`, by `stepcredit.keys.stable_key`):
    blake2b of a canonical byte encoding, equal across processes and runs
    (Python's `hash` is salted per process, so it is never used);
  - dense int32 ids per batch (`dense_anchor_ids`, `anchor_ids`), which is what
    `stepcredit.advantages.gigpo` takes (64-bit keys overflow JAX's default
    int32);
  - similarity-based ids for free-text states such as QA contexts
    (`similarity_anchor_ids`), where two observations count as the same state
    when difflib's ratio is at least a threshold.

Plain Python and NumPy; nothing here is traced.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from stepcredit.keys import dense_ids, stable_key


class AnchorIds(NamedTuple):
    """`ids`: `[B, T]` int32 anchor ids, -1 at padding; `mask`: `[B, T]` bool, True on real steps."""

    ids: np.ndarray
    mask: np.ndarray


def _padded_shape(fn: str, trajectories: Sequence[Sequence[Any]],
                  num_steps: int | None) -> tuple[int, int]:
    if isinstance(trajectories, (str, bytes)) or not isinstance(trajectories, Sequence):
        raise TypeError(f"{fn}: trajectories must be a sequence of B sequences of observations")
    longest = max((len(steps) for steps in trajectories), default=0)
    if num_steps is None:
        return len(trajectories), max(longest, 1)
    if longest > num_steps:
        raise ValueError(f"{fn}: a trajectory has {longest} steps but num_steps={num_steps}")
    return len(trajectories), num_steps


def observation_keys(trajectories: Sequence[Sequence[Any]], *,
                     num_steps: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Keys of ragged trajectories' observations (`stepcredit.keys.stable_key`), padded to `[B, T]`.

    Args:
      trajectories: B sequences, each the observations a trajectory acted from,
        one per step.
      num_steps: T; None means the longest trajectory.

    Returns:
      `(keys, mask)`: `[B, T]` uint64 keys (0 at padding) and `[B, T]` bool,
      True on real steps.

    Example: [["a", "b"], ["a"]] gives keys [[k_a, k_b], [k_a, 0]] and mask
    [[True, True], [True, False]].
    """
    batch, steps = _padded_shape("observation_keys", trajectories, num_steps)
    keys = np.zeros((batch, steps), np.uint64)
    mask = np.zeros((batch, steps), bool)
    for b, observations in enumerate(trajectories):
        for t, observation in enumerate(observations):
            keys[b, t] = stable_key(observation)
            mask[b, t] = True
    return keys, mask


def dense_anchor_ids(keys, mask) -> np.ndarray:
    """Dense int32 ids of the keys at valid positions, ranked by key value.

    Equal keys get equal ids in [0, number of distinct keys); the ids depend
    only on the set of keys, not on the order of the trajectories. Padding
    gets -1.

    Args:
      keys: `[B, T]` integer keys (e.g. uint64 from `observation_keys`).
      mask: `[B, T]` bool, True on real steps.

    Returns:
      `[B, T]` int32 ids, -1 where mask is False.

    Raises:
      ValueError: keys and mask of different shapes.

    Example: keys [[9, 2**63], [9, 5]] with mask all True give [[1, 2], [1, 0]].
    """
    keys, mask = np.asarray(keys), np.asarray(mask, bool)
    if keys.shape != mask.shape:
        raise ValueError(f"dense_anchor_ids: keys has shape {keys.shape} but mask has shape "
                         f"{mask.shape}; both must be [B, T]")
    ids = np.full(keys.shape, -1, np.int32)
    ids[mask] = dense_ids(keys[mask], order="sorted")[0]
    return ids


def anchor_ids(trajectories: Sequence[Sequence[Any]], *, num_steps: int | None = None) -> AnchorIds:
    """Exact-match anchors: dense int32 ids of hashed raw observations, per batch.

    Two steps share an id when their observations encode to the same bytes
    (see `stepcredit.keys.stable_key`). GiGPO compares steps only inside an episode group,
    so ids need not be distinct across groups; here they are batch-wide.

    Args:
      trajectories: B sequences of observations, one per step (ragged).
      num_steps: T; None means the longest trajectory.

    Returns:
      `AnchorIds(ids, mask)`, `[B, T]` each; ids are -1 at padding.

    References:
      Feng et al., "Group-in-Group Policy Optimization for LLM Agent Training",
      arXiv 2505.10978, Eq. 6 (anchor states by exact match of the raw
      environment observation).

    Example: [["kitchen", "hall"], ["kitchen"]] gives ids [[1, 0], [1, -1]]
    (the key of "hall" ranks below that of "kitchen"), mask [[T, T], [T, F]].
    """
    keys, mask = observation_keys(trajectories, num_steps=num_steps)
    return AnchorIds(dense_anchor_ids(keys, mask), mask)


def _similar(a: str, b: str, threshold: float) -> bool:
    if a == b:
        return True
    matcher = difflib.SequenceMatcher(None, a, b)
    return (matcher.real_quick_ratio() >= threshold and matcher.quick_ratio() >= threshold
            and matcher.ratio() >= threshold)


def similarity_anchor_ids(trajectories: Sequence[Sequence[str]], group_ids: Sequence[int], *,
                          threshold: float = 0.95, num_steps: int | None = None) -> AnchorIds:
    """Similarity anchors for text states: greedy clusters of similar observations per group.

    Inside each episode group, the steps are visited trajectory by trajectory,
    step by step; a step joins the first existing cluster whose first member
    (its representative) has `difflib.SequenceMatcher(None, obs, rep).ratio()
    >= threshold`, else it starts a new cluster. Each cluster gets its own
    id; clusters are numbered in order of the sorted group ids, then of
    creation.

    Args:
      trajectories: B sequences of observation strings, one per step.
      group_ids: B episode group ids (hashable, sortable, e.g. ints).
      threshold: similarity in (0, 1]; 0.95 is the authors' code default
        (the paper quotes 0.9 for its longest-matching-subsequence measure);
        1 means exact match.
      num_steps: T; None means the longest trajectory.

    Returns:
      `AnchorIds(ids, mask)`, `[B, T]` each; ids are -1 at padding.

    Raises:
      ValueError: threshold outside (0, 1], or group_ids not of length B.
      TypeError: a non-string observation.

    References:
      Feng et al., arXiv 2505.10978 (similarity-based grouping for search-QA);
      verl-agent `gigpo/core_gigpo.py::build_step_group` (`enable_similarity`,
      `similarity_thresh=0.95`), whose greedy rule this follows.

    Notes:
      Greedy clustering depends on the visiting order: permuting trajectories
      inside a group can change which steps share a cluster when similarity
      is not transitive (exact-match anchors have no such dependence).

    Example: observations [["the cat sat", "x"], ["the cat sat."]], group_ids
    [0, 0] and threshold 0.95 give ids [[0, 1], [0, -1]] (ratio 22/23 = 0.957).
    """
    fn = "similarity_anchor_ids"
    if not 0.0 < float(threshold) <= 1.0:
        raise ValueError(f"{fn}: threshold={threshold}; it must lie in (0, 1]")
    batch, steps = _padded_shape(fn, trajectories, num_steps)
    if len(group_ids) != batch:
        raise ValueError(f"{fn}: group_ids has length {len(group_ids)} but there are {batch} "
                         f"trajectories")
    ids = np.full((batch, steps), -1, np.int32)
    mask = np.zeros((batch, steps), bool)
    members: dict[Any, list[int]] = {}
    for b, group in enumerate(group_ids):
        members.setdefault(group, []).append(b)
    next_id = 0
    for group in sorted(members):
        representatives: list[tuple[str, int]] = []
        for b in members[group]:
            for t, observation in enumerate(trajectories[b]):
                if not isinstance(observation, str):
                    raise TypeError(f"{fn}: trajectory {b} step {t} has a "
                                    f"{type(observation).__name__}; similarity anchors need strings")
                mask[b, t] = True
                for representative, cluster in representatives:
                    if _similar(observation, representative, threshold):
                        ids[b, t] = cluster
                        break
                else:
                    representatives.append((observation, next_id))
                    ids[b, t] = next_id
                    next_id += 1
    return AnchorIds(ids, mask)
