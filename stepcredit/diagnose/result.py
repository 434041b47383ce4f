"""What a diagnosis returns: scores with confidence intervals, example trajectories."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import numpy as np

# The metrics of a diagnosis, in the order tables show them (see `metrics`).
METRICS = ("auc", "spearman", "sign_agreement", "blame_localisation", "collateral_blame")


@dataclasses.dataclass(frozen=True)
class Score:
    """One metric of one estimator on one simulator.

    Attributes:
      env: the simulator.
      estimator: the estimator's name (also the reference rows "mc_advantage"
        and "random").
      metric: one of `METRICS`.
      estimate: the metric on all seeds' trajectories pooled (NaN when no
        trajectory qualifies).
      low, high: its 95% confidence interval (bootstrap over (seed, task)
        groups; NaN when undefined).
      n: how many items the metric counted (steps, or trajectories for blame
        localisation).
      per_seed: the metric on each seed alone.
    """

    env: str
    estimator: str
    metric: str
    estimate: float
    low: float
    high: float
    n: int
    per_seed: tuple[float, ...]


@dataclasses.dataclass(frozen=True)
class Example:
    """One trajectory's step credit next to the truth, for plots.

    Attributes:
      env: the simulator.
      task: the task index.
      won: whether it was won.
      actions: `[T]` action texts.
      good: `[T]` bool oracle progress labels.
      advantage: `[T]` Monte Carlo A^pi.
      advantage_se: `[T]` its standard error.
      credit: estimator name -> `[T]` step credit.
    """

    env: str
    task: int
    won: bool
    actions: tuple[str, ...]
    good: np.ndarray
    advantage: np.ndarray
    advantage_se: np.ndarray
    credit: Mapping[str, np.ndarray]


@dataclasses.dataclass(frozen=True)
class Diagnosis:
    """The result of `stepcredit.diagnose.diagnose`.

    Attributes:
      settings: the settings it ran with (JSON-serialisable).
      scores: every (env, estimator, metric) score.
      examples: a few trajectories per simulator.
      seconds: wall-clock seconds by phase: "sample" (episodes, Monte Carlo
        A^pi and values), "prm" (the implicit PRM), "credit" and "score".
      notes: one line per caveat a reader of the table needs (value source,
        PRM training cost, estimators that could not run and why).
    """

    settings: Mapping[str, Any]
    scores: tuple[Score, ...]
    examples: tuple[Example, ...]
    seconds: Mapping[str, float]
    notes: tuple[str, ...] = ()

    @property
    def envs(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(s.env for s in self.scores))

    @property
    def estimators(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(s.estimator for s in self.scores))

    def score(self, env: str, estimator: str, metric: str) -> Score:
        """The score of `estimator` on `env` for `metric`.

        Raises:
          KeyError: no such score.
        """
        for s in self.scores:
            if (s.env, s.estimator, s.metric) == (env, estimator, metric):
                return s
        raise KeyError(f"no score for env {env!r}, estimator {estimator!r}, metric {metric!r}")
