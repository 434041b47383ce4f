"""`stepcredit diagnose`: sanity by construction on the embedded simulators."""

import json

import numpy as np
import pytest

from stepcredit import advantages as adv
from stepcredit.cli import main
from stepcredit.diagnose import metrics, report
from stepcredit.diagnose.config import DiagnoseConfig
from stepcredit.diagnose.episodes import stack
from stepcredit.diagnose.estimates import step_credit, word_tokens
from stepcredit.diagnose.policies import EpsilonExpert, SingleDeviation, parse_policy, wrong_actions
from stepcredit.diagnose.run import diagnose
from stepcredit.diagnose.sample import monte_carlo_advantage, play, sample_episodes
from stepcredit.diagnose.values import ValueTable, returns_to_go
from stepcredit.envs import registry

SIMULATORS = ("webshop", "alfworld", "hotpotqa")
# Estimators without a fitted model (iStar's and PRIME's PRM, SPA's progress estimator).
NO_PRM = tuple(n for n in adv.names()
               if not (adv.get(n).needs_prm or adv.get(n).needs_progress))


@pytest.fixture(scope="module")
def noisy_expert():
    """Every PRM-free estimator on an eps = 0.3 expert, all three simulators."""
    return diagnose(DiagnoseConfig(tasks=4, group_size=8, seeds=(0,), continuations=16,
                                   estimators=NO_PRM, bootstrap=50), progress=False)


@pytest.mark.parametrize("env_name", SIMULATORS)
def test_monte_carlo_advantage_has_the_best_auc(noisy_expert, env_name):
    truth = noisy_expert.score(env_name, "mc_advantage", "auc").estimate
    others = {n: noisy_expert.score(env_name, n, "auc").estimate for n in NO_PRM}
    assert truth > max(others.values()), others


@pytest.mark.parametrize("env_name", SIMULATORS)
def test_random_credit_scores_about_one_half(noisy_expert, env_name):
    score = noisy_expert.score(env_name, "random", "auc")
    assert abs(score.estimate - 0.5) < 0.1 and score.n > 100
    assert score.low < score.estimate < score.high


def test_grpo_collateral_blame_is_its_broadcast():
    """GRPO gives every step its trajectory's advantage: all good steps of a failed
    trajectory are blamed when its group holds a success, none in an all-failed group."""
    env = registry.make("alfworld", max_steps=12)
    episodes = sample_episodes(env, EpsilonExpert(0.5), list(range(12)), group_size=6, seed=0,
                               continuations=0)
    stacked = stack(episodes)
    credit, failures = step_credit(["grpo"], episodes, stacked,
                                   [np.zeros(e.length) for e in episodes], word_tokens(episodes))
    credit = credit["grpo"]
    assert failures == {}
    group_won = np.zeros(stacked.group_ids.max() + 1, bool)
    np.logical_or.at(group_won, stacked.group_ids, stacked.won)
    mixed = group_won[stacked.group_ids]
    failed = ~stacked.won
    assert (failed & mixed).any() and (failed & ~mixed).any()
    blame = [metrics.collateral_blame(credit, stacked.good, stacked.mask, failed & subset).value
             for subset in (mixed, ~mixed)]
    assert blame == [1.0, 0.0]


@pytest.mark.parametrize("env_name", SIMULATORS)
def test_ground_truth_changes_nothing_in_the_episode(env_name):
    env = registry.make(env_name)
    plain, graded = (play(env, EpsilonExpert(0.5), 3, np.random.default_rng(5), continuations=k)
                     for k in (0, 4))
    assert plain.actions == graded.actions and plain.observations == graded.observations
    np.testing.assert_array_equal(plain.rewards, graded.rewards)
    assert np.isnan(plain.advantage).all() and np.isfinite(graded.advantage).all()


@pytest.mark.parametrize("env_name", SIMULATORS)
def test_the_expert_makes_only_progress_and_has_zero_advantage(env_name):
    env = registry.make(env_name)
    episode = play(env, EpsilonExpert(0.0), 1, np.random.default_rng(0), continuations=3)
    assert episode.won and episode.good.all() and episode.distance_after[-1] == 0
    np.testing.assert_array_equal(np.diff(episode.distance_before), -1)
    np.testing.assert_array_equal(episode.advantage, 0.0)
    np.testing.assert_array_equal(episode.entropy, 0.0)


@pytest.mark.parametrize("env_name", SIMULATORS)
def test_single_deviation_has_exactly_one_bad_step_where_told(env_name):
    env = registry.make(env_name)
    for task in range(4):
        episode = play(env, SingleDeviation(1), task, np.random.default_rng(task), continuations=2)
        assert not episode.good[1] and episode.deviation == 1
        assert episode.good[:1].all()
        # The expert's step before the mistake is the only action the policy takes there.
        assert episode.advantage[0] == 0.0 and episode.entropy[0] == 0.0 < episode.entropy[1]
        # After the mistake the expert plays on deterministically, so A^pi of the mistake is
        # its exact cost against the expert's action: Q(wrong) - Q(expert) <= 0, no error.
        assert episode.advantage[1] <= 0 and episode.advantage_se[1] == 0
        assert episode.advantage[1] == -1.0 or episode.won


def test_monte_carlo_advantage_matches_independent_rollouts():
    """The paired (common random numbers) estimate agrees with plain independent Q and V
    rollouts from a snapshot, within their standard errors."""
    env = registry.make("hotpotqa")
    policy = EpsilonExpert(0.5)
    obs = env.reset(2)
    actions, probs = policy.distribution(env, obs, (), 0, -1)
    wrong = wrong_actions(env, actions)[0]  # a wrong final answer
    paired, paired_se = monte_carlo_advantage(env, policy, obs, [], -1, wrong, 400,
                                              np.random.default_rng(0))
    rng, snapshot = np.random.default_rng(1), env.snapshot()

    def rollout(first):
        total, action, observation = 0.0, first, obs
        while True:
            result = env.step(action)
            total += result.reward
            if not env.running:
                env.restore(snapshot)
                return total
            observation = result.observation
            options, p = policy.distribution(env, observation, (), env.steps_taken, -1)
            action = options[rng.choice(len(options), p=p)]

    q = np.array([rollout(wrong) for _ in range(800)])
    v = np.array([rollout(actions[rng.choice(len(actions), p=probs)]) for _ in range(800)])
    independent = q.mean() - v.mean()
    se = np.hypot(q.std() / np.sqrt(len(q)), v.std() / np.sqrt(len(v)))
    assert independent < -0.05 and paired_se > 0  # a wrong answer costs what V(s_0) expects
    assert abs(paired - independent) < 4 * np.hypot(se, paired_se)
    assert env.snapshot().state == snapshot.state


def test_without_continuations_the_truth_rows_are_left_out():
    diagnosis = diagnose(DiagnoseConfig(envs=("hotpotqa",), estimators=("grpo",), tasks=2,
                                        group_size=4, seeds=(0,), continuations=0, bootstrap=5),
                         progress=False)
    assert "mc_advantage" not in diagnosis.estimators
    assert np.isnan(diagnosis.score("hotpotqa", "grpo", "spearman").estimate)
    assert diagnosis.score("hotpotqa", "grpo", "auc").n > 0
    assert "no Monte Carlo A^pi (K=0)" in diagnosis.notes[0]
    with pytest.raises(ValueError, match="continuations must be 0"):
        DiagnoseConfig(continuations=1)


def test_wrong_actions_leave_the_environment_as_it_was():
    env = registry.make("webshop")
    obs = env.reset(0)
    before = env.snapshot()
    wrong = wrong_actions(env, obs.admissible_actions)
    assert env.oracle_actions()[0] not in wrong
    assert len(wrong) == len(obs.admissible_actions) - 1
    assert env.snapshot().state == before.state


def test_policy_distributions_and_entropy():
    env = registry.make("alfworld")
    obs = env.reset(0)
    actions, probs = EpsilonExpert(0.3).distribution(env, obs, (), 0, -1)
    assert probs.sum() == pytest.approx(1.0) and len(actions) == len(set(actions))
    assert probs[actions.index(env.oracle_actions()[0])] == pytest.approx(0.7 + 0.3 / len(actions))
    assert parse_policy("uniform").label == "uniform"
    assert parse_policy("deviation@3") == SingleDeviation(3)
    with pytest.raises(ValueError, match="--policy 'greedy'"):
        parse_policy("greedy")
    with pytest.raises(ValueError, match="eps must be in"):
        parse_policy("eps=2")


def test_value_table_is_the_mean_return_to_go():
    env = registry.make("hotpotqa")
    episodes = sample_episodes(env, EpsilonExpert(0.5), [0, 1], group_size=4, seed=0,
                               continuations=0)
    table = ValueTable(episodes)
    first = episodes[0]
    starts = [returns_to_go(e.rewards)[0] for e in episodes if e.task == first.task]
    assert table(first)[0] == pytest.approx(np.mean(starts))
    np.testing.assert_array_equal(returns_to_go(np.array([0.0, 1.0, 0.5])), [1.5, 1.5, 0.5])


def test_config_refuses_bad_settings():
    with pytest.raises(ValueError, match="unknown estimators \\['nope'\\]"):
        DiagnoseConfig(estimators=("nope",))
    with pytest.raises(ValueError, match="tasks must be >= 1"):
        DiagnoseConfig(tasks=0)
    with pytest.raises(ValueError, match="values 'critic'"):
        DiagnoseConfig(values="critic")
    with pytest.raises(ValueError, match="estimators='gigpo'; it must be a tuple of strs"):
        DiagnoseConfig(estimators="gigpo")
    with pytest.raises(ValueError, match="seeds=3; it must be a tuple of ints"):
        DiagnoseConfig(seeds=3)
    with pytest.raises(ValueError, match="tasks=2.5; it must be an int"):
        DiagnoseConfig(tasks=2.5)


class _Blind:
    """An environment without an oracle or snapshots, like TextWorld or an HTTP server."""

    name, max_steps = "blind", 5

    def __init__(self, **config):
        pass

    def close(self):
        pass


def test_an_environment_without_oracle_or_snapshots_is_refused():
    registry.register("blind", _Blind)
    try:
        with pytest.raises(ValueError, match="'blind' cannot be diagnosed"):
            diagnose(DiagnoseConfig(envs=("blind",), estimators=("grpo",)), progress=False)
    finally:
        registry.unregister("blind")


def test_command_writes_the_report(tmp_path, capsys):
    out = tmp_path / "diag"
    status = main(["diagnose", "--env", "hotpotqa", "--tasks", "2", "--group-size", "4",
                   "--seeds", "2", "--continuations", "2", "--estimators", "grpo,gigpo",
                   "--bootstrap", "10", "--output", str(out), "--no-progress"])
    assert status == 0
    printed = capsys.readouterr().out
    assert "| gigpo |" in printed and "| mc_advantage |" in printed
    assert {p.name for p in out.iterdir()} >= {"diagnose.md", "diagnose.csv", "diagnose.json",
                                               "auc.png", "examples.png"}
    loaded = report.load_json(out)
    assert loaded.settings["seeds"] == [0, 1]
    assert len(loaded.score("hotpotqa", "gigpo", "auc").per_seed) == 2
    assert json.loads((out / "diagnose.json").read_text())["settings"]["estimators"] == ["grpo",
                                                                                          "gigpo"]


def test_command_reports_a_bad_policy_in_one_line(capsys):
    assert main(["diagnose", "--policy", "greedy", "--output", "/nonexistent"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--policy 'greedy'" in err[0]


def _refuses(scores, group_ids):
    raise ValueError("refuses these episodes")


def test_an_estimator_that_fails_is_noted_and_the_others_graded():
    entry = adv.register(adv.Estimator(name="refuser", fn=_refuses, reads=("scores", "group_ids"),
                                       defaults={}, paper="none", output_level="trajectory"))
    try:
        diagnosis = diagnose(DiagnoseConfig(envs=("hotpotqa",), estimators=(entry.name, "grpo"),
                                            tasks=2, group_size=2, seeds=(0,), continuations=2,
                                            bootstrap=5), progress=False)
    finally:
        adv.unregister(entry.name)
    assert "refuser" not in diagnosis.estimators and "grpo" in diagnosis.estimators
    assert any("refuser not run: refuses these episodes" in note for note in diagnosis.notes)
