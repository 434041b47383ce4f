"""The HotpotQA-style simulator: oracle, answer scoring, random baseline, splits,
determinism, errors."""

from __future__ import annotations

import pytest

from stepcredit.envs import hotpotqa
from stepcredit.envs.hotpotqa import (BAD_FORMAT, NO_MORE, NO_PAGE, HotpotQAEnv, f1_score,
                                      normalize_answer)
from tests.envs import sim_checks


@pytest.mark.parametrize("split", ["train", "test"])
def test_oracle_solves_200_random_tasks(split):
    sim_checks.oracle_solves_all(HotpotQAEnv, split)


def test_expert_is_the_oracle():
    sim_checks.expert_is_the_oracle(HotpotQAEnv)


def test_oracle_from_random_states():
    sim_checks.oracle_from_random_states(HotpotQAEnv, num_tasks=200, max_random_steps=6,
                                         skip=lambda a: a.startswith("finish["))


def test_answer_scoring_by_hand():
    assert normalize_answer("The  Port-Aldin!") == "portaldin"
    assert f1_score("port aldin", "Port Aldin") == 1.0
    assert f1_score("new port aldin", "port aldin") == pytest.approx(0.8)
    assert f1_score("yes", "no") == 0.0
    env = HotpotQAEnv()
    env.reset(0)
    result = env.step("finish[nobody knows]")
    assert result.done and result.reward == 0.0 and result.info["em"] == 0.0
    assert not result.info["won"] and result.info["f1"] == 0.0


def test_question_kinds_and_hops():
    kb = hotpotqa._kb(0)
    hops = {d: [len({k for k, _ in hotpotqa._question(0, "train", d, i).facts})
                for i in range(200)] for d in (1, 2)}
    assert set(hops[1]) == {2} and 3 in hops[2]
    texts = [hotpotqa._question(0, "train", 1, i).text for i in range(200)]
    assert any(" or " in t for t in texts) and any("director of" in t for t in texts)
    assert len(kb.entities) > 600


def test_search_lookup_and_not_found():
    env = HotpotQAEnv(difficulty=2)
    env.reset(0)
    assert env.step("lookup[born]").observation.text == NO_PAGE
    obs = env.step("search[nowhere land]").observation
    assert obs.text.startswith("Could not find that entity. Similar: [")
    film = hotpotqa._kb(0).films[0]
    obs = env.step(f"search[{film}]").observation
    assert obs.text.count(".") == 1  # one sentence at difficulty 2
    first = env.step("lookup[directed]").observation.text
    assert first.startswith("(Result 1 / 1) It was directed by ")
    assert env.step("lookup[directed]").observation.text == NO_MORE


def test_random_policy_success_is_low():
    env = HotpotQAEnv()
    rate = sim_checks.random_success_rate(env, 300)
    print(f"\nHotpotQA random admissible policy success: {rate:.3f}")
    assert rate < 0.2


def test_same_seed_same_episode_and_seed_changes_tasks():
    a = sim_checks.play_random(HotpotQAEnv(seed=1), 5, seed=2)
    b = sim_checks.play_random(HotpotQAEnv(seed=1), 5, seed=2)
    assert a == b and len(a) > 1
    assert [HotpotQAEnv(seed=0).reset(i).task for i in range(10)] != \
        [HotpotQAEnv(seed=1).reset(i).task for i in range(10)]


def test_splits_are_disjoint():
    train = {hotpotqa._question(0, "train", 1, i).text for i in range(400)}
    test = {hotpotqa._question(0, "test", 1, i).text for i in range(400)}
    assert len(test) > 250 and not train & test


def test_invalid_actions():
    env = HotpotQAEnv(max_steps=20)
    sim_checks.check_invalid_actions(env, 2, ["answer is 3", "lookup[born]", "think[hmm]",
                                              "search[]"], None)
    env.reset(2)
    assert env.step("answer").observation.text == BAD_FORMAT


def test_step_limit_truncates():
    sim_checks.check_step_limit(HotpotQAEnv, "search[nowhere]")


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match=r"task index -1 out of range \[0, 10000\) for split 'train'"):
        HotpotQAEnv().reset(-1)
    with pytest.raises(ValueError, match="max_steps"):
        HotpotQAEnv(max_steps=0)


def test_every_step_reports_the_question_kind():
    kinds = set()
    for difficulty, allowed in ((0, {*hotpotqa._BRIDGE, *hotpotqa._COMPARISON}),
                                (2, {*hotpotqa._BRIDGE, *hotpotqa._COMPARISON,
                                     *hotpotqa._THREE_HOP})):
        env = HotpotQAEnv(difficulty=difficulty)
        for i in range(40):
            env.reset(i)
            steps = [env.step("lookup[born]"), env.step("search[nobody]"),
                     env.step("finish[yes]")]
            reported = {s.info["task_type"] for s in steps}
            assert len(reported) == 1 and reported <= allowed
            kinds |= reported
    assert kinds & set(hotpotqa._BRIDGE) and kinds & set(hotpotqa._COMPARISON)
    assert kinds & set(hotpotqa._THREE_HOP)
