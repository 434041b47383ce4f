"""Snapshots of the embedded simulators: `snapshot`, `restore` and `clone`.

The main check plays random admissible, oracle and invalid actions, takes
snapshots at random points, keeps playing (other tasks included), restores,
and requires the restored environment to hold the state it had (compared with
a deep copy taken with the snapshot) and to answer every later action exactly
as the original did. Dropping any name from a simulator's `_episode_state`
must make that check fail, so a missed attribute cannot go unnoticed.
"""

from __future__ import annotations

import copy
import random
import statistics
import time
from typing import Any

import pytest

from stepcredit.envs import AlfWorldEnv, HotpotQAEnv, WebShopEnv, _sim
from stepcredit.envs.base import SnapshotEnv
from stepcredit.envs.http_client import HttpEnv
from stepcredit.envs.textworld_env import TextWorldEnv

SIMULATORS = (WebShopEnv, AlfWorldEnv, HotpotQAEnv)
CONFIGS = [(cls, kw) for cls in SIMULATORS for kw in (
    {"difficulty": 0}, {"difficulty": 1}, {"difficulty": 2, "split": cls.splits[-1]})]
# Actions each simulator refuses, or accepts off the admissible list.
ODD_ACTIONS = {
    "webshop": ("buy everything", "click[no such button]", "search[]", "search[  ]",
                "search[red cotton socks]", "click[next>]", "click[< prev]"),
    "alfworld": ("fly away", "go to the moon", "take apple 1 from fridge 1", "open",
                 "put mug 1 in/on bed 1", "go to countertop 1", "LOOK"),
    "hotpotqa": ("answer", "lookup[born]", "search[]", "search[nobody at all]", "lookup[zzz]",
                 "finish[]"),
}
# Data the environments share by design, compared by identity.
SHARED = ("_catalogue", "_kb")


def _declared(env: Any) -> tuple[str, ...]:
    return _sim._BASE_STATE + env._episode_state


def _action(env: Any, rng: random.Random) -> str:
    u = rng.random()
    if u < 0.2:
        return rng.choice(ODD_ACTIONS[env.name])
    if u < 0.45:
        return env.oracle_actions()[0]
    return rng.choice(env._obs.admissible_actions)


def _probe(env: Any) -> tuple[Any, ...]:
    """Everything the environment answers besides `step`."""
    if not env.running:
        return env.steps_taken, False
    return env.steps_taken, True, env.oracle_actions(), env.oracle_distance(), env.expert_action()


def _play(env: Any, rng: random.Random, steps: int) -> None:
    """Plays `steps` random steps, resetting to a random task when an episode ends."""
    for _ in range(steps):
        if not env.running:
            env.reset(rng.randrange(env.num_tasks))
        env.step(_action(env, rng))


def _finish(env: Any, rng: random.Random) -> None:
    """Plays the episode to its end: won by the oracle or truncated."""
    while env.running:
        env.step(env.oracle_actions()[0] if rng.random() < 0.5 else "no such action")


def _reference(env: Any) -> Any:
    """A deep copy that shares the catalogue or knowledge base (no __eq__)."""
    memo = {id(v): v for k, v in vars(env).items() if k in SHARED}
    return copy.deepcopy(env, memo)


def _mismatches(env: Any, rng: random.Random, num_snapshots: int) -> list[str]:
    """Snapshots, plays on, restores, replays: what differed, if anything."""
    found = []
    env.reset(rng.randrange(env.num_tasks))
    for k in range(num_snapshots):
        _play(env, rng, rng.randrange(5))
        if rng.random() < 0.3:
            _finish(env, rng)
        snapshot, reference = env.snapshot(), _reference(env)
        record, actions, length = [_probe(env)], [], rng.randint(1, 8)
        while env.running and len(actions) < length:
            actions.append(_action(env, rng))
            record.append((env.step(actions[-1]), _probe(env)))
        # Wander off: another task, a few steps, maybe another restore.
        env.reset(rng.randrange(env.num_tasks))
        _play(env, rng, rng.randrange(4))
        if rng.random() < 0.3:
            _finish(env, rng)
        for attempt in range(2):  # a snapshot restores any number of times
            env.restore(snapshot)
            state, expected = vars(env), vars(reference)
            differing = sorted(n for n in expected if state.get(n) != expected[n])
            if differing:
                found.append(f"snapshot {k}, restore {attempt}: state differs in {differing}")
            replay = [_probe(env)] + [(env.step(a), _probe(env)) for a in actions]
            if replay != record:
                first = next(i for i, (a, b) in enumerate(zip(replay, record)) if a != b)
                found.append(f"snapshot {k}, restore {attempt}: answer {first} after "
                             f"{actions[:first]} differs: {replay[first]} != {record[first]}")
    return found


@pytest.mark.parametrize("cls,kw", CONFIGS, ids=lambda x: getattr(x, "name", str(x)))
def test_restore_answers_as_the_original(cls, kw):
    env = cls(**kw)
    for seed in range(3):
        assert _mismatches(env, random.Random(seed), num_snapshots=6) == []


def _detected(env: Any, seed: int) -> bool:
    try:
        return bool(_mismatches(env, random.Random(seed), num_snapshots=6))
    except Exception:  # noqa: BLE001 - a broken restore may also crash the next step
        return True


@pytest.mark.parametrize("cls", SIMULATORS, ids=lambda c: c.name)
def test_every_episode_state_attribute_is_needed(cls, monkeypatch):
    """Leaving any attribute out of the snapshot breaks the check above."""
    env = cls(difficulty=1)
    base, own = _sim._BASE_STATE, cls._episode_state
    for i, name in enumerate(base + own):
        with monkeypatch.context() as patch:
            if i < len(base):
                patch.setattr(_sim, "_BASE_STATE", base[:i] + base[i + 1:])
            else:
                patch.setattr(cls, "_episode_state", own[:i - len(base)] + own[i - len(base) + 1:])
            assert any(_detected(env, seed) for seed in range(5)), \
                f"{cls.name}: dropping {name} went unnoticed"


@pytest.mark.parametrize("cls", SIMULATORS, ids=lambda c: c.name)
def test_episode_state_names_everything_episodes_change(cls):
    """Attributes outside `_episode_state` stay the same objects, unmutated."""
    env = cls()
    before_reset = set(vars(env))
    env.reset(0)
    declared = set(_declared(env))
    assert set(vars(env)) <= before_reset | declared
    others = {n: v for n, v in vars(env).items() if n not in declared}
    contents = {n: copy.copy(v) for n, v in others.items() if type(v) in (list, dict, set)}
    _play(env, random.Random(0), 300)
    assert set(vars(env)) <= before_reset | declared
    for n, v in others.items():
        assert vars(env)[n] is v, n
    for n, v in contents.items():
        assert vars(env)[n] == v, n


@pytest.mark.parametrize("cls", SIMULATORS, ids=lambda c: c.name)
def test_restore_into_another_env_of_the_same_config(cls):
    rng = random.Random(1)
    env, other = cls(difficulty=2), cls(difficulty=2)
    env.reset(5)
    _play(env, rng, 2)
    snapshot = env.snapshot()
    other.restore(snapshot)  # never reset before
    while env.running:
        assert _probe(other) == _probe(env)
        action = _action(env, rng)
        assert other.step(action) == env.step(action)
    assert _probe(other) == _probe(env)


@pytest.mark.parametrize("cls", SIMULATORS, ids=lambda c: c.name)
def test_clone_is_independent(cls):
    rng = random.Random(2)
    env = cls()
    env.reset(7)
    _play(env, rng, 2)
    twin = env.clone()
    assert twin is not env and type(twin) is cls
    declared = set(_declared(env))
    for n, v in vars(env).items():
        if n not in declared:
            assert vars(twin)[n] is v, n  # config, catalogue, knowledge base: shared
        elif type(v) in (list, dict, set):
            assert vars(twin)[n] is not v and vars(twin)[n] == v, n
    start = _probe(twin)
    actions, answers = [], []
    while env.running:
        actions.append(_action(env, rng))
        answers.append((env.step(actions[-1]), _probe(env)))
        assert _probe(twin) == start  # stepping the original leaves the twin
    finished = _probe(env)
    assert [(twin.step(a), _probe(twin)) for a in actions] == answers
    twin.reset(8)
    _play(twin, rng, 3)
    twin.close()
    assert _probe(env) == finished and not env._closed


@pytest.mark.parametrize("cls", SIMULATORS, ids=lambda c: c.name)
def test_clone_before_reset(cls):
    env = cls()
    twin = env.clone()
    assert not twin.running and twin.steps_taken == 0
    assert twin.reset(3) == env.reset(3)


@pytest.mark.parametrize("cls", SIMULATORS, ids=lambda c: c.name)
@pytest.mark.parametrize("ending", ["won", "truncated"])
def test_finished_episode_restores_finished(cls, ending):
    env = cls(max_steps=3) if ending == "truncated" else cls()
    env.reset(4)
    while env.running:
        result = env.step(env.oracle_actions()[0] if ending == "won" else "no such action")
    assert result.done == (ending == "won") and result.truncated == (ending == "truncated")
    snapshot, twin = env.snapshot(), env.clone()
    steps = env.steps_taken
    env.reset(9)
    env.step(env._obs.admissible_actions[0])
    env.restore(snapshot)
    for e in (env, twin):
        assert not e.running and e.steps_taken == steps
        assert e._obs == result.observation
        with pytest.raises(RuntimeError, match="not running"):
            e.step("look")
        if ending == "won":
            with pytest.raises(RuntimeError, match="the episode terminated"):
                e.oracle_actions()
        else:  # a truncated episode's last state still has a distance to the goal
            assert e.oracle_distance() == len(e.oracle_actions()) >= 1
    assert env.reset(2) == twin.reset(2)


@pytest.mark.parametrize("cls", SIMULATORS, ids=lambda c: c.name)
def test_restore_refuses_another_simulator_or_config(cls):
    env = cls(difficulty=1)
    env.reset(0)
    snapshot = env.snapshot()
    for other in SIMULATORS:
        if other is not cls:
            message = f"taken from {cls.__name__}, not {other.__name__}"
            with pytest.raises(ValueError, match=message):
                other().restore(snapshot)
    for kw in ({"difficulty": 0}, {"max_steps": 4}, {"seed": 1}, {"split": cls.splits[-1]}):
        with pytest.raises(ValueError, match="taken with .* but this environment has"):
            cls(**{"difficulty": 1, **kw}).restore(snapshot)
    with pytest.raises(TypeError, match="must be a SimulatorSnapshot, got dict"):
        env.restore({})
    cls(difficulty=1).restore(snapshot)  # an equal config is fine


@pytest.mark.parametrize("cls", SIMULATORS, ids=lambda c: c.name)
def test_closed_or_never_reset(cls):
    env = cls()
    with pytest.raises(RuntimeError, match="snapshot: no episode was started"):
        env.snapshot()
    env.reset(0)
    snapshot = env.snapshot()
    env.close()
    for call in (env.snapshot, env.clone, lambda: env.restore(snapshot)):
        with pytest.raises(RuntimeError, match="the environment is closed"):
            call()


def test_protocol():
    for cls in SIMULATORS:
        assert isinstance(cls(), SnapshotEnv)
    # Neither keeps its episode in Python: no snapshot methods, so not a SnapshotEnv.
    for cls in (TextWorldEnv, HttpEnv):
        assert not any(hasattr(cls, m) for m in ("snapshot", "restore", "clone")), cls


@pytest.mark.parametrize("cls", SIMULATORS, ids=lambda c: c.name)
def test_snapshot_and_restore_take_under_a_millisecond(cls):
    env = cls(difficulty=2)
    env.reset(1)
    _play(env, random.Random(3), 3)
    times = []
    for _ in range(200):
        t = time.perf_counter()
        env.restore(env.snapshot())
        times.append(time.perf_counter() - t)
    assert statistics.median(times) < 1e-3
