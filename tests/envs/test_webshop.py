"""The WebShop-style simulator: oracle, reward formula, random baseline, splits,
determinism, errors."""

from __future__ import annotations

import pytest

from stepcredit.envs import webshop
from stepcredit.envs.webshop import (BAD_FORMAT, NO_BUTTON, NO_SEARCH_BAR, NUM_PRODUCTS,
                                     WebShopEnv)
from tests.envs import sim_checks


@pytest.mark.parametrize("split", ["train", "test"])
def test_oracle_solves_200_random_tasks(split):
    sim_checks.oracle_solves_all(WebShopEnv, split)


def test_expert_is_the_oracle():
    sim_checks.expert_is_the_oracle(WebShopEnv)


def test_oracle_from_random_states():
    sim_checks.oracle_from_random_states(WebShopEnv, num_tasks=200, max_random_steps=8,
                                         skip=lambda a: a == "click[buy now]")


def test_catalogue_size_and_categories():
    catalogue = webshop._catalogue(0)
    assert len(catalogue.products) == NUM_PRODUCTS >= 1000
    assert len({p.category for p in catalogue.products}) == 5
    assert all(p.attributes and p.options for p in catalogue.products)


def test_reward_formula_by_hand():
    """r = r_type * (|U_att & Y_att| + |U_opt & Y_opt| + 1[price ok]) / (|U_att| + |U_opt| + 1)."""
    goal = webshop._Goal("", "fashion", "t-shirt", frozenset({"cotton", "slim fit"}),
                         (("size", "large"), ("color", "black")), 3000, frozenset(), "", ())
    shirt = webshop._Product("b0001", "fashion", "t-shirt", "", frozenset({"cotton"}),
                             (("size", ("large",)), ("color", ("black", "red"))), 2599, "$25.99")
    # 1 attribute of 2, 1 option of 2, price ok: 3 / 5.
    assert webshop.reward(goal, shirt, {"size": "large", "color": "red"}) == pytest.approx(0.6)
    hoodie = dataclasses_replace(shirt, ptype="hoodie", cents=3500)
    # Same category, other type: r_type 0.5; 1 + 2 + 0 of 5.
    assert webshop.reward(goal, hoodie, {"size": "large", "color": "black"}) == pytest.approx(0.3)
    mug = dataclasses_replace(shirt, category="home", ptype="mug", attributes=frozenset())
    assert webshop.reward(goal, mug, {}) == pytest.approx(0.1 * 1 / 5)


def dataclasses_replace(obj, **changes):
    import dataclasses

    return dataclasses.replace(obj, **changes)


def test_partial_purchase_scores_below_one():
    env = WebShopEnv(difficulty=2)
    env.reset(3)
    plan = env.oracle_actions()
    # Skip the option clicks: the purchase misses two options.
    result = None
    for action in plan[:2] + plan[-1:]:
        result = env.step(action)
    assert result.done and not result.info["won"]
    assert result.reward == result.info["score"] == pytest.approx(4 / 6)


def test_instruction_style_and_search_of_whole_instruction():
    env = WebShopEnv(difficulty=2)
    obs = env.reset(11)
    assert obs.task.startswith("i ") and "price lower than" in obs.task and obs.task.endswith(
        ".00 dollars")
    # Searching the whole instruction ranks like the goal's keyword query.
    by_instruction = env.step(f"search[{obs.task}]").observation.text
    env.reset(11)
    assert env.step(env.oracle_actions()[0]).observation.text == by_instruction


def test_results_pages_navigation():
    env = WebShopEnv()
    env.reset(0)
    page1 = env.step("search[t-shirt]").observation
    assert "click[next >]" in page1.admissible_actions
    assert "click[< prev]" not in page1.admissible_actions
    page2 = env.step("click[next >]").observation
    assert "Page 2 (Total results: " in page2.text
    back = env.step("click[< prev]").observation
    assert back.text == page1.text and back.anchor == page1.anchor
    item = env.step(page1.admissible_actions[-1]).observation
    assert "click[buy now]" in item.admissible_actions
    assert env.step("click[< prev]").observation.anchor == page1.anchor
    assert env.step("click [ back to search ]").observation.anchor == "search"


def test_random_policy_success_is_low():
    env = WebShopEnv()
    rate = sim_checks.random_success_rate(env, 300)
    print(f"\nWebShop random admissible policy success: {rate:.3f}")
    assert rate < 0.05


def test_same_seed_same_episode_and_seed_changes_tasks():
    a = sim_checks.play_random(WebShopEnv(seed=2), 9, seed=4)
    b = sim_checks.play_random(WebShopEnv(seed=2), 9, seed=4)
    assert a == b and len(a) > 1
    assert [WebShopEnv(seed=0).reset(i).task for i in range(10)] != \
        [WebShopEnv(seed=1).reset(i).task for i in range(10)]


def test_splits_are_disjoint():
    train = {webshop._goal(0, "train", 1, i).instruction for i in range(400)}
    test = {webshop._goal(0, "test", 1, i).instruction for i in range(400)}
    assert len(test) > 300 and not train & test


def test_invalid_actions():
    env = WebShopEnv()
    sim_checks.check_invalid_actions(env, 1, ["buy it", "click[next >]", "jump[now]"], None)
    env.reset(1)
    assert env.step("click[buy now]").observation.text == NO_BUTTON
    assert env.step("hello").observation.text == BAD_FORMAT
    env.step("search[red]")
    assert env.step("search[blue]").observation.text == NO_SEARCH_BAR


def test_step_limit_truncates():
    sim_checks.check_step_limit(WebShopEnv, "click[nothing]")


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match=r"task index 5000 out of range \[0, 1000\) for split 'test'"):
        WebShopEnv(split="test").reset(5000)
    with pytest.raises(TypeError, match="integer index"):
        WebShopEnv().reset("task 1")
