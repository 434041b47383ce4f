"""Behaviour policies of known skill, for grading credit against ground truth.

A policy gives, at each step, a distribution over the admissible actions (and
a baseline distribution, whose value the advantage subtracts); the
diagnosis samples from it, records its entropy (so entropy-based estimators
such as EMPG see real inputs) and replays it from snapshots for Monte Carlo
ground truth. All of them lean on the simulator's oracle
(`env.oracle_actions()[0]`: the next action of a shortest path to a success;
on ALFWorld it knows where unseen objects lie, unlike `expert_action`, which
searches, so that every step of the expert here makes progress).

  - `EpsilonExpert(eps)`: the expert with probability 1 - eps, else a uniform
    admissible action: pi(a) = (1 - eps) 1[a = a*] + eps / |A|.
  - `EpsilonExpert(1.0)`: the uniform policy.
  - `SingleDeviation(step)`: the expert, except at one step (given, or uniform
    over the first d(s_0) steps of the episode) where it takes a uniformly
    chosen wrong action: one that does not bring the goal closer. Its A^pi
    is measured against the expert's action (`SingleDeviation.baseline`).

A trained run is a fourth (`stepcredit.diagnose.checkpoint.CheckpointPolicy`).
`parse_policy("eps=0.3" | "uniform" | "deviation" | "deviation@2" |
"checkpoint=LOGDIR")` reads the command line's spelling.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Protocol, Sequence

import numpy as np

from stepcredit.envs.base import Observation

History = Sequence[tuple[str, str]]


class Policy(Protocol):
    """What a diagnosis needs of a behaviour policy.

    `label` names it in reports. `deviation(env, rng)` is called after each
    reset and returns the step at which this episode deviates (-1: none); it
    is passed back to every `distribution` call of the episode, so a policy's
    per-episode choice survives replays from snapshots.
    """

    label: str

    def deviation(self, env: Any, rng: np.random.Generator) -> int:
        ...

    def distribution(self, env: Any, observation: Observation, history: History, step: int,
                     deviation: int) -> tuple[tuple[str, ...], np.ndarray]:
        """The actions and their probabilities (float64, summing to 1) at `step`."""

    def baseline(self, env: Any, observation: Observation, history: History, step: int,
                 deviation: int) -> tuple[tuple[str, ...], np.ndarray]:
        """The distribution whose value V(s_t) A^pi subtracts: `distribution`,
        except where a policy's own choice would make the advantage meaningless."""


def entropy(probs: np.ndarray) -> float:
    """H(pi) = -sum_a pi(a) log pi(a), in nats (0 log 0 = 0)."""
    p = probs[probs > 0]
    return float(-(p * np.log(p)).sum())


def _choices(env: Any, observation: Observation) -> tuple[tuple[str, ...], str]:
    """The admissible actions (with the expert's, which a free-text search may
    add) and the expert's action: the oracle's next one."""
    expert = env.oracle_actions()[0]
    actions = tuple(observation.admissible_actions or ())
    if expert not in actions:
        actions += (expert,)
    return actions, expert


@dataclasses.dataclass(frozen=True)
class EpsilonExpert:
    """The expert with probability 1 - eps, else a uniform admissible action."""

    eps: float

    def __post_init__(self):
        if not 0.0 <= self.eps <= 1.0:
            raise ValueError(f"EpsilonExpert: eps must be in [0, 1], got {self.eps}")

    @property
    def label(self) -> str:
        return "uniform" if self.eps == 1.0 else f"eps={self.eps:g}"

    def deviation(self, env: Any, rng: np.random.Generator) -> int:
        return -1

    def distribution(self, env, observation, history, step, deviation):
        actions, expert = _choices(env, observation)
        probs = np.full(len(actions), self.eps / len(actions))
        probs[actions.index(expert)] += 1.0 - self.eps
        return actions, probs

    baseline = distribution


def wrong_actions(env: Any, actions: Sequence[str]) -> tuple[str, ...]:
    """The actions that do not bring the goal closer: those after which the
    oracle distance does not fall, or that end the episode without a win.
    Each is tried on a snapshot; the environment is left as it was."""
    before, snapshot = env.oracle_distance(), env.snapshot()
    wrong = []
    for action in actions:
        result = env.step(action)
        if result.done:
            progress = bool(result.info.get("won"))
        else:
            progress = env.oracle_distance() < before
        if not progress:
            wrong.append(action)
        env.restore(snapshot)
    return tuple(wrong)


@dataclasses.dataclass(frozen=True)
class SingleDeviation:
    """The expert except one wrong action, at `step` or (None) at a step drawn
    uniformly from the first d(s_0) steps of each episode."""

    step: int | None = None

    def __post_init__(self):
        if self.step is not None and self.step < 0:
            raise ValueError(f"SingleDeviation: step must be >= 0, got {self.step}")

    @property
    def label(self) -> str:
        return "deviation" if self.step is None else f"deviation@{self.step}"

    def deviation(self, env: Any, rng: np.random.Generator) -> int:
        if self.step is not None:
            return self.step
        return int(rng.integers(min(env.oracle_distance(), env.max_steps)))

    def distribution(self, env, observation, history, step, deviation):
        actions, expert = _choices(env, observation)
        if step == deviation:
            wrong = wrong_actions(env, actions)
            if wrong:
                return wrong, np.full(len(wrong), 1.0 / len(wrong))
        return (expert,), np.ones(1)

    def baseline(self, env, observation, history, step, deviation):
        """The expert's action everywhere: at the deviating step the policy takes
        only wrong actions, so against its own value a mistake would score 0 on
        average; against the expert's, A^pi is the mistake's cost."""
        return (_choices(env, observation)[1],), np.ones(1)


def parse_policy(text: str, *, load: bool = True) -> Policy | None:
    """A policy from its command-line spelling: "eps=0.3", "uniform",
    "deviation", "deviation@STEP" or "checkpoint=LOGDIR" (a trained run;
    with `load=False` only the spelling and the folder are checked, and None
    is returned).

    Raises:
      ValueError: an unknown spelling, naming the accepted ones.
    """
    spelled = text.strip()
    try:
        if spelled == "uniform":
            return EpsilonExpert(1.0)
        if spelled.startswith("eps="):
            return EpsilonExpert(float(spelled[4:]))
        if spelled == "deviation":
            return SingleDeviation()
        if spelled.startswith("deviation@"):
            return SingleDeviation(int(spelled[len("deviation@"):]))
        if spelled.startswith("checkpoint="):
            logdir = spelled[len("checkpoint="):]
            if not os.path.isdir(logdir):
                raise ValueError(f"{logdir} is not a run's folder")
            if not load:
                return None
            from stepcredit.diagnose.checkpoint import CheckpointPolicy  # loads a model

            return CheckpointPolicy.load(logdir)
    except ValueError as error:
        raise ValueError(f"--policy {text!r}: {error}") from None
    raise ValueError(f"--policy {text!r}: expected eps=EPS, uniform, deviation, deviation@STEP or "
                     "checkpoint=LOGDIR")
