"""Checks shared by the tests of the three embedded simulators."""

from __future__ import annotations

import random
from typing import Any, Callable

from stepcredit.envs._text import words


def texts_of(obs: Any) -> list[str]:
    return [obs.text, obs.task, *(obs.admissible_actions or ())]


def play_oracle(env: Any, task: int, vocab: frozenset[str] | None = None) -> int:
    """Plays `oracle_actions()[0]` until the end, checking at every step that the
    oracle's actions are admissible, that its distance equals its plan length and
    falls by exactly one, and that it ends in success. Returns the steps taken."""
    obs = env.reset(task)
    distance = env.oracle_distance()
    steps = 0
    while True:
        plan = env.oracle_actions()
        assert len(plan) == distance >= 1, (task, plan, distance)
        assert plan[0] in obs.admissible_actions, (task, plan[0], obs.admissible_actions)
        result = env.step(plan[0])
        steps += 1
        obs = result.observation
        assert result.info["valid"], (task, plan[0], obs.text)
        if vocab is not None:
            for text in texts_of(obs):
                assert set(words(text)) <= vocab, (text, set(words(text)) - vocab)
        if result.done or result.truncated:
            break
        new_distance = env.oracle_distance()
        assert new_distance == distance - 1, (task, plan, env.oracle_actions())
        distance = new_distance
    assert result.done and not result.truncated and distance == 1, (task, plan)
    assert result.info["won"] and result.reward == 1.0 and result.info["score"] == 1.0
    return steps


def expert_is_the_oracle(make_env: Callable[..., Any], num_tasks: int = 30) -> None:
    """Where the oracle needs nothing the agent cannot observe, the demonstrating
    expert (`expert_action()`) takes the oracle's next action at every step."""
    for j in range(num_tasks):
        env = make_env(difficulty=j % 3)
        env.reset(j)
        while env.running:
            action = env.expert_action()
            assert action == env.oracle_actions()[0], (j, action)
            env.step(action)


def oracle_solves_all(make_env: Callable[..., Any], split: str, num_tasks: int = 200,
                      seed: int = 0) -> None:
    """The oracle solves `num_tasks` random tasks of `split`, cycling over the
    three difficulties, with every text inside the vocabulary."""
    envs = [make_env(split=split, difficulty=d) for d in range(3)]
    vocab = envs[0].vocabulary()
    rng = random.Random(f"{split}/{seed}")
    for j in range(num_tasks):
        env = envs[j % 3]
        play_oracle(env, rng.randrange(env.num_tasks), vocab)


def oracle_from_random_states(make_env: Callable[..., Any], *, num_tasks: int = 100,
                              max_random_steps: int = 10, skip: Callable[[str], bool]) -> None:
    """After up to `max_random_steps` random admissible actions (never ones for
    which `skip` is true, which would end the episode), the oracle still solves
    the task with its distance falling by one per step."""
    rng = random.Random(1)
    vocab = None
    for j in range(num_tasks):
        env = make_env(difficulty=j % 3, max_steps=200)
        vocab = vocab or env.vocabulary()
        obs = env.reset(j)
        for _ in range(rng.randint(1, max_random_steps)):
            choices = [a for a in obs.admissible_actions if not skip(a)]
            result = env.step(rng.choice(choices))
            obs = result.observation
            for text in texts_of(obs):
                assert set(words(text)) <= vocab, (text, set(words(text)) - vocab)
            if result.done:
                break
        if not env.running:
            continue
        distance = env.oracle_distance()
        while True:
            plan = env.oracle_actions()
            assert len(plan) == distance, (j, plan, distance)
            result = env.step(plan[0])
            assert result.info["valid"], (j, plan[0], result.observation.text)
            if result.done:
                break
            assert env.oracle_distance() == distance - 1, (j, plan, env.oracle_actions())
            distance -= 1
        assert result.info["won"] and distance == 1


def random_success_rate(env: Any, num_episodes: int, seed: int = 0) -> float:
    """The success rate of a uniformly random admissible-action policy."""
    rng = random.Random(seed)
    wins = 0
    for i in range(num_episodes):
        obs = env.reset(rng.randrange(env.num_tasks))
        while True:
            result = env.step(rng.choice(obs.admissible_actions))
            obs = result.observation
            if result.done or result.truncated:
                break
        wins += bool(result.info["won"])
    return wins / num_episodes


def play_random(env: Any, task: int, seed: int) -> list[tuple[Any, ...]]:
    """A random admissible episode's (text, actions, anchor, reward, done,
    truncated) per step, for determinism checks."""
    rng = random.Random(seed)
    obs = env.reset(task)
    trace = [(obs.text, obs.admissible_actions, obs.anchor, obs.task)]
    while True:
        result = env.step(rng.choice(obs.admissible_actions))
        obs = result.observation
        trace.append((obs.text, obs.admissible_actions, obs.anchor, result.reward, result.done,
                      result.truncated, result.info))
        if result.done or result.truncated:
            return trace


def check_invalid_actions(env: Any, task: int, bad_actions: list[str], error: str | None) -> None:
    """Each bad action gets its error text verbatim as the observation, marks the
    action invalid and leaves the state (anchor, admissible actions) unchanged."""
    obs = env.reset(task)
    for action in bad_actions:
        result = env.step(action)
        assert not result.info["valid"], action
        assert result.observation.text == result.info["error"] != ""
        if error is not None:
            assert result.observation.text == error, (action, result.observation.text)
        assert result.observation.anchor == obs.anchor
        assert result.observation.admissible_actions == obs.admissible_actions
        assert result.reward == 0.0 and not result.done and not result.truncated
    assert env.running
    # The episode is still solvable after the invalid actions.
    distance = env.oracle_distance()
    for action in env.oracle_actions():
        result = env.step(action)
    assert result.info["won"] and env.steps_taken == len(bad_actions) + distance


def check_step_limit(make_env: Callable[..., Any], bad_action: str) -> None:
    """With max_steps=3 the third step ends the episode as truncated, not done,
    and a fourth step is refused."""
    env = make_env(max_steps=3)
    env.reset(0)
    flags = [(r.done, r.truncated) for r in (env.step(bad_action) for _ in range(3))]
    assert flags == [(False, False), (False, False), (False, True)]
    try:
        env.step(bad_action)
    except RuntimeError as e:
        assert "not running" in str(e)
    else:
        raise AssertionError("a step after truncation was accepted")
