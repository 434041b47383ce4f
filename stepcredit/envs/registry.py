"""Environments by name: `make("alfworld", split="unseen")`.

Built-in entries are import paths, resolved on first use, so that naming an
environment does not import the others.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable

from stepcredit.envs.base import Env

_ENTRIES: dict[str, str | Callable[..., Env]] = {
    "alfworld": "stepcredit.envs.alfworld:AlfWorldEnv",
    "hotpotqa": "stepcredit.envs.hotpotqa:HotpotQAEnv",
    "webshop": "stepcredit.envs.webshop:WebShopEnv",
}


def names() -> tuple[str, ...]:
    """The registered environment names, sorted."""
    return tuple(sorted(_ENTRIES))


def register(name: str, constructor: Callable[..., Env] | str) -> None:
    """Registers `constructor` (a callable, or "module:attribute") under `name`.

    Raises:
      ValueError: `name` is already registered.
    """
    if name in _ENTRIES:
        raise ValueError(f"register: environment name {name!r} is already registered")
    _ENTRIES[name] = constructor


def unregister(name: str) -> None:
    """Removes the environment registered as `name`.

    Raises:
      ValueError: `name` is not registered.
    """
    if name not in _ENTRIES:
        raise ValueError(f"unregister: unknown environment {name!r}; registered: "
                         f"{', '.join(names())}")
    del _ENTRIES[name]


def make(name: str, **kwargs: Any) -> Env:
    """A new environment.

    Args:
      name: a registered name (see `names()`).
      **kwargs: passed to the constructor (for the simulators: config fields
        such as `split`, `difficulty`, `seed`, `max_steps`).

    Returns:
      The environment.
    """
    entry = _ENTRIES.get(name)
    if entry is None:
        raise ValueError(f"make: unknown environment {name!r}; registered: {', '.join(names())}")
    if isinstance(entry, str):
        module, _, attribute = entry.partition(":")
        entry = getattr(importlib.import_module(module), attribute)
    return entry(**kwargs)
