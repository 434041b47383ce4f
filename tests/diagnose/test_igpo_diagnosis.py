"""IGPO in the diagnosis: the behaviour policy's belief in the answer, and a finite row."""

import dataclasses
import math

import numpy as np

from stepcredit.diagnose.config import DiagnoseConfig
from stepcredit.diagnose.episodes import stack
from stepcredit.diagnose.estimates import step_credit, word_tokens
from stepcredit.diagnose.policies import EpsilonExpert
from stepcredit.diagnose.run import diagnose
from stepcredit.diagnose.sample import play, sample_episodes
from stepcredit.envs import registry


def test_the_belief_is_the_policys_probability_of_the_answer_action():
    env = registry.make("hotpotqa")
    expert = play(env, EpsilonExpert(0.0), 2, np.random.default_rng(0))
    # The expert answers only once it has read every supporting fact: at its last step.
    assert expert.won and expert.actions[-1] == f"finish[{env.reference_answer()}]"
    np.testing.assert_array_equal(expert.answer_prob, [0.0] * (expert.length - 1) + [1.0])
    noisy = play(env, EpsilonExpert(0.3), 2, np.random.default_rng(1))
    assert ((noisy.answer_prob >= 0) & (noisy.answer_prob <= 1)).all()
    assert play(registry.make("alfworld"), EpsilonExpert(0.3), 2,
                np.random.default_rng(1)).answer_prob is None


def test_information_gain_changes_igpo_only_where_there_is_an_answer():
    for name in ("hotpotqa", "webshop"):
        env = registry.make(name)
        episodes = sample_episodes(env, EpsilonExpert(0.3), [0, 1, 2], group_size=4, seed=0,
                                   continuations=0)
        stacked = stack(episodes)
        zeros = [np.zeros(e.length) for e in episodes]
        shape = {"num_steps": 16, "num_tokens": 64}  # one compiled shape for all four calls
        credit, failures = step_credit(["igpo"], episodes, stacked, zeros, word_tokens(episodes),
                                       **shape)
        assert failures == {} and np.isfinite(credit["igpo"]).all()
        blind = [dataclasses.replace(e, answer_prob=None) for e in episodes]
        outcome_only, _ = step_credit(["igpo"], blind, stacked, zeros, word_tokens(blind), **shape)
        same = np.allclose(credit["igpo"], outcome_only["igpo"])
        assert same == (name == "webshop"), name


def test_igpo_gets_a_finite_row_on_every_simulator():
    result = diagnose(DiagnoseConfig(tasks=2, group_size=4, seeds=(0,), continuations=2,
                                     estimators=("igpo",), bootstrap=10, values="zero"),
                      progress=False)
    for env in ("webshop", "alfworld", "hotpotqa"):
        assert math.isfinite(result.score(env, "igpo", "auc").estimate)
