"""TextWorldEnv on a small game generated offline with `tw-make` at test time."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

pytest.importorskip("textworld")

from stepcredit.envs.base import Env  # noqa: E402
from stepcredit.envs.textworld_env import TextWorldConfig, TextWorldEnv  # noqa: E402


def _tw_make() -> str:
    beside_python = os.path.join(os.path.dirname(sys.executable), "tw-make")
    found = beside_python if os.path.exists(beside_python) else shutil.which("tw-make")
    assert found, "textworld is installed but its tw-make script was not found"
    return found


@pytest.fixture(scope="module")
def game_file(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("tw") / "game.z8")
    subprocess.run([_tw_make(), "custom", "--world-size", "3", "--nb-objects", "5",
                    "--quest-length", "3", "--seed", "1", "--output", path, "--silent"],
                   check=True, capture_output=True, timeout=120)
    return path


@pytest.fixture()
def env(game_file):
    environment = TextWorldEnv([game_file], TextWorldConfig(max_steps=20))
    yield environment
    environment.close()


def test_walkthrough_wins(env):
    assert isinstance(env, Env)
    obs = env.reset(0)
    walkthrough = env.walkthrough()
    assert len(walkthrough) == 3 and env.oracle_actions() == walkthrough
    assert obs.task and obs.text and obs.admissible_actions
    results = []
    for distance, command in zip(range(len(walkthrough), 0, -1), walkthrough):
        assert env.oracle_distance() == distance
        assert command in obs.admissible_actions
        result = env.step(command)
        results.append(result)
        obs = result.observation
        assert result.info["valid"] and result.info["intermediate_reward"] == 1.0
    assert [r.done for r in results] == [False, False, True]
    assert results[-1].info["won"] and results[-1].info["score"] == 1.0
    assert sum(r.reward for r in results) == 1.0
    with pytest.raises(RuntimeError, match="episode is over"):
        env.step("look")


def test_anchor_is_the_raw_state_without_history(env):
    start = env.reset(0)
    looked = env.step("look")
    # Same room and inventory, different moves count and feedback: same anchor.
    assert looked.observation.anchor == start.anchor
    assert "-= " in looked.observation.text and ">" not in looked.observation.text
    moved = env.step(env.oracle_actions()[0])
    assert moved.observation.anchor != start.anchor
    assert env.reset(0).anchor == start.anchor  # same game, same start


def test_oracle_from_a_detour_still_wins(env):
    obs = env.reset(0)
    detour = next(a for a in obs.admissible_actions if a not in env.walkthrough()
                  and a.startswith(("open", "examine")))
    env.step(detour)
    result = None
    for command in env.oracle_actions():
        result = env.step(command)
    assert result.done and result.info["won"]


def test_inadmissible_command_is_answered_and_marked_invalid(env):
    env.reset(0)
    result = env.step("dance with the board")
    assert not result.done and not result.truncated
    assert result.info["valid"] is False
    assert result.info["error"] == result.observation.text and result.info["error"]


def test_step_limit_truncates(game_file):
    with_limit = TextWorldEnv([game_file], TextWorldConfig(max_steps=2))
    try:
        with_limit.reset(0)
        assert [with_limit.step("look").truncated for _ in range(2)] == [False, True]
    finally:
        with_limit.close()


def test_argument_errors(game_file, tmp_path):
    with pytest.raises(ValueError, match="game_files: no such file"):
        TextWorldEnv([str(tmp_path / "missing.z8")])
    with pytest.raises(ValueError, match="max_steps"):
        TextWorldConfig(max_steps=0)
    env = TextWorldEnv([game_file])
    with pytest.raises(ValueError, match=r"task must be an index in \[0, 1\)"):
        env.reset(3)
    with pytest.raises(RuntimeError, match="call reset first"):
        env.oracle_actions()
    first = env.reset(0)
    with pytest.raises(ValueError, match="task: no such game file"):
        env.reset(str(tmp_path / "missing.z8"))
    assert env.reset(0) == first  # the game loaded before is kept
    env.close()
    with pytest.raises(RuntimeError, match="the environment is closed"):
        env.reset(0)


def test_served_over_http_plays_the_walkthrough_to_a_win(game_file):
    from stepcredit.envs.http_client import HttpConfig, HttpEnv
    from stepcredit.envs.http_server import start_server_process

    spec = "stepcredit.envs.textworld_env:TextWorldEnv"
    with start_server_process(spec, env_kwargs={"game_files": [game_file]}) as server:
        with HttpEnv(server.url, config=HttpConfig(timeout_s=5.0, retries=1)) as env:
            assert (env.name, env.max_steps) == ("textworld", 50)
            obs = env.reset(0)
            assert isinstance(obs.anchor, tuple) and obs.admissible_actions
            local = TextWorldEnv([game_file])
            try:
                local_obs = local.reset(0)
                walkthrough = local.walkthrough()
            finally:
                local.close()
            assert obs == local_obs
            results = [env.step(command) for command in walkthrough]
            assert results[-1].done and results[-1].info["won"]
            assert sum(r.reward for r in results) == 1.0
