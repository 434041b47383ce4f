"""VinePPO's collector: continuations resume the exact state, V_MC is their mean return,
keys make it reproducible, and environments without snapshots are refused."""

import dataclasses

import jax
import numpy as np
import pytest

from stepcredit.envs.pool import EnvPool
from stepcredit.keys import stable_key
from stepcredit.rollout import RolloutConfig, collect, step_prompt
from stepcredit.train import build as build_lib
from stepcredit.train import vine
from stepcredit.train.build import build, make_env
from stepcredit.train.collection import Collector
from stepcredit.train.config import TrainConfig

TASKS = [0, 3]
LIMIT = 3
K = 3


def _parts(temperature: float):
    config = TrainConfig(env="alfworld", estimator="vineppo", tasks_per_iteration=2,
                         group_size=2, max_steps=LIMIT, d_model=32, num_layers=1,
                         minibatch_rows=16, vine_rollouts=K,
                         rollout=RolloutConfig(max_prompt_tokens=96, max_action_tokens=6,
                                               temperature=temperature))
    return build(config)


@pytest.fixture(scope="module")
def greedy():
    """Greedy decoding: each continuation from s_t replays the original episode's rest."""
    parts, state = _parts(0.0)
    rollout = Collector(parts).rollout(state.policy, TASKS, jax.random.key(0), LIMIT)
    return parts, state, rollout


def _points(parts, rollout):
    env = make_env(parts.config, "train", LIMIT)
    try:
        return vine.branch_points(env, TASKS, rollout.trajectories, parts.config.rollout,
                                  parts.tokenizer)
    finally:
        env.close()


def test_each_branch_point_is_the_recorded_state_and_prompt(greedy):
    parts, _, rollout = greedy
    points, index = _points(parts, rollout)
    config, penalty = parts.config.rollout, parts.config.rollout.invalid_action_penalty
    env = make_env(parts.config, "train", LIMIT)
    for trajectory, rows in zip(rollout.trajectories, index):
        for t, (step, p) in enumerate(zip(trajectory.steps, rows)):
            point = points[p]
            # The policy's prompt there is the one the original step was sampled from ...
            assert (list(step_prompt(parts.tokenizer, config, point.observation,
                                     point.history).ids) == list(step.prompt_ids))
            # ... and the restored environment answers the same action as the original did.
            env.restore(point.snapshot)
            result = env.step(step.info["action"])
            assert result.reward - (0.0 if result.info["valid"] else penalty) == step.reward
            assert (result.done, result.truncated) == (step.done, step.truncated)
            if t + 1 < len(trajectory.steps):
                after = trajectory.steps[t + 1]
                assert stable_key(result.observation.anchor) == after.anchor
                observed = parts.tokenizer.encode(result.observation.text)
                assert observed == list(after.observation_ids)
    env.close()
    # A group's G episodes start in one state: it is valued once.
    assert len(points) < sum(len(t.steps) for t in rollout.trajectories)
    assert all(rows[0] == index[2 * g][0] for g in range(2) for rows in index[2 * g:2 * g + 2])


def test_greedy_continuations_replay_the_episode_so_v_mc_is_its_return_to_go(greedy):
    parts, _, rollout = greedy
    for trajectory in rollout.trajectories:
        rewards = np.array([s.reward for s in trajectory.steps])
        values = [s.info[vine.MC_VALUE] for s in trajectory.steps]
        np.testing.assert_allclose(values, np.cumsum(rewards[::-1])[::-1], atol=1e-6)
    points, index = _points(parts, rollout)
    remaining = {p: len(t.steps) - i for t, rows in zip(rollout.trajectories, index)
                 for i, p in enumerate(rows)}
    assert rollout.metrics["vine/env_steps"] == K * sum(remaining.values())
    assert rollout.metrics["vine/states"] == len(points) and rollout.metrics["time/vine"] > 0
    array = vine.mc_value_array(rollout.trajectories, LIMIT + 1)
    assert array.shape == (4, LIMIT + 1) and np.all(array[:, LIMIT] == 0)


def test_v_mc_is_the_mean_of_continuations_played_one_state_at_a_time(greedy):
    """The batched pools (padded with idle environments) against a slow plain loop: each
    continuation alone in a pool of one, from the point's snapshot and prompt history."""
    parts, state, rollout = greedy
    points, index = _points(parts, rollout)
    batched, steps = vine.continuation_returns(parts, state.policy, points, K,
                                               jax.random.key(1), LIMIT)
    slow, slow_steps = np.zeros((len(points), K)), 0
    config = dataclasses.replace(parts.config.rollout, bootstrap_truncated=False)
    for p, point in enumerate(points):
        for k in range(K):
            with EnvPool([vine._Resume(make_env(parts.config, "train", LIMIT), points)]) as pool:
                played = collect(parts.graphdef, state.policy, pool, [p], 1, parts.tokenizer,
                                 jax.random.key(k), config, history=[point.history])
            slow[p, k] = played.trajectories[0].score
            slow_steps += len(played.trajectories[0].steps)
    np.testing.assert_allclose(batched, slow, atol=1e-6)
    for trajectory, rows in zip(rollout.trajectories, index):
        np.testing.assert_allclose([s.info[vine.MC_VALUE] for s in trajectory.steps],
                                   slow.mean(axis=1)[rows], atol=1e-6)
    assert steps == slow_steps  # the idle padding plays no environment step


def test_continuations_are_a_function_of_the_iterations_key():
    parts, state = _parts(1.0)
    collector = Collector(parts)
    first, again = (collector.rollout(state.policy, TASKS, jax.random.key(7), LIMIT)
                    for _ in range(2))
    for a, b in zip(first.trajectories, again.trajectories):
        assert [s.info[vine.MC_VALUE] for s in a.steps] == [s.info[vine.MC_VALUE] for s in b.steps]
    assert first.metrics["vine/env_steps"] == again.metrics["vine/env_steps"]
    points, _ = _points(parts, first)
    draws = [vine.continuation_returns(parts, state.policy, points, K, jax.random.key(s), LIMIT)
             for s in (7, 7)]
    np.testing.assert_array_equal(draws[0][0], draws[1][0])


def test_environments_without_snapshots_are_refused(monkeypatch):
    class Plain:  # an Env without snapshot/restore/clone, like TextWorld or HTTP
        name, max_steps = "plain", 3

        def close(self):
            pass

    monkeypatch.setattr(build_lib, "make_env", lambda config, split: Plain())
    with pytest.raises(ValueError, match="vineppo's Monte Carlo values .* environment 'plain' has no snapshots"):
        build_lib.check_snapshots(TrainConfig(env="textworld", estimator="vineppo"),
                                  vine.VALUES_NEED)
