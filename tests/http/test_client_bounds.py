"""HttpEnv's time bounds: one deadline for construction, closing many instances
in parallel within a bound, and the wait for a concurrency slot counted in
`timeout_s`."""

from __future__ import annotations

import logging
import socket
import threading
import time

import pytest

from fake_agentgym import FakeServer
from stepcredit.envs.http_client import (HttpConfig, HttpEnv, HttpEnvError, ServerConnection,
                                         close_all)

FAST = HttpConfig(timeout_s=1.0, connect_timeout_s=0.5, close_timeout_s=0.5, retries=2,
                  backoff_s=0.01, backoff_max_s=0.05)


@pytest.fixture
def silent_url():
    """A listener that accepts connections (the kernel does) but never answers."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(64)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"


def test_construction_has_one_deadline(silent_url):
    # Four attempts of 1 s each would take 4 s; the deadline ends it at 1.5 s.
    config = HttpConfig(timeout_s=1.0, retries=3, backoff_s=0.05, create_timeout_s=1.5)
    start = time.monotonic()
    with pytest.raises(HttpEnvError, match="ReadTimeout"):
        HttpEnv(silent_url, config=config)
    assert 1.3 < time.monotonic() - start < 2.2
    assert HttpConfig().create_timeout_s == 60.0
    with pytest.raises(ValueError, match="HttpConfig.create_timeout_s must be > 0"):
        HttpConfig(create_timeout_s=0)


def _hanging_close(release: threading.Event):
    def close(body):
        release.wait(5.0)
        return 200, True
    return close


def test_close_all_closes_in_parallel(caplog):
    release = threading.Event()
    routes = {"POST /create": lambda body: (200, {"id": 1})}
    with FakeServer(routes) as server:
        connection = ServerConnection(server.url, max_concurrency=16)
        envs = [HttpEnv(server.url, "babyai", config=FAST, connection=connection)
                for _ in range(8)]
        routes["POST /close"] = _hanging_close(release)
        start = time.monotonic()
        with caplog.at_level(logging.WARNING):
            close_all(envs)  # one after another: 8 x 0.5 s
        elapsed = time.monotonic() - start
        release.set()
        # In parallel about 0.5 s; the bound leaves room for a loaded CI machine and still
        # refuses one after another (4 s).
        assert elapsed < 3.0 and server.requests["/close"] == 8
        assert len(caplog.records) == 1 and "8 of 8" in caplog.text  # one summary line
        with pytest.raises(RuntimeError, match="closed"):
            envs[0].reset(0)
        connection.close()


def test_close_all_is_bounded_when_slots_are_scarce():
    release = threading.Event()
    routes = {"POST /create": lambda body: (200, {"id": 1})}
    with FakeServer(routes) as server:
        connection = ServerConnection(server.url, max_concurrency=2)
        envs = [HttpEnv(server.url, "babyai", config=FAST, connection=connection)
                for _ in range(12)]
        routes["POST /close"] = _hanging_close(release)
        start = time.monotonic()
        close_all(envs, timeout_s=0.8)  # 12 closes, 2 at a time, 0.5 s each: 3 s unbounded
        elapsed = time.monotonic() - start
        release.set()
        assert elapsed < 1.4 and server.requests["/close"] <= 6
        connection.close()


def test_close_all_of_nothing_and_of_closed_envs():
    close_all([])
    with FakeServer({"POST /create": lambda body: (200, {"id": 1}),
                     "POST /close": lambda body: (200, True)}) as server:
        env = HttpEnv(server.url, "babyai", config=FAST)
        env.close()
        close_all([env, env])
        assert server.requests["/close"] == 1


def test_waiting_for_a_slot_counts_in_timeout_s():
    routes = {"POST /create": lambda body: (200, {"id": 1}),
              "POST /reset": lambda body: (200, {"observation": "start"})}
    with FakeServer(routes) as server:
        connection = ServerConnection(server.url, max_concurrency=1)
        config = HttpConfig(timeout_s=0.5, retries=0)
        env = HttpEnv(server.url, "babyai", config=config, connection=connection)
        outcome = []

        def reset():
            try:
                env.reset(0)
                outcome.append("reset")
            except HttpEnvError as e:
                outcome.append(str(e))

        connection.semaphore.acquire()  # another request holds the only slot
        try:
            start = time.monotonic()
            waiter = threading.Thread(target=reset, daemon=True)
            waiter.start()
            waiter.join(3.0)
            elapsed = time.monotonic() - start
        finally:
            connection.semaphore.release()
        waiter.join(3.0)
        assert elapsed < 1.0, "the wait for a slot was not bounded"
        assert "no concurrency slot" in outcome[0] and "max_concurrency=1" in outcome[0]
        assert server.requests["/reset"] == 0
        env.reset(0)  # with the slot free again
        connection.close()
