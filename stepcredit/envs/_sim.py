"""Episode bookkeeping shared by the embedded simulators.

`SimulatorEnv` owns what the three simulators have in common: config checks,
task-index checks, the step counter and step limit, the answer to an invalid
action (its error text verbatim as the observation, the state unchanged),
the closed state, and snapshots (`snapshot`, `restore`, `clone`: the optional
`SnapshotEnv` part of the protocol). A subclass implements `_start(index)` and
`_act(action)` and names its episode-state attributes in `_episode_state`.
"""

from __future__ import annotations

import abc
import copy
import dataclasses
import operator
import random
from typing import Any, ClassVar

from stepcredit.envs.base import Observation, StepResult, step_info

Outcome = tuple[Observation, float, bool, dict[str, Any]]

# The episode state every simulator has; a subclass's `_episode_state` adds its own.
_BASE_STATE = ("_steps", "_running", "_terminated", "_obs")
_CONTAINERS = (list, dict, set)


def _copied(value: Any) -> Any:
    """`value` copied through nested lists, dicts and sets (set members are
    hashable, so immutable here); anything else is immutable and shared."""
    kind = type(value)
    if kind is list:
        return [_copied(x) if type(x) in _CONTAINERS else x for x in value]
    if kind is dict:
        return {k: _copied(v) if type(v) in _CONTAINERS else v for k, v in value.items()}
    if kind is set:
        return set(value)
    return value


@dataclasses.dataclass(frozen=True, eq=False)
class SimulatorSnapshot:
    """The episode state of an embedded simulator at one moment (opaque).

    Attributes:
      env_class: the simulator class it was taken from.
      config: that simulator's config; `restore` accepts only an equal one.
      state: the episode-state values, in the order of `_BASE_STATE` then the
        class's `_episode_state`. Nothing else holds them and `restore` copies
        them again, so the snapshot never changes.
    """

    env_class: type
    config: Any
    state: tuple[Any, ...] = dataclasses.field(repr=False)


def task_rng(env_name: str, seed: int, split: str, difficulty: int, index: int,
             attempt: int = 0) -> random.Random:
    """A random generator for one task, the same on every run and machine
    (seeding with a string hashes it with SHA-512, not Python's salted hash)."""
    return random.Random(f"{env_name}/{seed}/{split}/{difficulty}/{index}/{attempt}")


class SimulatorEnv(abc.ABC):
    """Base of the embedded simulators: one episode at a time on a task index.

    Subclasses set `name`, `splits` and `num_difficulties`, keep their config in
    `self.config` (a frozen dataclass with `seed`, `split`, `difficulty`,
    `max_steps`, `num_train_tasks` and `num_test_tasks`) and implement `_start`
    and `_act`. `_episode_state` names every attribute that `_start`, `_act` or the
    oracle set or mutate; snapshots and clones share the rest of the instance
    (config, catalogue, knowledge base), so episodes must not change it (beyond the
    catalogue's caches of searches and pages, which depend only on their keys).
    """

    name: ClassVar[str] = ""
    splits: ClassVar[tuple[str, ...]] = ()
    num_difficulties: ClassVar[int] = 3
    _episode_state: ClassVar[tuple[str, ...]] = ()

    def __init__(self, config: Any):
        cls = type(self).__name__
        if config.split not in self.splits:
            raise ValueError(f"{cls}: split {config.split!r} is not one of {self.splits}")
        if not 0 <= config.difficulty < self.num_difficulties:
            raise ValueError(f"{cls}: difficulty {config.difficulty} out of range "
                             f"[0, {self.num_difficulties})")
        if config.max_steps < 1:
            raise ValueError(f"{cls}: max_steps must be >= 1, got {config.max_steps}")
        if config.num_train_tasks < 1 or config.num_test_tasks < 1:
            raise ValueError(f"{cls}: num_train_tasks ({config.num_train_tasks}) and "
                             f"num_test_tasks ({config.num_test_tasks}) must be >= 1")
        self.config = config
        self.max_steps = config.max_steps
        self._closed = False
        self._running = False
        self._terminated = False
        self._steps = 0
        self._obs: Observation | None = None

    @property
    def num_tasks(self) -> int:
        """The number of tasks in this environment's split."""
        c = self.config
        return c.num_train_tasks if c.split == "train" else c.num_test_tasks

    @property
    def steps_taken(self) -> int:
        """Steps taken in the current (or last) episode."""
        return self._steps

    @property
    def running(self) -> bool:
        """Whether an episode is in progress (reset and not yet ended)."""
        return self._running

    def reset(self, task: Any) -> Observation:
        """Starts an episode.

        Args:
          task: the task index in `[0, num_tasks)` of this environment's split.

        Returns:
          The first observation.
        """
        cls = type(self).__name__
        if self._closed:
            raise RuntimeError(f"{cls}.reset: the environment is closed")
        try:
            index = operator.index(task)
        except TypeError:
            raise TypeError(f"{cls}.reset: task must be an integer index, got "
                            f"{type(task).__name__}") from None
        if not 0 <= index < self.num_tasks:
            raise ValueError(f"{cls}.reset: task index {index} out of range [0, {self.num_tasks}) "
                             f"for split {self.config.split!r}")
        self._steps = 0
        self._running = True
        self._terminated = False
        self._obs = self._start(index)
        return self._obs

    def step(self, action: str) -> StepResult:
        """Applies one action; an invalid one leaves the state as it was.

        Args:
          action: the action text (case and spacing around brackets are forgiven).

        Returns:
          The answer. An invalid or unparseable action gets its error text as the
          observation text and `info["valid"] = False`. Reaching `max_steps`
          without finishing sets `truncated`.
        """
        if not self._running:
            state = "closed" if self._closed else "not running (call reset)"
            raise RuntimeError(f"{type(self).__name__}.step: the episode is {state}")
        if not isinstance(action, str):
            raise TypeError(f"{type(self).__name__}.step: action must be a str, got "
                            f"{type(action).__name__}")
        self._steps += 1
        obs, reward, done, info = self._act(action)
        truncated = not done and self._steps >= self.max_steps
        if done or truncated:
            self._running = False
        self._terminated = done
        self._obs = obs
        return StepResult(obs, reward, done, truncated, info)

    def close(self) -> None:
        """Ends any episode; the environment accepts no further calls."""
        self._closed = True
        self._running = False

    def snapshot(self) -> SimulatorSnapshot:
        """The episode state now, for `restore` (a finished episode included).

        Copies only the episode state (positions, pages, what was read), never
        the shared catalogue, knowledge base or layouts: tens of microseconds.

        Returns:
          An opaque, immutable snapshot; later steps do not change it.

        Raises:
          RuntimeError: the environment is closed, or was never reset.
        """
        cls = type(self).__name__
        if self._closed:
            raise RuntimeError(f"{cls}.snapshot: the environment is closed")
        if self._obs is None:
            raise RuntimeError(f"{cls}.snapshot: no episode was started (call reset)")
        state = tuple(_copied(getattr(self, n)) for n in _BASE_STATE + self._episode_state)
        return SimulatorSnapshot(type(self), self.config, state)

    def restore(self, snapshot: SimulatorSnapshot) -> None:
        """Puts the environment back in the state `snapshot` was taken in.

        From then on every call (`step`, `oracle_actions`, `oracle_distance`,
        `expert_action`, `steps_taken`, `running`) answers as the snapshotted
        environment did. A snapshot can be restored any number of times, into
        the environment it came from or any other of the same class and config.

        Args:
          snapshot: a snapshot from `snapshot()` of this class and config.

        Raises:
          TypeError: `snapshot` is not a `SimulatorSnapshot`.
          ValueError: it was taken from another simulator class or config.
          RuntimeError: the environment is closed.
        """
        cls = type(self).__name__
        if not isinstance(snapshot, SimulatorSnapshot):
            raise TypeError(f"{cls}.restore: snapshot must be a SimulatorSnapshot, got "
                            f"{type(snapshot).__name__}")
        if snapshot.env_class is not type(self):
            raise ValueError(f"{cls}.restore: the snapshot was taken from "
                             f"{snapshot.env_class.__name__}, not {cls}")
        if snapshot.config is not self.config and snapshot.config != self.config:
            raise ValueError(f"{cls}.restore: the snapshot was taken with {snapshot.config}, "
                             f"but this environment has {self.config}")
        if self._closed:
            raise RuntimeError(f"{cls}.restore: the environment is closed")
        for n, value in zip(_BASE_STATE + self._episode_state, snapshot.state):
            setattr(self, n, _copied(value))

    def clone(self) -> SimulatorEnv:
        """A new environment in the same state, independent of this one.

        It shares the immutable data (config, catalogue, knowledge base,
        layouts) and copies the episode state, so stepping, resetting or
        closing one leaves the other as it was. A never-reset environment
        clones to a never-reset one.

        Raises:
          RuntimeError: the environment is closed.
        """
        if self._closed:
            raise RuntimeError(f"{type(self).__name__}.clone: the environment is closed")
        twin = copy.copy(self)
        if self._obs is not None:
            for n in _BASE_STATE + self._episode_state:
                setattr(twin, n, _copied(getattr(self, n)))
        return twin

    def expert_action(self) -> str:
        """The action a demonstrating expert takes now: the oracle's next action.

        A simulator whose oracle uses what the agent cannot observe (ALFWorld's
        knows where unseen objects lie) overrides this with an expert that
        searches, so that its demonstrations can be imitated.
        """
        return self.oracle_actions()[0]

    def _invalid(self, message: str, **extra: Any) -> Outcome:
        """The answer to an invalid action: the message as the observation text,
        with the admissible actions and anchor of the unchanged state."""
        obs = self._obs
        return (Observation(message, obs.admissible_actions, obs.anchor, obs.task), 0.0, False,
                step_info(valid=False, error=message, **extra))

    def _require_state(self, method: str) -> None:
        """The oracle answers from any state an episode can continue from, including the
        last state of a truncated episode (whose distance grades the last step)."""
        if self._obs is None or self._closed:
            raise RuntimeError(f"{type(self).__name__}.{method}: no episode is running")
        if self._terminated:
            raise RuntimeError(f"{type(self).__name__}.{method}: the episode terminated")

    @abc.abstractmethod
    def _start(self, index: int) -> Observation:
        """Sets up task `index` and returns its first observation."""

    @abc.abstractmethod
    def _act(self, action: str) -> Outcome:
        """Applies one action: (observation, reward, done, info)."""
