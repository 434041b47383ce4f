"""Tests of `stepcredit.diagnose.prm.fit_prm`: layout, the untrained PRM, training, estimators."""

from __future__ import annotations

import random

import jax.numpy as jnp
import numpy as np
import pytest

from stepcredit import advantages as adv
from stepcredit.advantages.inputs import CreditInputs
from stepcredit.advantages.istar import implicit_step_rewards
from stepcredit.diagnose.episodes import Episode, stack
from stepcredit.diagnose.prm import PRMInputs, fit_prm
from stepcredit.envs import registry
from stepcredit.train.build import build_tokenizer

MAX_STEPS = 6


def _play(env, task: int, group: int, *, expert: float, rng: random.Random) -> Episode:
    """One episode: the expert's action with probability `expert`, else a random admissible one."""
    observation = env.reset(task)
    observations, actions, anchors, rewards = [], [], [], []
    while True:
        admissible = observation.admissible_actions
        action = env.expert_action() if rng.random() < expert else rng.choice(admissible)
        observations.append(observation.text)
        actions.append(action)
        anchors.append(observation.anchor)
        result = env.step(action)
        rewards.append(result.reward)
        observation = result.observation
        if result.done or result.truncated:
            break
    t = len(actions)
    zeros = np.zeros(t)
    return Episode(env=env.name, seed=0, task=task, group=group, task_text=observation.task,
                   observations=tuple(observations), actions=tuple(actions),
                   anchors=tuple(anchors), rewards=np.asarray(rewards, np.float64), entropy=zeros,
                   distance_before=zeros.astype(int), distance_after=zeros.astype(int),
                   good=zeros.astype(bool), deviation=-1, advantage=np.full(t, np.nan),
                   advantage_se=np.full(t, np.nan), score=float(result.info["score"]),
                   won=bool(result.info["won"]), truncated=bool(result.truncated))


@pytest.fixture(scope="module")
def episodes() -> list[Episode]:
    """4 groups of 4 ALFWorld episodes: in each, two by the expert (won), two random (lost)."""
    env = registry.make("alfworld", difficulty=0, max_steps=MAX_STEPS)
    rng = random.Random(0)
    out, task = [], 0
    while len(out) < 16:
        group = [_play(env, task, len(out) // 4, expert=p, rng=rng) for p in (1.0, 1.0, 0.0, 0.0)]
        if [e.won for e in group] == [True, True, False, False]:
            out += group
        task += 1
    env.close()
    return out


@pytest.fixture(scope="module")
def untrained(episodes) -> PRMInputs:
    # One full-batch minibatch (the trainer's step); `trained` takes two of two groups each.
    return fit_prm(episodes, env_name="alfworld", steps=0, env_kwargs={"difficulty": 0},
                   trajectories_per_step=None)


@pytest.fixture(scope="module")
def trained(episodes) -> PRMInputs:
    return fit_prm(episodes, env_name="alfworld", steps=12, learning_rate=3e-3,
                   env_kwargs={"difficulty": 0}, trajectories_per_step=8)


def test_layout(episodes, untrained):
    tokenizer = build_tokenizer("alfworld")
    lengths = [[len(tokenizer.encode(a)) + 1 for a in e.actions] for e in episodes]  # + <eoa>
    out = untrained
    n = max(sum(x) for x in lengths)
    assert out.step_index.shape == out.prm_logp.shape == out.ref_logp.shape == (len(episodes), n)
    assert out.step_index.dtype == np.int32 and out.prm_logp.dtype == np.float32
    for b, counts in enumerate(lengths):
        expected = np.concatenate([np.full(c, t) for t, c in enumerate(counts)])
        row = out.step_index[b]
        np.testing.assert_array_equal(row[:len(expected)], expected)
        assert np.all(row[len(expected):] == -1)
        assert np.all(out.ref_logp[b, len(expected):] == 0)
        assert np.all(out.ref_logp[b, :len(expected)] < 0)
    assert out.seconds > 0 and out.description.startswith("PRM: small transformer")


def test_no_steps_leaves_the_reference(untrained):
    np.testing.assert_array_equal(untrained.prm_logp, untrained.ref_logp)
    assert untrained.losses == ()


def test_training_separates_won_from_lost(episodes, trained):
    step_index = trained.step_index
    success = np.array([e.score > 0 for e in episodes])
    groups = np.array([e.group for e in episodes])
    loss, _ = adv.trajectory_preference_loss(trained.prm_logp, trained.ref_logp, step_index >= 0,
                                             step_index, success, groups, beta=0.05)
    assert float(loss) < np.log(2) - 0.01  # log 2 at the start: every margin is 0
    assert trained.losses[-1] < trained.losses[0]
    rewards = np.asarray(implicit_step_rewards(trained.prm_logp, trained.ref_logp, step_index,
                                               MAX_STEPS, beta=0.05))
    mask = stack(episodes).mask
    for g in np.unique(groups):
        won = [b for b in np.flatnonzero(groups == g) if episodes[b].won]
        lost = [b for b in np.flatnonzero(groups == g) if not episodes[b].won]
        assert rewards[won][mask[won]].mean() > rewards[lost][mask[lost]].mean()


@pytest.mark.parametrize("name", ["istar", "rloo+istar", "grpo+istar", "prime"])
def test_feeds_the_estimators(episodes, trained, name):
    stacked = stack(episodes)
    inputs = CreditInputs(mask=jnp.asarray(stacked.mask), group_ids=jnp.asarray(stacked.group_ids),
                          scores=jnp.asarray(stacked.scores),
                          step_index=jnp.asarray(trained.step_index),
                          prm_logp=jnp.asarray(trained.prm_logp),
                          ref_logp=jnp.asarray(trained.ref_logp))
    out = adv.apply(name, inputs)
    advantages = np.asarray(out.advantages)
    assert advantages.shape == (stacked.mask.shape if out.level == "step"
                                else trained.step_index.shape)
    assert np.all(np.isfinite(advantages)) and np.any(advantages != 0)


def test_errors(episodes):
    with pytest.raises(ValueError, match="episodes is empty"):
        fit_prm([], env_name="alfworld")
    with pytest.raises(ValueError, match="not env_name"):
        fit_prm(episodes[:2], env_name="webshop")
    with pytest.raises(ValueError, match="does not replay"):
        fit_prm(episodes[:2], env_name="alfworld", env_kwargs={"difficulty": 2})
