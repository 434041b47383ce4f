"""Sampled trajectories with their ground truth, the input of every diagnosis.

An `Episode` is one trajectory played by a behaviour policy on an embedded
simulator, with, at every step, what the simulator knows and the estimators do
not: the oracle distance to the goal before and after the step, whether the
step moved along a shortest path, and a Monte Carlo estimate of the behaviour
policy's advantage A^pi(s_t, a_t) with its standard error.

`stack` turns a list of episodes into padded `[B, T]` arrays (`Stacked`).
"""

from __future__ import annotations

import dataclasses
from typing import Hashable, NamedTuple, Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class Episode:
    """One trajectory and its ground truth; every per-step field has length T.

    Attributes:
      env: the simulator's registry name.
      seed: the diagnosis seed that sampled it.
      task: the task index.
      group: the trajectory's group (one task's G trajectories) within its seed.
      task_text: the task instruction.
      observations: `[T]` observation text at the start of each step.
      actions: `[T]` action text of each step.
      anchors: `[T]` the simulator's anchor (state) at the start of each step.
      rewards: `[T]` float, the reward of each step.
      entropy: `[T]` float, entropy (nats) of the behaviour policy's action
        distribution at each step.
      distance_before: `[T]` int, oracle distance d(s_t) to a success.
      distance_after: `[T]` int, d(s_{t+1}); 0 after a win, and after a
        failed ending the distance the step found (unchanged from before).
      good: `[T]` bool, the step made progress: d(s_{t+1}) < d(s_t) and, on
        the last step of a terminated episode, the episode was won.
      deviation: the step the policy was told to deviate at, or -1.
      advantage: `[T]` float, Monte Carlo A^pi(s_t, a_t) (NaN where not estimated).
      advantage_se: `[T]` float, its standard error.
      score: the episode score (the simulator's `info["score"]` at the end).
      won: whether the episode was won.
      truncated: whether the step limit ended it.
      mc_value: `[T]` float, V_MC(s_t) of VinePPO from rollouts of the
        behaviour policy on their own random stream (None where not estimated).
      answer_prob: `[T]` float, the behaviour policy's probability of taking
        the ground-truth answer action (HotpotQA's `finish[answer]`) at the
        start of each step, IGPO's belief; None where the simulator has no
        reference answer.
      tree: the rollout tree it is a leaf of within its seed (Tree-GRPO's
        branching episodes, `stepcredit.diagnose.sample.sample_trees`), or None.
    """

    env: str
    seed: int
    task: int
    group: int
    task_text: str
    observations: tuple[str, ...]
    actions: tuple[str, ...]
    anchors: tuple[Hashable, ...]
    rewards: np.ndarray
    entropy: np.ndarray
    distance_before: np.ndarray
    distance_after: np.ndarray
    good: np.ndarray
    deviation: int
    advantage: np.ndarray
    advantage_se: np.ndarray
    score: float
    won: bool
    truncated: bool
    mc_value: np.ndarray | None = None
    answer_prob: np.ndarray | None = None
    tree: int | None = None

    @property
    def length(self) -> int:
        return len(self.actions)


class Stacked(NamedTuple):
    """The ground truth of episodes as padded arrays: B episodes, T the longest length.

    Attributes:
      mask: `[B, T]` bool, True on real steps.
      group_ids: `[B]` int32 dense group ids (one per (seed, group)).
      scores: `[B]` float32 episode scores.
      won: `[B]` bool.
      good: `[B, T]` bool oracle progress labels (False on padding).
      advantage: `[B, T]` float Monte Carlo A^pi (NaN on padding and where not estimated).
      advantage_se: `[B, T]` its standard error (NaN on padding).
      seeds: `[B]` int diagnosis seed.
    """

    mask: np.ndarray
    group_ids: np.ndarray
    scores: np.ndarray
    won: np.ndarray
    good: np.ndarray
    advantage: np.ndarray
    advantage_se: np.ndarray
    seeds: np.ndarray


def stack(episodes: Sequence[Episode]) -> Stacked:
    """Pads the ground truth of `episodes` into `[B, T]` arrays; see `Stacked`.

    Raises:
      ValueError: `episodes` is empty, or an episode has no steps.
    """
    if not episodes:
        raise ValueError("stack: episodes is empty")
    for i, e in enumerate(episodes):
        if e.length == 0:
            raise ValueError(f"stack: episode {i} (task {e.task}) has no steps")
    b, t = len(episodes), max(e.length for e in episodes)

    def padded(field: str, dtype, fill) -> np.ndarray:
        out = np.full((b, t), fill, dtype=dtype)
        for i, e in enumerate(episodes):
            out[i, :e.length] = getattr(e, field)
        return out

    group_keys: dict[tuple[int, int], int] = {}
    group_ids = np.array([group_keys.setdefault((e.seed, e.group), len(group_keys))
                          for e in episodes], dtype=np.int32)
    lengths = np.array([e.length for e in episodes])
    return Stacked(
        mask=np.arange(t)[None, :] < lengths[:, None],
        group_ids=group_ids,
        scores=np.array([e.score for e in episodes], dtype=np.float32),
        won=np.array([e.won for e in episodes], dtype=bool),
        good=padded("good", bool, False),
        advantage=padded("advantage", np.float64, np.nan),
        advantage_se=padded("advantage_se", np.float64, np.nan),
        seeds=np.array([e.seed for e in episodes], dtype=np.int64),
    )
