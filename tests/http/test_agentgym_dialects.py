"""HttpEnv against stand-ins for real AgentGym servers: both dialects' quirks,
retries, concurrency bounds and tolerant closing."""

from __future__ import annotations

import concurrent.futures
import logging
import time

import pytest

from fake_agentgym import FakeServer
from stepcredit.envs.agentgym_schema import SCHEMAS, ServerSchema, get_schema
from stepcredit.envs.http_client import (HttpConfig, HttpEnv, HttpEnvError, ServerConnection,
                                         shared_connection)
from stepcredit.envs.http_server import free_port

FAST = HttpConfig(timeout_s=1.0, connect_timeout_s=0.5, close_timeout_s=0.5, retries=2,
                  backoff_s=0.01, backoff_max_s=0.05)

ALFWORLD_ACTIONS = ["go to sink 1", "take mug 1 from table 1", "put mug 1 in/on sink 1"]


def alfworld_routes(seen: list) -> dict:
    def reset(body):
        seen.append(body)
        return 200, {"id": body["id"], "observation": "You are in a room. Your task is to: "
                     "put a mug in sink.", "available_actions": ALFWORLD_ACTIONS, "task_type": 1}

    def step(body):
        won = body["action"] == "put mug 1 in/on sink 1"
        text = ("You put the mug." if won else "Nothing happens."
                if body["action"] not in ALFWORLD_ACTIONS else "You pick up the mug 1.")
        return 200, {"observation": text, "reward": float(won),
                     "available_actions": ALFWORLD_ACTIONS, "done": won}

    return {"POST /create": lambda body: (200, {"id": 0}), "POST /reset": reset,
            "POST /step": step}


def test_alfworld_dialect():
    seen = []
    with FakeServer(alfworld_routes(seen)) as server:
        with HttpEnv(server.url, "alfworld", config=FAST) as env:
            assert (env.name, env.max_steps) == ("alfworld", 50)
            obs = env.reset(3)
            assert seen == [{"id": 0, "game": 3, "world_type": "Text"}]
            assert obs.admissible_actions == tuple(ALFWORLD_ACTIONS)
            assert obs.anchor == obs.text  # raw observation, no history
            invalid = env.step("fly")
            assert invalid.info["valid"] is False and invalid.info["error"] == "Nothing happens."
            assert env.step("take mug 1 from table 1").reward == 0.0
            final = env.step("put mug 1 in/on sink 1")
            assert final.done and final.reward == 1.0
            assert final.info == {"valid": True, "won": True, "score": 1.0, "error": ""}
        assert server.requests["/close"] == 1  # answered 404: ALFWorld's server has none


def test_webshop_dialect():
    def step(body):
        assert body["env_idx"] == 7731
        bought = body["action"] == "click[buy now]"
        return 200, {"state": "Thank you for shopping" if bought else "Results [SEP] B01",
                     "reward": 0.75 if bought else 0.0, "done": bought, "info": None}

    routes = {
        "POST /create": lambda body: (200, 7731),  # a bare, random int
        "POST /reset": lambda body: (200, ["WebShop [SEP] Search", None]),
        "GET /available_actions": lambda body: (
            200, {"has_search_bar": True, "clickables": ["search"]}),
        "GET /instruction_text": lambda body: (200, "i need a red mug under 30 dollars"),
        "POST /step": step,
    }
    with FakeServer(routes) as server, HttpEnv(server.url, "webshop", config=FAST) as env:
        obs = env.reset(5)
        assert obs.task == "i need a red mug under 30 dollars"
        assert obs.admissible_actions == ("search[<your query>]", "click[search]")
        result = env.step("search[red mug]")
        assert result.observation.text == "Results [SEP] B01" and not result.done
        final = env.step("click[buy now]")
        assert final.done and final.reward == 0.75
        assert final.info["score"] == 0.75 and final.info["won"] is False
        assert final.observation.admissible_actions is None  # no GET after done
        assert server.requests["/available_actions"] == 2


def test_sciworld_rewards_are_score_deltas():
    scores = iter([25, 25, 100])
    routes = {
        "POST /create": lambda body: (200, {"id": 4}),
        "POST /reset": lambda body: (200, {"observation": "You are in the kitchen.",
                                           "task_description": "boil water"}),
        "GET /task_description": lambda body: (200, "Your task is to boil water."),
        "POST /step": lambda body: (200, (lambda s: {"observation": "ok", "reward": 0,
                                                      "score": s, "done": s == 100})(
            next(scores))),
    }
    with FakeServer(routes) as server, HttpEnv(server.url, "sciworld", config=FAST) as env:
        assert env.reset(0).task == "Your task is to boil water."
        results = [env.step("look around") for _ in range(3)]
        assert [r.reward for r in results] == [0.25, 0.0, 0.75]
        assert results[-1].info["won"] and results[-1].info["score"] == 1.0
    assert server.requests["/close"] == 1


def test_503_is_retried_even_for_step_but_500_on_step_is_not():
    failures = {"/create": 2, "/step": 1}

    def flaky(path, payload):
        def route(body):
            if failures[path] > 0:
                failures[path] -= 1
                return 503, {"detail": "busy"}
            return 200, payload
        return route

    routes = {
        "POST /create": flaky("/create", {"id": 1}),
        "POST /reset": lambda body: (200, {"observation": "start"}),
        "POST /step": flaky("/step", {"observation": "ok", "reward": 0.0, "done": False}),
    }
    with FakeServer(routes) as server, HttpEnv(server.url, "babyai", config=FAST) as env:
        assert server.requests["/create"] == 3
        env.reset(0)
        assert env.step("craft").observation.text == "ok"
        assert server.requests["/step"] == 2
        routes["POST /step"] = lambda body: (500, {"detail": "boom"})
        fault = env.step("craft")
        # The server may have applied the action before failing: no retry.
        assert server.requests["/step"] == 3
        assert fault.truncated and "HTTP 500" in fault.info["error"]


def test_error_key_and_malformed_step_answers_end_the_episode():
    answers = iter([{"error": "The task is done."}, {"unexpected": 1}])
    routes = {
        "POST /create": lambda body: (200, {"id": 1}),
        "POST /reset": lambda body: (200, {"observation": "start"}),
        "POST /step": lambda body: (200, next(answers)),
    }
    with FakeServer(routes) as server, HttpEnv(server.url, "babyai", config=FAST) as env:
        env.reset(0)
        fault = env.step("go forward")
        assert fault.truncated and "The task is done." in fault.info["error"]
        assert server.requests["/step"] == 1  # an error answer is not retried
        env.reset(0)
        fault = env.step("go forward")
        assert fault.truncated and "cannot read" in fault.info["error"]


def test_refused_connection_raises_after_bounded_retries():
    start = time.monotonic()
    with pytest.raises(HttpEnvError, match="after 3 attempt"):
        HttpEnv(f"http://127.0.0.1:{free_port()}", "alfworld", config=FAST)
    assert time.monotonic() - start < 2


def test_concurrency_is_bounded_across_clients():
    def slow_create(body):
        time.sleep(0.1)
        return 200, {"id": 0}

    with FakeServer({"POST /create": slow_create}) as server:
        connection = ServerConnection(server.url, max_concurrency=2)
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            envs = list(pool.map(lambda _: HttpEnv(server.url, "alfworld", config=FAST,
                                                   connection=connection), range(6)))
        assert server.requests["/create"] == 6
        assert server.max_in_flight == 2
        connection.close()


def test_close_tolerates_a_missing_close_endpoint(caplog):
    routes = {"POST /create": lambda body: (200, {"id": 0})}
    with FakeServer(routes) as server, caplog.at_level(logging.WARNING):
        HttpEnv(server.url, "babyai", config=FAST).close()  # /close answers 404
        assert server.requests["/close"] == 1
    assert not caplog.records


def test_close_on_a_dead_server_logs_and_returns(caplog):
    with FakeServer({"POST /create": lambda body: (200, {"id": 0})}) as server:
        env = HttpEnv(server.url, "babyai", config=FAST)
    with caplog.at_level(logging.WARNING):
        env.close()
    assert "ConnectError" in caplog.text


def test_argument_errors_name_the_argument():
    with pytest.raises(ValueError, match="schema must be one of"):
        get_schema("nosuchenv")
    with pytest.raises(ValueError, match="family must be one of"):
        ServerSchema("x", "idx", "data_idx")
    with pytest.raises(ValueError, match="HttpConfig.retries"):
        HttpConfig(retries=-1)
    with pytest.raises(ValueError, match="max_steps"):
        HttpEnv("http://127.0.0.1:1", max_steps=0)
    shared_connection("http://127.0.0.1:9", 4)
    with pytest.raises(ValueError, match="max_concurrency=4"):
        shared_connection("http://127.0.0.1:9/", 8)


def test_every_documented_server_has_a_schema():
    assert {"alfworld", "babyai", "sciworld", "textcraft"} <= {
        n for n, s in SCHEMAS.items() if s.family == "id"}
    assert {"webshop", "sqlgym", "searchqa"} <= {
        n for n, s in SCHEMAS.items() if s.family == "env_idx"}


def test_a_renamed_instance_key():
    # AgentGym-RL's ports key instances by `env_id` and tasks by `task_id`.
    schema = ServerSchema("alfworld-rl", "id", "task_id", id_key="env_id",
                          actions_key="available_actions")
    seen = []
    routes = {
        "POST /create": lambda body: (200, {"env_id": 12}),
        "POST /reset": lambda body: (seen.append(body), (200, {"observation": "start"}))[1],
        "POST /step": lambda body: (seen.append(body), (
            200, {"observation": "end", "reward": 1.0, "done": True}))[1],
    }
    with FakeServer(routes) as server, HttpEnv(server.url, schema, config=FAST) as env:
        env.reset(7)
        assert env.step("look").info["won"]
    assert seen == [{"env_id": 12, "task_id": 7}, {"env_id": 12, "action": "look"}]
