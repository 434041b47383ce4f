"""The AgentGym server in-process (FastAPI's TestClient) and the `serve` subcommand."""

from __future__ import annotations

import argparse

import pytest
from fastapi.testclient import TestClient

from counter_env import CounterEnv
from stepcredit import serve
from stepcredit.envs.http_server import create_app, resolve_env_factory


@pytest.fixture(scope="module", params=["id", "env_idx"])
def client(request):
    app = create_app(lambda: CounterEnv(max_steps=3), dialect=request.param, max_envs=2)
    with TestClient(app) as test_client:
        test_client.dialect = request.param
        yield test_client


def _create(client) -> int:
    answer = client.post("/create").json()
    return answer["id"] if client.dialect == "id" else answer


def test_dialect_shapes(client):
    key = client.dialect
    idx = _create(client)
    reset = client.post("/reset", json={key: idx, "game": 2}).json()  # ALFWorld's task field
    step = client.post("/step", json={key: idx, "action": "inc"}).json()
    if key == "id":
        assert reset["observation"] == "The counter shows 0." and reset["id"] == idx
        assert step["observation"] == "The counter shows 1."
    else:
        assert reset[0] == "The counter shows 0." and reset[1]["anchor"] == ["counter", 0]
        assert step["state"] == "The counter shows 1."
    assert step["reward"] == 0.0 and step["done"] is False and step["info"]["valid"] is True
    assert client.get("/observation", params={key: idx}).json() == "The counter shows 1."
    assert client.get("/available_actions", params={key: idx}).json() == ["inc", "dec", "hang"]
    assert client.post("/close", json={key: idx}).json() is True
    assert client.get("/info").json() == {"name": "counter", "max_steps": 3, "dialect": key,
                                          "num_tasks": None}  # the counter has no task count


def test_truncation_sets_done_for_agentgym_clients(client):
    key = client.dialect
    idx = _create(client)
    client.post("/reset", json={key: idx, "data_idx": 5})
    answers = [client.post("/step", json={key: idx, "action": "dec"}).json() for _ in range(3)]
    assert [(a["done"], a["truncated"]) for a in answers] == [
        (False, False), (False, False), (True, True)]
    client.post("/close", json={key: idx})


@pytest.mark.parametrize("body, message", [
    ({"action": "inc"}, "names no environment: 'DIALECT' is missing"),
    ({"ID": "x", "action": "inc"}, "'DIALECT' must be an integer, got 'x'"),
    ({"ID": 99999, "action": "inc"}, "invalid id 99999"),
    ({"ID": "IDX", "action": 3}, "action must be a string"),
    ({"ID": "IDX", "action": "inc"}, "has not been reset"),
])
def test_errors_are_200_json(client, body, message):
    idx = _create(client)
    body = {(client.dialect if k == "ID" else k): (idx if v == "IDX" else v)
            for k, v in body.items()}
    response = client.post("/step", json=body)
    message = message.replace("DIALECT", client.dialect)
    assert response.status_code == 200 and message in response.json()["error"]
    client.post("/close", json={client.dialect: idx})


def test_step_after_done_bad_json_bad_task_and_capacity(client):
    key = client.dialect
    idx = _create(client)
    client.post("/reset", json={key: idx, "data_idx": 1})
    client.post("/step", json={key: idx, "action": "inc"})
    assert "is done" in client.post("/step", json={key: idx, "action": "inc"}).json()["error"]
    assert "not JSON" in client.post("/reset", content=b"{nope").json()["error"]
    assert "task under one of" in client.post("/reset", json={key: idx}).json()["error"]
    assert "ValueError" in client.post("/reset", json={key: idx, "task": 50}).json()["error"]
    other = _create(client)
    assert "max_envs=2" in client.post("/create").json()["error"]
    for i in (idx, other):
        client.post("/close", json={key: i})
    assert client.get("/stats").json()["envs"] == 0


def test_other_methods_and_paths_are_answered_as_fastapi_routes_would(client):
    # The protocol's endpoints are served in front of FastAPI (stepcredit.envs.http_asgi):
    # another method is still FastAPI's 405 naming the allowed one, an unknown path its 404.
    for method, path, allowed in (("GET", "/step", "POST"), ("POST", "/observation", "GET"),
                                  ("DELETE", "/create", "POST")):
        answer = client.request(method, path)
        assert answer.status_code == 405 and answer.json() == {"detail": "Method Not Allowed"}
        assert answer.headers["allow"] == allowed and "x-stepcredit-boot" in answer.headers
    missing = client.post("/steps", json={})
    assert missing.status_code == 404 and missing.json() == {"detail": "Not Found"}
    assert client.get("/stats").json()["requests"]["/steps"] == 1


def test_create_app_checks_its_arguments():
    with pytest.raises(ValueError, match="dialect must be one of"):
        create_app(CounterEnv, dialect="idx")
    with pytest.raises(ValueError, match="max_envs"):
        create_app(CounterEnv, max_envs=0)
    with pytest.raises(ValueError, match="cannot import"):
        resolve_env_factory("no_such_module:Env")


def test_serve_subcommand_interface(capsys):
    assert isinstance(serve.HELP, str) and "\n" not in serve.HELP
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    args = parser.parse_args(["--env", "counter_env:CounterEnv"])
    assert (args.host, args.port, args.dialect) == ("127.0.0.1", 8000, "id")
    bad = parser.parse_args(["--env", "counter_env:CounterEnv", "--env-kwargs", "[1]"])
    assert serve.run(bad) == 2
    assert serve.run(parser.parse_args(["--env", "nope:Env"])) == 2
    assert "bad --env/--env-kwargs" in capsys.readouterr().err
    unknown = parser.parse_args(["--env", "webshop", "--env-kwargs", '{"bogus": 1}'])
    assert serve.run(unknown) == 2  # before it says where it serves, in one line
    captured = capsys.readouterr()
    assert not captured.out and captured.err.count("\n") == 1 and "bogus" in captured.err
    with pytest.raises(SystemExit):
        parser.parse_args(["--env", "webshop", "--port", "70000"])
    assert "must be <= 65535, got 70000" in capsys.readouterr().err
