"""`--env` specs: simulators by name, environments served over HTTP, TextWorld games by pattern."""

import pytest

from stepcredit.envs import registry, specs
from stepcredit.envs.http_server import create_app
from stepcredit.train.evaluate import test_split as held_out_split
from tests.http.counter_env import CounterEnv
from tests.http.live_server import LiveServer


def test_a_registered_name_is_the_simulator_with_the_run_settings():
    env = specs.make("hotpotqa", split="test", seed=3, max_steps=4)
    assert specs.kind("hotpotqa") == "registered" and env.name == "hotpotqa" and env.max_steps == 4
    assert env.reset(0) == registry.make("hotpotqa", split="test", difficulty=0, seed=3, max_steps=4).reset(0)


def test_a_stepcredit_server_reports_its_tasks_and_plays_as_the_simulator():
    local = registry.make("hotpotqa")
    with LiveServer(create_app(lambda: registry.make("hotpotqa"))) as server:
        env = specs.make(server.url, max_steps=3)
        assert specs.kind(server.url) == "served"
        assert (env.num_tasks, env.splits, env.max_steps) == (local.num_tasks, ("train",), 3)
        assert held_out_split(env) == "train"  # one split: evaluation plays training tasks
        assert env.reset(2) == local.reset(2)
        env.close()
        fewer = specs.make(f"{server.url}?tasks=5")
        assert fewer.num_tasks == 5 and fewer.schema.name == "stepcredit"  # the rest passes through
        fewer.close()
        with pytest.raises(ValueError, match=f"tasks={local.num_tasks + 1}, but the server has"):
            specs.make(f"{server.url}?tasks={local.num_tasks + 1}")
        with pytest.raises(ValueError, match="has one split, 'train'; split='test'"):
            specs.make(server.url, split="test")


@pytest.mark.parametrize("query, message", [
    ("?tasks=0", "tasks='0'; it must be a positive integer"),
    ("?task=5", r"unknown query key\(s\) \['task'\]; expected schema, tasks"),
    ("?tasks", "malformed query"),
])
def test_a_bad_query_is_one_line_naming_it(query, message):
    with pytest.raises(ValueError, match=message):
        specs.make(f"http://127.0.0.1:9{query}")


def test_a_server_without_a_task_count_needs_one_named():
    with LiveServer(create_app(CounterEnv)) as server:
        with pytest.raises(ValueError, match=r"does not report its task count; name it, e.g. \?tasks=100"):
            specs.make(server.url)
        env = specs.make(f"{server.url}?tasks=2")
        assert env.num_tasks == 2 and env.name == "counter"
        env.close()


def test_unknown_specs_and_empty_patterns_are_refused():
    with pytest.raises(ValueError, match="unknown environment 'nosuch'; registered: .*hotpotqa"):
        specs.make("nosuch")
    with pytest.raises(ValueError, match="the pattern matches no game file"):
        specs.make("textworld:/no/such/dir/*.z8")
