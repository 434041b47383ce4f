"""The environment protocol: text in, text out.

Environments know nothing of tokens, models or JAX. An agent resets an
environment on a task and then sends it one action string per step; the
environment answers with an observation string, the admissible actions (when it
knows them), the raw state used as a GiGPO anchor, the reward and the episode
flags. See the Agent-R1 step-level MDP (arXiv 2511.14460).

Snapshots are an optional part of the protocol (`SnapshotEnv`): the embedded
simulators support them; TextWorld and the HTTP client env do not.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Hashable, Protocol, Sequence, runtime_checkable


@dataclasses.dataclass(frozen=True)
class Observation:
    """What the agent sees at the start of a step.

    Attributes:
      text: the observation shown to the agent (no history; the prompt builder
        adds history).
      admissible_actions: the actions the environment accepts now, or None when
        it does not enumerate them.
      anchor: the raw environment state, hashable, without history: two steps
        with equal anchors are in the same GiGPO step group (arXiv 2505.10978).
      task: the task instruction text shown at every step.
    """

    text: str
    admissible_actions: tuple[str, ...] | None
    anchor: Hashable
    task: str = ""


@dataclasses.dataclass(frozen=True)
class StepResult:
    """The environment's answer to one action.

    Attributes:
      observation: the next observation.
      reward: the scalar reward of this step.
      done: true termination (no bootstrap).
      truncated: the step limit ended the episode (bootstrap from the value of
        `observation`).
      info: at least `valid` (bool: the action was understood and allowed),
        `won` (bool), `score` (float) and `error` (str, empty when none).
    """

    observation: Observation
    reward: float
    done: bool
    truncated: bool
    info: dict[str, Any]


@runtime_checkable
class Env(Protocol):
    """An environment that plays one episode at a time."""

    name: str
    max_steps: int

    def reset(self, task: Any) -> Observation:
        """Starts an episode on `task` (a task id or spec) and returns the first observation."""

    def step(self, action: str) -> StepResult:
        """Applies one action string and returns the environment's answer."""

    def close(self) -> None:
        """Releases resources; a closed environment accepts no further calls."""


@runtime_checkable
class SnapshotEnv(Env, Protocol):
    """An `Env` whose episode state can be saved and put back (optional).

    Check for it with `isinstance(env, SnapshotEnv)`. The embedded simulators
    (`WebShopEnv`, `AlfWorldEnv`, `HotpotQAEnv`) implement it; `TextWorldEnv`
    and `HttpEnv` do not (their state lives in a game interpreter or on a
    server). What a caller can rely on:

    - After `restore(s)`, the environment answers every later call (`step`,
      with the same observation, admissible actions, anchor, reward, flags and
      info; `oracle_actions`, `oracle_distance`, `expert_action`,
      `steps_taken`, `running`) exactly as it did when `s` was taken, a
      finished episode staying finished.
    - A snapshot is opaque and immutable: later steps, resets and restores do
      not change it, and it can be restored any number of times, into the
      environment it came from or into any other of the same class and config.
    - `restore` raises ValueError for a snapshot of another environment class
      or config, and RuntimeError on a closed environment; `snapshot` raises
      RuntimeError before the first reset or once closed.
    - `clone()` is a new environment in the same state, independent of this
      one (stepping, resetting or closing one leaves the other as it was).
    - All three copy only the episode state, never the data an environment
      shares (catalogue, knowledge base, layouts): microseconds, not the
      tens of milliseconds of `copy.deepcopy`.
    - Snapshots are in-process objects, not a serialisation format.
    """

    def snapshot(self) -> Any:
        """The episode state now, as an opaque immutable object for `restore`."""

    def restore(self, snapshot: Any) -> None:
        """Puts the environment back in the state `snapshot` was taken in."""

    def clone(self) -> SnapshotEnv:
        """A new, independent environment in the same state as this one."""


def require_snapshots(env: Env, purpose: str) -> None:
    """Raises ValueError, in one line naming the environment and `purpose`, unless `env`
    is a `SnapshotEnv` (the embedded simulators; not TextWorld or an HTTP server)."""
    if not isinstance(env, SnapshotEnv):
        name = getattr(env, "name", type(env).__name__)
        raise ValueError(f"{purpose} from snapshots of visited states, but environment "
                         f"{name!r} has no snapshots (snapshot()/restore()/clone())")


def step_info(*, valid: bool, won: bool = False, score: float = 0.0, error: str = "",
              **extra: Any) -> dict[str, Any]:
    """Builds the `info` dict every environment returns, with its required keys."""
    return {"valid": valid, "won": won, "score": float(score), "error": error, **extra}


def as_actions(actions: Sequence[str] | None) -> tuple[str, ...] | None:
    """Freezes a list of admissible actions (or None) into a tuple."""
    return None if actions is None else tuple(actions)
