"""TextWorld games as stepcredit environments (optional extra `textworld`).

TextWorld (Cote et al., "TextWorld: A Learning Environment for Text-based
Games", arXiv 1806.11532) generates and runs parser games in Inform 7. This
adapter plays compiled game files (`.z8`, e.g. from `tw-make`) through
`textworld.start` and exposes what credit assignment needs:

- the admissible commands of every state;
- the reward: the change of the game's score, divided by its maximum, so that
  an episode's rewards sum to its normalised score (1.0 on a win);
- TextWorld's intermediate reward in `info["intermediate_reward"]`: +1 when an
  action moved the player closer to the goal, -1 when further, 0 otherwise;
- the walkthrough from the start (`walkthrough()`), and `oracle_actions()` /
  `oracle_distance()`: the winning policy from the current state;
- the anchor: the room description and inventory as the game reports them,
  without the feedback or the move counter, so that equal states share it.

It does not support snapshots (`SnapshotEnv`): the game state lives in the
game interpreter, outside Python, and this adapter does not save it, so
`snapshot`, `restore` and `clone` are absent and `isinstance(env, SnapshotEnv)`
is False.

Install with `pip install 'stepcredit[textworld]'`.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from typing import Any, Sequence

from stepcredit.envs.base import Observation, StepResult, as_actions, step_info


@dataclasses.dataclass(frozen=True)
class TextWorldConfig:
    """Options of a `TextWorldEnv`.

    Attributes:
      max_steps: the step limit, after which an episode is truncated.
    """

    max_steps: int = 50

    def __post_init__(self) -> None:
        if self.max_steps < 1:
            raise ValueError(f"TextWorldConfig.max_steps must be >= 1, got {self.max_steps}")


def _feedback(raw: str) -> str:
    """Cuts the prompt and status line (`>  -= Room =-0/3`) after the game's answer."""
    text = raw.rsplit("\n>", 1)[0] if "\n>" in raw else raw
    return text.strip()


class TextWorldEnv:
    """An `Env` over TextWorld game files (without snapshots: see the module docstring).

    Args:
      game_files: the compiled games (`.z8` or `.ulx`) that tasks index.
      config: the step limit.

    Raises:
      ImportError: the `textworld` package is not installed.
      ValueError: `game_files` is empty or names a missing file.
    """

    name = "textworld"

    def __init__(self, game_files: Sequence[str], config: TextWorldConfig = TextWorldConfig()):
        try:
            import textworld
        except ImportError as e:
            raise ImportError("TextWorldEnv needs the 'textworld' package: "
                              "pip install 'stepcredit[textworld]'") from e
        if isinstance(game_files, str):
            game_files = [game_files]
        if not game_files:
            raise ValueError("game_files must name at least one game")
        missing = [f for f in game_files if not os.path.isfile(f)]
        if missing:
            raise ValueError(f"game_files: no such file(s): {missing}")
        self.game_files = tuple(game_files)
        self.config = config
        self.max_steps = config.max_steps
        self._infos = textworld.EnvInfos(
            admissible_commands=True, intermediate_reward=True, policy_commands=True,
            description=True, inventory=True, objective=True, score=True, max_score=True,
            won=True, lost=True, extras=["walkthrough"])
        self._textworld = textworld
        self._env: Any = None
        self._loaded: str | None = None
        self._state: Any = None
        self._steps = 0
        self._finished = True
        self._closed = False

    def _observation(self, text: str) -> Observation:
        state = self._state
        return Observation(text=text,
                           admissible_actions=as_actions(state["admissible_commands"]),
                           anchor=(state["description"], state["inventory"]),
                           task=state["objective"])

    def reset(self, task: int | str) -> Observation:
        """Starts the game `task`: an index into `game_files` or a game file path.

        Returns:
          The first observation: the room description (TextWorld's opening
          banner is left out; the objective is the observation's `task`).

        Raises:
          ValueError: `task` is neither an index nor an existing file; the game
            loaded before is kept.
          RuntimeError: the environment is closed.
        """
        if self._closed:
            raise RuntimeError("TextWorldEnv.reset: the environment is closed")
        if isinstance(task, str):
            if not os.path.isfile(task):
                raise ValueError(f"task: no such game file {task!r}")
            path = task
        elif isinstance(task, int) and not isinstance(task, bool) and (
                0 <= task < len(self.game_files)):
            path = self.game_files[task]
        else:
            raise ValueError(f"task must be an index in [0, {len(self.game_files)}) or a game "
                             f"file path, got {task!r}")
        if path != self._loaded:
            with warnings.catch_warnings():
                # Jericho cannot track score in TextWorld-made games and says so;
                # TextWorld tracks it itself from the game's quest data.
                warnings.filterwarnings("ignore", message=".*is not fully supported")
                started = self._textworld.start(path, request_infos=self._infos)
            if self._env is not None:  # only once the new game started: a failure keeps it
                self._env.close()
            self._env, self._loaded = started, path
        self._state = self._env.reset()
        self._steps, self._finished = 0, False
        return self._observation(self._state["description"].strip())

    def step(self, action: str) -> StepResult:
        """Sends one command to the game.

        An inadmissible command is still sent: the game answers it ("You can't
        see any such thing.") and that answer is both the observation and
        `info["error"]`, with `info["valid"] = False`.

        Raises:
          RuntimeError: the episode is over or was never reset.
        """
        if self._finished:
            raise RuntimeError(f"TextWorldEnv.step({action!r}): the episode is over or was "
                               "never reset; call reset first")
        valid = action in self._state["admissible_commands"]
        previous_score = self._state["score"]
        self._state, score, done = self._env.step(action)
        done = bool(done)
        self._steps += 1
        max_score = self._state["max_score"] or 1
        text = _feedback(self._state["feedback"])
        truncated = not done and self._steps >= self.max_steps
        self._finished = done or truncated
        info = step_info(valid=valid, won=bool(self._state["won"]), score=score / max_score,
                         error="" if valid else text, lost=bool(self._state["lost"]),
                         intermediate_reward=float(self._state["intermediate_reward"]))
        return StepResult(self._observation(text), (score - previous_score) / max_score,
                          done, truncated, info)

    def _current(self, method: str) -> Any:
        if self._state is None:
            raise RuntimeError(f"TextWorldEnv.{method}: call reset first")
        return self._state

    def oracle_actions(self) -> list[str]:
        """The winning policy's commands from the current state (TextWorld's
        `policy_commands`); on a fresh episode, a walkthrough."""
        return list(self._current("oracle_actions")["policy_commands"])

    def oracle_distance(self) -> int:
        """The number of commands left on the winning policy from the current state."""
        return len(self._current("oracle_distance")["policy_commands"])

    def walkthrough(self) -> list[str]:
        """The game's walkthrough from the start, as its generator recorded it."""
        return list(self._current("walkthrough")["extra.walkthrough"])

    def close(self) -> None:
        """Closes the game interpreter; the environment accepts no further calls."""
        self._closed = True
        if self._env is not None:
            self._env.close()
            self._env = None
            self._loaded = None
        self._state = None
        self._finished = True
