"""A trained run as a behaviour policy and a value source (`stepcredit.diagnose.checkpoint`).

One tiny ALFWorld run (the shape family of tests/train/test_trainer.py, one
iteration of step GAE so the value head moves off zero) serves every test.
"""

import os
import shutil

import numpy as np
import pytest
from scipy.special import log_softmax

from stepcredit.diagnose import checkpoint as module
from stepcredit.diagnose.checkpoint import CheckpointPolicy, checkpoint_values, load_run
from stepcredit.diagnose.policies import entropy
from stepcredit.diagnose.sample import play
from stepcredit.models.transformer import forward
from stepcredit.rollout import step_prompt
from stepcredit.train.build import make_env
from stepcredit.train.checkpoint import CheckpointError
from tests.train.test_trainer import train


@pytest.fixture(scope="module")
def logdir(tmp_path_factory):
    path = tmp_path_factory.mktemp("run")
    train(path, "alfworld", "step_gae")
    return path


@pytest.fixture(scope="module")
def policy(logdir):
    return CheckpointPolicy.load(logdir)


@pytest.fixture
def env(policy):
    env = make_env(policy.run.config, "train")
    yield env
    env.close()


def direct_logprob(run, prompt_ids, action: str) -> float:
    """sum_n log softmax(logits)[a_n] from one unpadded forward pass of prompt + action + <eoa>."""
    ids = run.tokenizer.encode(action)
    if len(ids) < run.config.rollout.action_length:
        ids = ids + [run.tokenizer.special.eoa]
    row = np.array([list(prompt_ids) + ids], np.int32)
    logits, _ = forward(run.graphdef, run.params, row, np.ones_like(row, bool))
    logp = log_softmax(np.asarray(logits[0], np.float64), axis=-1)
    return float(sum(logp[len(prompt_ids) - 1 + j, token] for j, token in enumerate(ids)))


def rollout_history(run, history):
    """A history as the rollout stores it: the sampled ids of each action, <eoa> included."""
    eoa = run.tokenizer.special.eoa
    return [(text, run.tokenizer.encode(action) + [eoa]) for text, action in history]


def test_the_distribution_is_the_softmax_of_summed_logprobs(policy, env):
    run = policy.run
    assert run.config.rollout.action_format == "text" and policy.temperature == 1.0
    assert policy.label == f"checkpoint:{os.path.basename(run.logdir)}"
    assert policy.deviation(env, np.random.default_rng(0)) == -1
    first = env.reset(0)
    action = first.admissible_actions[-1]
    second = env.step(action).observation
    history = [(first.text, action)]
    actions, probs = policy.distribution(env, second, history, 1, -1)
    assert actions == second.admissible_actions and probs.dtype == np.float64
    assert np.all(np.isfinite(probs)) and np.all(probs > 0)
    np.testing.assert_allclose(probs.sum(), 1.0, atol=1e-12)
    # The prompt the rollout would build: the history holds the sampled ids, not the text.
    prompt = step_prompt(run.tokenizer, run.config.rollout, second,
                         rollout_history(run, history)).ids
    direct = np.array([direct_logprob(run, prompt, a) for a in actions])
    np.testing.assert_allclose(policy.logprobs(second, history), direct, atol=2e-4)
    expected = np.exp(direct - direct.max()) / np.exp(direct - direct.max()).sum()
    np.testing.assert_allclose(np.log(probs), np.log(expected), atol=2e-4)
    assert len(set(np.round(direct, 3))) > 1  # a distribution, not a uniform one


def test_a_higher_temperature_raises_the_entropy(policy, env):
    observation = env.reset(1)
    entropies = []
    for temperature in (0.5, 1.0, 2.0):
        tempered = CheckpointPolicy(policy.run, temperature=temperature)
        _, probs = tempered.distribution(env, observation, [], 0, -1)
        logp = tempered.logprobs(observation, [])
        shifted = logp / temperature - (logp / temperature).max()
        np.testing.assert_allclose(np.log(probs), shifted - np.log(np.exp(shifted).sum()),
                                   atol=1e-9)
        entropies.append(entropy(probs))
    assert entropies[0] < entropies[1] < entropies[2] <= np.log(len(probs)) + 1e-9
    with pytest.raises(ValueError, match="temperature must be > 0"):
        CheckpointPolicy(policy.run, temperature=0.0)


def test_a_revisited_state_costs_no_model_call(policy, env, monkeypatch):
    observation = env.reset(2)
    actions, probs = policy.distribution(env, observation, [], 0, -1)

    def refuse(*args, **kwargs):
        raise AssertionError("the cache missed a state it had scored")

    monkeypatch.setattr(module, "action_logprobs", refuse)
    again, cached = policy.distribution(env, observation, [], 0, -1)
    assert again == actions
    np.testing.assert_array_equal(cached, probs)
    cached[0] = -1.0  # the caller's copy: the cache keeps its own
    np.testing.assert_array_equal(policy.distribution(env, observation, [], 0, -1)[1], probs)


def test_play_runs_an_episode_with_monte_carlo_ground_truth(policy, env):
    episode = play(env, policy, 3, np.random.default_rng(0), continuations=2)
    assert 1 <= episode.length <= policy.run.config.max_steps
    assert np.all(np.isfinite(episode.advantage)) and np.all(np.isfinite(episode.advantage_se))
    assert np.all(episode.entropy > 0)
    again = play(env, policy, 3, np.random.default_rng(0), continuations=2)
    assert again.actions == episode.actions  # the same stream plays the same episode


def test_checkpoint_values_are_the_value_head_at_each_prompt(logdir, policy, env):
    run = policy.run
    episodes = [play(env, policy, task, np.random.default_rng(task)) for task in (0, 4)]
    values = checkpoint_values(run, episodes, env=env)
    assert [v.shape for v in values] == [(e.length,) for e in episodes]
    assert all(v.dtype == np.float64 and np.all(np.isfinite(v)) for v in values)
    # Step 1 of episode 0, read independently: the critic at the prompt's last token.
    episode = episodes[0]
    assert episode.length >= 2
    env.reset(episode.task)
    observation = env.step(episode.actions[0]).observation
    prompt = step_prompt(run.tokenizer, run.config.rollout, observation, rollout_history(
        run, [(episode.observations[0], episode.actions[0])])).ids
    row = np.array([prompt], np.int32)
    _, direct = forward(run.graphdef, run.params, row, np.ones_like(row, bool))
    direct = float(direct[0, -1])
    assert direct != 0.0  # the critic trained: not the zero-initialised head
    np.testing.assert_allclose(values[0][1], direct, atol=1e-5)
    for by_path, by_run in zip(checkpoint_values(str(logdir), episodes, env=env), values):
        np.testing.assert_array_equal(by_path, by_run)
    assert checkpoint_values(policy, []) == []


def test_a_replay_that_does_not_reproduce_the_episode_is_refused(policy, env):
    episodes = [play(env, policy, 0, np.random.default_rng(0))]
    other = make_env(policy.run.config, "unseen")
    try:
        with pytest.raises(ValueError, match="pass env="):
            checkpoint_values(policy, episodes, env=other)
    finally:
        other.close()


def test_a_logdir_without_a_checkpoint_is_one_clear_line(logdir, tmp_path):
    with pytest.raises(ValueError, match="config.json not found") as missing:
        load_run(tmp_path)
    shutil.copy(os.path.join(logdir, "config.json"), tmp_path / "config.json")
    with pytest.raises(CheckpointError, match="no checkpoint in") as empty:
        CheckpointPolicy.load(tmp_path)
    (tmp_path / "checkpoints").mkdir()
    with pytest.raises(CheckpointError, match="no checkpoint in") as empty_folder:
        checkpoint_values(tmp_path, [])  # nothing to value, but the run is still checked
    for error in (missing, empty, empty_folder):
        assert "\n" not in str(error.value)


def test_diagnose_grades_credit_under_a_trained_policy_and_its_value_head(logdir):
    from stepcredit.diagnose.config import DiagnoseConfig
    from stepcredit.diagnose.run import diagnose

    diagnosis = diagnose(DiagnoseConfig(
        envs=("alfworld",), policy=f"checkpoint={logdir}", values="checkpoint",
        value_checkpoint=str(logdir), estimators=("grpo", "step_gae"), tasks=2, group_size=2,
        seeds=(0,), continuations=2, max_steps=4, bootstrap=5), progress=False)
    assert diagnosis.score("alfworld", "step_gae", "auc").n > 0
    assert any(str(logdir) in note for note in diagnosis.notes)
    with pytest.raises(ValueError, match="needs value_checkpoint"):
        DiagnoseConfig(values="checkpoint")
