"""Orbax checkpoints of the whole training state, safe against dying mid-write.

Orbax writes each checkpoint into a temporary directory and renames it only
when complete, so a process killed while saving leaves the previous step as the
latest good checkpoint. A complete checkpoint damaged later (a truncated or
missing file) is found when it fails to read back: `restore_intact` moves it
aside (kept, renamed `<step>.damaged`) and falls back to the one before.
"""

from __future__ import annotations

import os
import shutil
from typing import Any, Callable

import jax

from stepcredit.train.devices import keys_as_data, keys_like


class Checkpointer:
    """Saves and restores a pytree of training state every `every` iterations.

    Args:
      directory: where checkpoints live (one subdirectory per iteration).
      max_to_keep: how many recent checkpoints to keep.
      primary_only: in a multi-process run, only process 0 saves (its state is every
        process's), without waiting for the others.
    """

    def __init__(self, directory: str, *, max_to_keep: int = 2, primary_only: bool = False):
        import orbax.checkpoint as ocp

        self._ocp = ocp
        self._primary_only = primary_only
        self.directory = os.path.abspath(directory)
        primary = {}
        if primary_only:  # orbax leaves the directory to us when some processes stay out
            os.makedirs(self.directory, exist_ok=True)
            primary = {"create": False,
                       "multiprocessing_options": ocp.options.MultiprocessingOptions(
                           primary_host=0, active_processes={0})}
        self._manager = ocp.CheckpointManager(
            self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep,
                                                                 **primary))

    def latest_step(self) -> int | None:
        """The iteration of the newest complete checkpoint, or None."""
        return self._manager.latest_step()

    def save(self, step: int, state: Any) -> None:
        """Writes `state` as checkpoint `step` and waits until it is complete on disk."""
        if self._primary_only:
            # Orbax will not write process-local device arrays in a multi-process run;
            # host copies of them (PRNG keys as their raw data) are the same state.
            state = keys_as_data(state)
        self._manager.save(step, args=self._ocp.args.StandardSave(state))
        self._manager.wait_until_finished()

    def restore(self, template: Any, step: int | None = None) -> Any:
        """Restores checkpoint `step` (default: the latest) into the structure of `template`."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"Checkpointer.restore: no checkpoint in {self.directory}")
        abstract = jax.tree.map(self._ocp.utils.to_shape_dtype_struct, template)
        restored = self._manager.restore(step, args=self._ocp.args.StandardRestore(abstract))
        return keys_like(template, restored)

    def restore_intact(self, template: Any, *,
                       note: Callable[[str], None] = print) -> tuple[int, Any]:
        """Restores the newest checkpoint that reads back whole: `(step, state)`.

        Each damaged one (any failure to read it back into `template`'s
        structure) is reported in one line through `note` and moved aside to
        `<directory>/<step>.damaged`, so that later saves of that step work.

        Raises:
          CheckpointError: there is no checkpoint, or every one is damaged.
        """
        steps = sorted(self._manager.all_steps(), reverse=True)
        if not steps:
            raise CheckpointError(f"no checkpoint in {self.directory}")
        for step in steps:
            try:
                return step, self.restore(template, step)
            except Exception as error:  # noqa: BLE001  orbax and tensorstore raise many kinds
                aside = self._move_aside(step)
                note(f"checkpoint {step} in {self.directory} is damaged ({_first_line(error)}); "
                     f"moved to {aside}")
        raise CheckpointError(f"every checkpoint in {self.directory} is damaged (steps "
                              f"{', '.join(map(str, steps))}, moved aside as <step>.damaged)")

    def _move_aside(self, step: int) -> str:
        target, suffix = os.path.join(self.directory, f"{step}.damaged"), 1
        while os.path.exists(target):
            suffix += 1
            target = os.path.join(self.directory, f"{step}.damaged{suffix}")
        os.replace(os.path.join(self.directory, str(step)), target)
        self._manager.reload()
        return target

    def clear(self) -> None:
        """Deletes every checkpoint in the directory (the directory itself stays)."""
        for name in os.listdir(self.directory):
            path = os.path.join(self.directory, name)
            shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
        self._manager.reload()

    def close(self) -> None:
        self._manager.close()


class CheckpointError(ValueError):
    """No checkpoint could be restored (a bad file, as a bad record is a ValueError); the
    message says why in one line."""


def _first_line(error: BaseException, limit: int = 160) -> str:
    text = next((line.strip() for line in str(error).splitlines() if line.strip()),
                type(error).__name__)
    return (text[:limit] + "...") if len(text) > limit else text
