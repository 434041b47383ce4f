"""Environment specs: the strings `stepcredit train --env` accepts.

- a registered name (`registry.names()`, the simulators): built with the run's
  split, difficulty, seed and step limit;
- `http://HOST:PORT[?schema=NAME&tasks=N]`: an environment served over HTTP
  (`HttpEnv`): a `stepcredit serve` server (schema "stepcredit", the default),
  which reports its task count, or an AgentGym server of a known schema
  ("alfworld", "webshop", ...), whose task count `tasks` must name;
- `textworld:PATTERN`: the TextWorld games matching the glob PATTERN (the
  `textworld` extra), task k the k-th file in sorted order.

A served or TextWorld environment has one split: its tasks are the training
tasks, and an evaluation plays the first of them (`splits == ("train",)`).
"""

from __future__ import annotations

import glob
import urllib.parse
from typing import Any, Sequence

from stepcredit.envs import registry
from stepcredit.envs.base import Env, Observation, StepResult

_TEXTWORLD = "textworld:"


class TaskSet:
    """An environment with a known number of tasks on one split (delegates the `Env` protocol).

    Attributes:
      env: the environment; num_tasks: its tasks are 0 .. num_tasks - 1.
    """

    splits = ("train",)

    def __init__(self, env: Env, num_tasks: int):
        self.env, self.num_tasks = env, num_tasks
        self.name, self.max_steps = env.name, env.max_steps

    def reset(self, task: Any) -> Observation:
        return self.env.reset(task)

    def step(self, action: str) -> StepResult:
        return self.env.step(action)

    def close(self) -> None:
        self.env.close()

    def __getattr__(self, name: str) -> Any:  # the rest (reference_answer, answer_action, ...)
        if name == "env":
            raise AttributeError(name)
        return getattr(self.env, name)


def kind(spec: str) -> str:
    """"registered", "served" or "textworld"; ValueError, naming the forms, for anything else."""
    if spec in registry.names():
        return "registered"
    if spec.startswith(("http://", "https://")):
        return "served"
    if spec.startswith(_TEXTWORLD):
        return "textworld"
    raise ValueError(f"unknown environment {spec!r}; registered: {', '.join(registry.names())}; or "
                     "http://HOST:PORT[?schema=NAME&tasks=N] or textworld:PATTERN")


def make(spec: str, *, split: str = "train", difficulty: int = 0, seed: int = 0,
         max_steps: int | None = None) -> Env:
    """A new environment of `spec` (see the module docstring).

    `difficulty` and `seed` reach the simulators only; `split` must be
    "train" for a served or TextWorld environment.

    Raises:
      ValueError: an unknown name, a malformed URL or query, an AgentGym
        server without `tasks`, a pattern matching no file, or a split other
        than "train" for an environment that has one split.
    """
    form = kind(spec)
    if form == "registered":
        kwargs: dict[str, Any] = {"split": split, "difficulty": difficulty, "seed": seed}
        if max_steps is not None:
            kwargs["max_steps"] = max_steps
        return registry.make(spec, **kwargs)
    if split != "train":
        raise ValueError(f"env {spec!r} has one split, 'train'; split={split!r}")
    if form == "served":
        return _served(spec, max_steps)
    return _textworld(spec[len(_TEXTWORLD):], max_steps)


def _served(spec: str, max_steps: int | None) -> Env:
    from stepcredit.envs.http_client import HttpEnv

    url = urllib.parse.urlsplit(spec)
    try:
        query = dict(urllib.parse.parse_qsl(url.query, strict_parsing=bool(url.query)))
    except ValueError as error:
        raise ValueError(f"env {spec!r}: malformed query ({error})") from None
    unknown = sorted(set(query) - {"schema", "tasks"})
    if unknown:
        raise ValueError(f"env {spec!r}: unknown query key(s) {unknown}; expected schema, tasks")
    tasks = query.get("tasks")
    if tasks is not None and not (tasks.isdigit() and int(tasks) > 0):
        raise ValueError(f"env {spec!r}: tasks={tasks!r}; it must be a positive integer")
    env = HttpEnv(urllib.parse.urlunsplit((url.scheme, url.netloc, url.path, "", "")),
                  query.get("schema", "stepcredit"), max_steps=max_steps)
    served, problem = env.num_tasks, None
    if tasks is None and served is None:
        problem = "the server does not report its task count; name it, e.g. ?tasks=100"
    elif served is not None and served < 1:
        problem = f"the server reports {served} tasks"
    elif served is not None and tasks is not None and int(tasks) > served:
        problem = f"tasks={tasks}, but the server has {served}"
    if problem:
        env.close()
        raise ValueError(f"env {spec!r}: {problem}")
    return TaskSet(env, int(tasks) if tasks is not None else int(served))


def _textworld(pattern: str, max_steps: int | None) -> Env:
    from stepcredit.envs.textworld_env import TextWorldConfig, TextWorldEnv

    files = sorted(glob.glob(pattern))
    if not files:
        raise ValueError(f"env 'textworld:{pattern}': the pattern matches no game file")
    config = TextWorldConfig() if max_steps is None else TextWorldConfig(max_steps=max_steps)
    return TaskSet(TextWorldEnv(files, config), len(files))


__all__: Sequence[str] = ("TaskSet", "kind", "make")
