"""Server hardening: idle instances expire, bodies and actions are size-limited,
slow requests are cut off, error messages stay short, and only server faults
log a traceback."""

from __future__ import annotations

import argparse
import logging
import socket
import time

import httpx
import pytest
from fastapi.testclient import TestClient

from counter_env import CounterEnv
from stepcredit import serve
from live_server import LiveServer
from stepcredit.envs.http_server import create_app

LOGGER = "stepcredit.envs.http_server"


class CrashingEnv(CounterEnv):
    """A counter whose "crash" action is a bug in the environment."""

    def step(self, action):
        if action == "crash":
            raise RuntimeError("the simulator lost its state")
        return super().step(action)


def test_idle_instances_expire_and_free_their_slot():
    app = create_app(CounterEnv, max_envs=1, idle_timeout_s=0.3)
    with TestClient(app) as client:
        idx = client.post("/create").json()["id"]
        client.post("/reset", json={"id": idx, "data_idx": 2})
        assert "max_envs=1" in client.post("/create").json()["error"]
        for _ in range(3):  # in use: requests keep it alive past the timeout
            time.sleep(0.15)
            assert client.get("/observation", params={"id": idx}).status_code == 200
        time.sleep(0.45)
        answer = client.post("/step", json={"id": idx, "action": "inc"}).json()
        assert f"environment {idx} expired" in answer["error"]
        assert "idle_timeout_s=0.3" in answer["error"]
        assert client.get("/stats").json()["envs"] == 0
        assert isinstance(client.post("/create").json()["id"], int)  # the slot is free


def test_expiry_can_be_turned_off():
    with TestClient(create_app(CounterEnv, idle_timeout_s=0)) as client:
        idx = client.post("/create").json()["id"]
        time.sleep(0.1)
        assert client.post("/reset", json={"id": idx, "data_idx": 1}).json()["id"] == idx


def test_bodies_and_actions_are_size_limited():
    app = create_app(CounterEnv, max_body_bytes=1000, max_action_chars=50)
    with TestClient(app) as client:
        idx = client.post("/create").json()["id"]
        client.post("/reset", json={"id": idx, "data_idx": 3})
        big = client.post("/step", json={"id": idx, "action": "i" * 2000})
        assert big.status_code == 413
        assert "max_body_bytes=1000" in big.json()["error"] and "2" in big.json()["error"]

        def chunks():  # no Content-Length: the limit holds while reading
            for _ in range(30):
                yield b" " * 100
        streamed = client.post("/step", content=chunks(),
                               headers={"Content-Type": "application/json"})
        assert streamed.status_code == 413 and "max_body_bytes=1000" in streamed.json()["error"]
        long = client.post("/step", json={"id": idx, "action": "i" * 51}).json()
        assert long["error"] == "action is 51 characters; the limit is max_action_chars=50"
        # Nothing was applied: the counter has not moved.
        assert client.get("/observation", params={"id": idx}).json() == "The counter shows 0."
    with TestClient(create_app(CounterEnv)) as client:  # the default limit: 1 MiB
        answer = client.post("/step", content=b" " * (2 << 20))
        assert answer.status_code == 413 and "max_body_bytes=1048576" in answer.json()["error"]


def test_error_messages_quote_a_short_prefix_of_bad_values():
    with TestClient(create_app(CounterEnv)) as client:
        idx = client.post("/create").json()["id"]
        for body in ({"id": "x" * 100_000, "action": "inc"},
                     {"id": idx, "action": ["x" * 100_000]},
                     {"id": idx, "task": "x" * 100_000}):
            path = "/reset" if "task" in body else "/step"
            error = client.post(path, json=body).json()["error"]
            assert len(error) < 300 and "xxxxxxxxxx" in error, error
        error = client.post("/reset", content=b"[" + b"1," * 100_000 + b"1]").json()["error"]
        assert len(error) < 300 and "JSON object" in error


def test_client_mistakes_log_one_line_and_server_faults_a_traceback(caplog):
    with TestClient(create_app(CrashingEnv)) as client, caplog.at_level(logging.INFO, LOGGER):
        idx = client.post("/create").json()["id"]
        assert "ValueError" in client.post("/reset", json={"id": idx, "task": 50}).json()["error"]
        unknown = client.post("/step", json={"id": -1, "action": "inc"}).json()
        assert "invalid id" in unknown["error"]
        assert "not JSON" in client.post("/reset", content=b"{nope").json()["error"]
        mistakes = [r for r in caplog.records if r.name == LOGGER]
        assert len(mistakes) == 3
        assert all(r.exc_info is None and "\n" not in r.getMessage() for r in mistakes)
        caplog.clear()
        client.post("/reset", json={"id": idx, "task": 1})
        fault = client.post("/step", json={"id": idx, "action": "crash"}).json()
        assert fault["error"] == "RuntimeError: the simulator lost its state"
        [record] = [r for r in caplog.records if r.name == LOGGER]
        assert record.levelno == logging.ERROR and record.exc_info is not None


def _closed_within(sock: socket.socket, seconds: float) -> bool:
    """Whether the server closes `sock` within `seconds` (reads until EOF)."""
    sock.settimeout(seconds)
    try:
        while sock.recv(4096):
            pass
        return True
    except (TimeoutError, socket.timeout):
        return False
    except ConnectionResetError:
        return True


def test_slow_headers_and_missing_bodies_are_cut_off(caplog):
    app = create_app(CounterEnv)
    with LiveServer(app, header_timeout_s=0.5, body_timeout_s=0.5) as server, \
            caplog.at_level(logging.WARNING, LOGGER):
        address = ("127.0.0.1", server.port)
        with socket.create_connection(address) as silent, \
                socket.create_connection(address) as partial_headers, \
                socket.create_connection(address) as short_body:
            partial_headers.sendall(b"POST /step HTTP/1.1\r\nHost: x\r\n")
            short_body.sendall(b"POST /step HTTP/1.1\r\nHost: x\r\nContent-Type: "
                               b"application/json\r\nContent-Length: 100\r\n\r\n{\"id\": 1")
            start = time.monotonic()
            for sock in (silent, partial_headers, short_body):
                assert _closed_within(sock, 3.0)
            assert time.monotonic() - start < 2.5
        assert httpx.get(f"{server.url}/info", timeout=1.0).status_code == 200
    cut_off = [r for r in caplog.records if "did not arrive within 0.5 s" in r.getMessage()]
    assert len(cut_off) == 3 and not any(r.exc_info for r in caplog.records)


def test_serve_exposes_the_limits_with_defaults():
    parser = argparse.ArgumentParser(formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    serve.add_arguments(parser)
    args = parser.parse_args(["--env", "counter_env:CounterEnv"])
    assert (args.idle_timeout_s, args.max_body_bytes, args.max_action_chars,
            args.header_timeout_s, args.body_timeout_s) == (3600.0, 1 << 20, 65536, 10.0, 30.0)
    text = parser.format_help()
    for option in ("--idle-timeout-s", "--max-body-bytes", "--max-action-chars",
                   "--header-timeout-s", "--body-timeout-s"):
        assert option in text
    assert "(default: 3600.0)" in text


@pytest.mark.parametrize("kwargs, message", [
    ({"idle_timeout_s": -1}, "idle_timeout_s must be >= 0"),
    ({"max_body_bytes": 0}, "max_body_bytes must be >= 1"),
    ({"max_action_chars": 0}, "max_action_chars must be >= 1"),
])
def test_create_app_checks_the_limits(kwargs, message):
    with pytest.raises(ValueError, match=message):
        create_app(CounterEnv, **kwargs)
