"""VinePPO in `stepcredit diagnose`: Monte Carlo values on their own stream, and a graded row."""

import numpy as np
import pytest

from stepcredit.diagnose.config import DiagnoseConfig
from stepcredit.diagnose.episodes import stack
from stepcredit.diagnose.estimates import step_credit, word_tokens
from stepcredit.diagnose.policies import EpsilonExpert
from stepcredit.diagnose.result import METRICS
from stepcredit.diagnose.run import diagnose
from stepcredit.diagnose.sample import play
from stepcredit.envs import registry


def test_vineppo_gets_a_finite_row():
    diagnosis = diagnose(DiagnoseConfig(envs=("hotpotqa",), estimators=("vineppo", "grpo"),
                                        tasks=2, group_size=4, seeds=(0,), continuations=2,
                                        vine_rollouts=3, bootstrap=5), progress=False)
    assert "vineppo" in diagnosis.estimators
    for metric in ("auc", "spearman", "sign_agreement"):
        score = diagnosis.score("hotpotqa", "vineppo", metric)
        assert np.isfinite(score.estimate) and score.n > 0, metric
    assert any("V_MC: K=3" in note for note in diagnosis.notes)
    assert not any("vineppo not run" in note for note in diagnosis.notes)
    assert set(METRICS) <= {s.metric for s in diagnosis.scores if s.estimator == "vineppo"}


def test_monte_carlo_values_leave_the_episode_and_its_truth_unchanged():
    """V_MC's rollouts draw from a stream of their own: the episode and its A^pi rollouts are
    the same with or without them, so VinePPO is not graded against its own samples."""
    env = registry.make("alfworld", max_steps=8)
    plain, valued = (play(env, EpsilonExpert(0.5), 3, np.random.default_rng(5), continuations=2,
                          vine_rollouts=k) for k in (0, 3))
    assert plain.actions == valued.actions and plain.mc_value is None
    np.testing.assert_array_equal(plain.advantage, valued.advantage)
    assert valued.mc_value.shape == (valued.length,) and np.isfinite(valued.mc_value).all()
    # Returns are sums of rewards in [0, 1] under the step limit.
    assert (valued.mc_value >= 0).all() and (valued.mc_value <= 1).all()


@pytest.mark.parametrize("env_name", ("webshop", "alfworld"))
def test_the_expert_has_zero_vineppo_advantage(env_name):
    """The deterministic expert's V_MC is its own return-to-go, so r_t + V(s_{t+1}) - V(s_t)
    is 0 at every step (before whitening, whose 0 / 0 is 0)."""
    env = registry.make(env_name)
    episodes = [play(env, EpsilonExpert(0.0), task, np.random.default_rng(task),
                     vine_rollouts=2) for task in range(2)]
    returns_to_go = [np.cumsum(e.rewards[::-1])[::-1] for e in episodes]
    for episode, expected in zip(episodes, returns_to_go):
        np.testing.assert_allclose(episode.mc_value, expected)
    stacked = stack(episodes)
    credit, failures = step_credit(["vineppo"], episodes, stacked,
                                   [np.zeros(e.length) for e in episodes], word_tokens(episodes))
    assert failures == {}
    np.testing.assert_allclose(credit["vineppo"], 0.0, atol=1e-6)
