"""Value sources for the critic-based estimators (step and token GAE).

  - "zero": V(s) = 0, GAE with lam = 1 reduces to the return-to-go.
  - "table": a per-anchor Monte Carlo table fitted on a separate batch of the
    same tasks played by the same policy: V(s) is the mean return-to-go
    observed from the states with s's anchor, the best critic the data allow
    without function approximation. An anchor the fitting batch never saw
    falls back to the mean return-to-go of its task's states, then of all.
  - "checkpoint": a trained run's value head at each step's prompt
    (`stepcredit.diagnose.checkpoint.checkpoint_values`).

Bootstrap values are 0: after a truncation no steps remain, so the true value
of the state after the last step is 0 under the episode's step limit.
"""

from __future__ import annotations

from typing import Any, Hashable, Mapping, Sequence

import numpy as np

from stepcredit.diagnose.episodes import Episode

VALUE_SOURCES = ("zero", "table", "checkpoint")


def returns_to_go(rewards: np.ndarray) -> np.ndarray:
    """G_t = sum_{u >= t} r_u (undiscounted), `[T]`."""
    return np.cumsum(np.asarray(rewards)[::-1])[::-1]


class ValueTable:
    """Mean return-to-go per (task, anchor), fitted on episodes."""

    def __init__(self, episodes: Sequence[Episode]):
        if not episodes:
            raise ValueError("ValueTable: episodes is empty")
        sums: dict[tuple[int, Hashable], list[float]] = {}
        by_task: dict[int, list[float]] = {}
        for episode in episodes:
            for anchor, g in zip(episode.anchors, returns_to_go(episode.rewards)):
                sums.setdefault((episode.task, anchor), []).append(float(g))
                by_task.setdefault(episode.task, []).append(float(g))
        self.values: Mapping[tuple[int, Hashable], float] = {
            k: float(np.mean(v)) for k, v in sums.items()}
        self.task_means = {k: float(np.mean(v)) for k, v in by_task.items()}
        self.mean = float(np.mean([g for v in by_task.values() for g in v]))

    def __call__(self, episode: Episode) -> np.ndarray:
        """`[T]` V(s_t) of each step of `episode`."""
        fallback = self.task_means.get(episode.task, self.mean)
        return np.array([self.values.get((episode.task, a), fallback) for a in episode.anchors])


def step_values(episodes: Sequence[Episode], source: str,
                fitting: Sequence[Episode] | None = None, *, checkpoint: str | None = None,
                env: Any = None) -> list[np.ndarray]:
    """`[T]` values of each episode's steps from `source` (module doc).

    Args:
      episodes: the episodes to value.
      source: "zero", "table" or "checkpoint".
      fitting: the separate batch the table is fitted on (source "table").
      checkpoint: the run's logdir (source "checkpoint").
      env: the simulator the episodes were played on (source "checkpoint":
        their prompts list its admissible actions).
    """
    if source == "zero":
        return [np.zeros(e.length) for e in episodes]
    if source == "table":
        if not fitting:
            raise ValueError("step_values: source 'table' needs a fitting batch")
        table = ValueTable(fitting)
        return [table(e) for e in episodes]
    if source == "checkpoint":
        if checkpoint is None:
            raise ValueError("step_values: source 'checkpoint' needs the run's logdir")
        from stepcredit.diagnose.checkpoint import checkpoint_values  # loads a model

        return checkpoint_values(checkpoint, episodes, env=env)
    raise ValueError(f"values: unknown source {source!r}; expected one of {', '.join(VALUE_SOURCES)}")
