"""A batch of environments stepped together.

`EnvPool` holds B environments. `reset_groups` starts G members of each group on
the same task (GRPO/GiGPO groups); `step` sends one action per running
environment and skips finished ones. Adapters that wait on I/O (HTTP) run in a
thread pool; the in-process simulators are called directly, since threads would
only add overhead under the GIL.

An exception raised by one environment's `step` ends only that episode: its
result is `truncated` (nothing says the state was terminal) with
`info["error"]` holding the exception and `info["aborted"] = True`; the other
episodes go on. The pool always closes its environments (`close`, or leaving a
`with` block).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
from typing import Any, Callable, Sequence

from stepcredit.envs.base import Env, Observation, StepResult, step_info


class EnvPool:
    """Runs B environments side by side.

    Args:
      envs: the environments (the pool owns them and closes them).
      num_threads: 0 calls the environments one after another in the caller's
        thread (right for in-process simulators); N > 0 runs up to N calls at
        once in a thread pool (right for adapters that wait on the network).
      max_steps: an optional step limit applied on top of each environment's
        own `max_steps` (for adapters whose server does not enforce one).
    """

    def __init__(self, envs: Sequence[Env], *, num_threads: int = 0,
                 max_steps: int | None = None):
        if not envs:
            raise ValueError("EnvPool: envs is empty; give at least one environment")
        if num_threads < 0:
            raise ValueError(f"EnvPool: num_threads must be >= 0, got {num_threads}")
        if max_steps is not None and max_steps < 1:
            raise ValueError(f"EnvPool: max_steps must be >= 1 or None, got {max_steps}")
        self._envs = list(envs)
        self._limits = [min(env.max_steps, max_steps or env.max_steps) for env in self._envs]
        self._executor = (concurrent.futures.ThreadPoolExecutor(
            max_workers=num_threads, thread_name_prefix="envpool") if num_threads else None)
        n = len(self._envs)
        self._running = [False] * n
        self._steps = [0] * n
        self._observations: list[Observation | None] = [None] * n
        self._group_ids = list(range(n))
        self._closed = False

    @classmethod
    def from_factory(cls, factory: Callable[[], Env], num_envs: int, **kwargs: Any) -> EnvPool:
        """A pool of `num_envs` environments made by `factory()`; `kwargs` go to
        the constructor. Environments already made are closed if one fails."""
        if num_envs < 1:
            raise ValueError(f"EnvPool.from_factory: num_envs must be >= 1, got {num_envs}")
        envs: list[Env] = []
        try:
            for _ in range(num_envs):
                envs.append(factory())
        except BaseException:
            for env in envs:
                env.close()
            raise
        return cls(envs, **kwargs)

    def __len__(self) -> int:
        return len(self._envs)

    def __enter__(self) -> EnvPool:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def envs(self) -> tuple[Env, ...]:
        """The environments, in batch order."""
        return tuple(self._envs)

    @property
    def running(self) -> tuple[bool, ...]:
        """Which environments are in an episode (reset and not yet ended)."""
        return tuple(self._running)

    @property
    def group_ids(self) -> tuple[int, ...]:
        """The group of each environment, as set by the last reset."""
        return tuple(self._group_ids)

    @property
    def observations(self) -> tuple[Observation | None, ...]:
        """Each environment's latest observation (None before its first reset)."""
        return tuple(self._observations)

    def reset(self, tasks: Sequence[Any]) -> list[Observation]:
        """Starts environment i on `tasks[i]`; each environment is its own group.

        Args:
          tasks: one task per environment.

        Returns:
          The first observations, in batch order.
        """
        self._check_open("reset")
        if len(tasks) != len(self._envs):
            raise ValueError(f"EnvPool.reset: got {len(tasks)} tasks for {len(self._envs)} "
                             "environments; give one task per environment")
        observations = self._map(lambda i: self._envs[i].reset(tasks[i]), range(len(tasks)))
        self._observations = list(observations)
        self._running = [True] * len(self._envs)
        self._steps = [0] * len(self._envs)
        self._group_ids = list(range(len(self._envs)))
        return observations

    def reset_groups(self, tasks: Sequence[Any], group_size: int) -> list[Observation]:
        """Starts groups of `group_size` environments on the same task.

        Args:
          tasks: one task per group; the pool must hold
            `len(tasks) * group_size` environments.
          group_size: G, the members per group.

        Returns:
          The first observations; environment `g * G + k` is member k of group g
          (see `group_ids`).
        """
        if group_size < 1 or len(tasks) * group_size != len(self._envs):
            raise ValueError(f"EnvPool.reset_groups: {len(tasks)} tasks x group_size "
                             f"{group_size} must equal the {len(self._envs)} environments")
        observations = self.reset([task for task in tasks for _ in range(group_size)])
        self._group_ids = [i // group_size for i in range(len(self._envs))]
        return observations

    def step(self, actions: Sequence[str | None]) -> list[StepResult | None]:
        """Sends `actions[i]` to every running environment i.

        Args:
          actions: one entry per environment; entries of finished environments
            are ignored (None is fine there).

        Returns:
          One result per environment, None for those that were not running.
          `max_steps` (the pool's or the environment's) marks the result
          `truncated`; an exception in an environment ends its episode as
          described in the module docstring.
        """
        self._check_open("step")
        if len(actions) != len(self._envs):
            raise ValueError(f"EnvPool.step: got {len(actions)} actions for {len(self._envs)} "
                             "environments; give one per environment (None for finished ones)")
        indices = [i for i, running in enumerate(self._running) if running]
        for i in indices:
            if not isinstance(actions[i], str):
                raise TypeError(f"EnvPool.step: actions[{i}] is {type(actions[i]).__name__}, but "
                                f"environment {i} is running and needs a str")
        results: list[StepResult | None] = [None] * len(self._envs)
        for i, result in zip(indices, self._map(lambda i: self._step_one(i, actions[i]), indices)):
            results[i] = result
            self._steps[i] += 1
            self._observations[i] = result.observation
            self._running[i] = not (result.done or result.truncated)
        return results

    def close(self) -> None:
        """Closes every environment (each one even if another fails to close),
        then raises the first failure, if any. Calling it again does nothing."""
        if self._closed:
            return
        self._closed = True
        self._running = [False] * len(self._envs)
        if self._executor is not None:
            self._executor.shutdown(wait=True)
        # In parallel: closing N instances of an HTTP server that stopped answering
        # then costs one close timeout, not N of them.
        with concurrent.futures.ThreadPoolExecutor(max(1, min(len(self._envs), 16))) as closer:
            errors = list(closer.map(_close_quietly, self._envs))
        first_error = next((e for e in errors if e is not None), None)
        if first_error is not None:
            raise first_error

    def _step_one(self, i: int, action: str) -> StepResult:
        try:
            result = self._envs[i].step(action)
        except Exception as e:  # noqa: BLE001 - one broken environment must not end the batch
            return StepResult(self._observations[i], 0.0, False, True,
                              step_info(valid=False, error=f"{type(e).__name__}: {e}",
                                        aborted=True))
        if not (result.done or result.truncated) and self._steps[i] + 1 >= self._limits[i]:
            result = dataclasses.replace(result, truncated=True)
        return result

    def _map(self, fn: Callable[[int], Any], indices: Sequence[int]) -> list[Any]:
        if self._executor is None or len(indices) < 2:
            return [fn(i) for i in indices]
        return list(self._executor.map(fn, indices))

    def _check_open(self, method: str) -> None:
        if self._closed:
            raise RuntimeError(f"EnvPool.{method}: the pool is closed")


def _close_quietly(env) -> BaseException | None:
    """Closes `env`; returns its failure instead of raising it (re-raised by the caller)."""
    try:
        env.close()
    except Exception as error:  # noqa: BLE001
        return error
    return None
