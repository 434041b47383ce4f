"""The ALFWorld-style simulator: oracle, searching expert, random baseline, splits,
determinism, errors."""

from __future__ import annotations

import collections
import copy
import random

import pytest

from stepcredit.envs import alfworld
from stepcredit.envs.alfworld import NOTHING_HAPPENS, TASK_TYPES, AlfWorldEnv
from tests.envs import sim_checks


@pytest.mark.parametrize("split", ["train", "seen", "unseen"])
def test_oracle_solves_200_random_tasks(split):
    sim_checks.oracle_solves_all(AlfWorldEnv, split)


def test_oracle_from_random_states():
    sim_checks.oracle_from_random_states(AlfWorldEnv, num_tasks=150, max_random_steps=15,
                                         skip=lambda a: False)


def test_oracle_is_shortest_by_breadth_first_search():
    """Exhaustive search over admissible actions finds no shorter solution than
    the oracle, on small rooms from the start state."""
    checked = 0
    for task in range(40):
        env = AlfWorldEnv(difficulty=0, max_steps=1000)
        env.reset(task)
        distance = env.oracle_distance()
        if distance > 5:
            continue
        checked += 1
        history: list[str] = []
        frontier, seen = [history], {env._obs.anchor}
        found = None
        for depth in range(1, distance + 1):
            next_frontier = []
            for prefix in frontier:
                obs = _replay(env, task, prefix)
                for action in obs.admissible_actions:
                    _replay(env, task, prefix)
                    result = env.step(action)
                    if result.done:
                        found = depth
                        break
                    if result.observation.anchor not in seen:
                        seen.add(result.observation.anchor)
                        next_frontier.append(prefix + [action])
                if found:
                    break
            if found:
                break
            frontier = next_frontier
        assert found == distance, (task, found, distance)
    assert checked >= 10


def _replay(env, task, actions):
    obs = env.reset(task)
    for action in actions:
        obs = env.step(action).observation
    return obs


def play_expert(env: AlfWorldEnv, before_each_step=lambda env: None) -> tuple[int, bool]:
    """Plays `expert_action()` from the current state to the end, checking that
    every action is admissible and valid; returns (steps taken, won)."""
    obs = env._obs
    while True:
        before_each_step(env)
        action = env.expert_action()
        assert action in obs.admissible_actions, (action, obs.admissible_actions)
        result = env.step(action)
        assert result.info["valid"], action
        obs = result.observation
        if result.done or result.truncated:
            return env.steps_taken, result.done


@pytest.mark.parametrize("difficulty", [0, 1, 2])
def test_searching_expert_solves_every_task_no_faster_than_the_oracle(difficulty):
    env = AlfWorldEnv(difficulty=difficulty, max_steps=60)
    extra = []
    for task in range(0, 600, 5):
        env.reset(task)
        distance = env.oracle_distance()
        steps, won = play_expert(env)
        assert won and steps >= distance, (task, steps, distance)
        extra.append(steps - distance)
    # It searches, so it is sometimes longer than the oracle, but not by much.
    assert 0 < sum(extra) / len(extra) <= 2 + 2.5 * difficulty, extra


def relocate_unseen_objects(env: AlfWorldEnv, rng: random.Random) -> AlfWorldEnv:
    """A copy of `env` in which every object the agent has not seen lies in
    another unseen receptacle that a target may start in (not a goal)."""
    moved = copy.deepcopy(env)
    moved._plan_cache = ("", ())  # keyed by the anchor, which the move leaves stale
    room = moved._task.room
    hidden = [r for r in room.starts if r not in moved._seen and room.types[r] != moved._task.goal]
    for o, r in enumerate(moved._pos):
        if r >= 0 and r not in moved._seen and len(hidden) > 1:
            moved._contents[r].remove(o)
            moved._pos[o] = rng.choice([h for h in hidden if h != r])
            moved._contents[moved._pos[o]].append(o)
    return moved


def test_searching_expert_ignores_what_the_agent_has_not_seen():
    """Moving unseen objects around changes the oracle's next action but never
    the expert's: the expert's choices follow from the observations."""
    rng = random.Random(0)
    oracle_changed = states = 0

    def compare(env):
        nonlocal oracle_changed, states
        moved = relocate_unseen_objects(env, rng)
        assert moved.expert_action() == env.expert_action()
        oracle_changed += moved.oracle_actions()[0] != env.oracle_actions()[0]
        states += 1

    env = AlfWorldEnv(difficulty=1, max_steps=60)
    for task in range(40):
        env.reset(task)
        assert play_expert(env, before_each_step=compare)[1]
    assert oracle_changed > states // 10, (oracle_changed, states)


def test_random_policy_success_is_low():
    env = AlfWorldEnv()
    rate = sim_checks.random_success_rate(env, 200)
    print(f"\nALFWorld random admissible policy success: {rate:.3f}")
    assert rate < 0.25


def test_same_seed_same_episode_and_seed_changes_tasks():
    a = sim_checks.play_random(AlfWorldEnv(seed=3), 17, seed=5)
    b = sim_checks.play_random(AlfWorldEnv(seed=3), 17, seed=5)
    assert a == b and len(a) > 1
    tasks_0 = [AlfWorldEnv(seed=0).reset(i) for i in range(20)]
    tasks_1 = [AlfWorldEnv(seed=1).reset(i) for i in range(20)]
    assert [o.text for o in tasks_0] != [o.text for o in tasks_1]


def test_splits_are_disjoint_and_unseen_layouts_are_new():
    keys = {}
    layouts = {}
    for split in ("train", "seen", "unseen"):
        tasks = [alfworld._task(0, split, 1, TASK_TYPES, i) for i in range(300)]
        keys[split] = {t.key for t in tasks}
        layouts[split] = {t.room.layout for t in tasks}
    assert not keys["train"] & keys["seen"]
    assert not keys["train"] & keys["unseen"]
    assert layouts["seen"] <= layouts["train"]
    assert not layouts["unseen"] & layouts["train"]


def test_all_task_types_and_info():
    env = AlfWorldEnv()
    seen = collections.Counter()
    for i in range(12):
        env.reset(i)
        result = env.step("look")
        seen[result.info["task_type"]] += 1
        assert result.info["valid"] and result.reward == 0.0
    assert set(seen) == set(TASK_TYPES)
    only = AlfWorldEnv(task_types=("pick_two_obj",))
    assert {only.reset(i) and only.step("look").info["task_type"] for i in range(5)} == \
        {"pick_two_obj"}


def test_difficulty_grows_rooms():
    sizes = [sum(len(AlfWorldEnv(difficulty=d).reset(i).admissible_actions) for i in range(30))
             for d in range(3)]
    assert sizes[0] < sizes[1] < sizes[2]


def test_invalid_actions_answer_nothing_happens():
    env = AlfWorldEnv()
    sim_checks.check_invalid_actions(
        env, 4, ["dance", "", "go to moon 1", "take apple 9 from fridge 1", "open sofa 1",
                 "put", "use desklamp 1"], NOTHING_HAPPENS)


def test_spaced_out_commands_are_understood():
    env = AlfWorldEnv()
    obs = env.reset(0)
    action = obs.admissible_actions[0]  # a "go to X" command
    result = env.step(action.replace(" ", "  ").upper())
    assert result.info["valid"]
    env.reset(0)
    plan = env.oracle_actions()
    for action in plan:
        result = env.step(action.replace("/", " / "))
    assert result.info["won"]


def test_step_limit_truncates():
    sim_checks.check_step_limit(AlfWorldEnv, "dance")


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match=r"task index 5000 out of range \[0, 1000\) for split 'seen'"):
        AlfWorldEnv(split="seen").reset(5000)
    with pytest.raises(ValueError, match="split 'test'"):
        AlfWorldEnv(split="test")
    with pytest.raises(ValueError, match="difficulty 3"):
        AlfWorldEnv(difficulty=3)
    with pytest.raises(ValueError, match="task_types"):
        AlfWorldEnv(task_types=("cook",))
    with pytest.raises(RuntimeError, match="not running"):
        AlfWorldEnv().step("look")
