"""HttpEnv against a real `stepcredit serve` subprocess serving a toy counter env."""

from __future__ import annotations

import concurrent.futures
import os
import time

import httpx
import pytest

from stepcredit.envs.base import Env
from stepcredit.envs.http_client import HttpConfig, HttpEnv, HttpEnvError, ServerConnection
from stepcredit.envs.http_server import start_server_process

HERE = os.path.dirname(os.path.abspath(__file__))
COUNTER = "counter_env:CounterEnv"
# Short timeouts and backoff keep every fault test to a second or two.
FAST = HttpConfig(timeout_s=1.0, connect_timeout_s=0.5, close_timeout_s=0.5, retries=2,
                  backoff_s=0.05, backoff_max_s=0.2)
SCHEMA = {"id": "stepcredit", "env_idx": "stepcredit-env_idx"}


@pytest.fixture(scope="module", params=["id", "env_idx"])
def server(request):
    with start_server_process(COUNTER, dialect=request.param, pythonpath=[HERE],
                              options=["--max-action-chars", "100"]) as proc:
        proc.dialect = request.param
        yield proc


def _env(server, **kwargs) -> HttpEnv:
    return HttpEnv(server.url, SCHEMA[server.dialect], config=FAST, **kwargs)


def _stats(url: str) -> dict:
    return httpx.get(f"{url}/stats", timeout=1.0).json()


def _play(env: HttpEnv, target: int) -> list:
    """Plays the shortest solution; returns the step results."""
    env.reset(target)
    action = "inc" if target > 0 else "dec"
    return [env.step(action) for _ in range(abs(target))]


def test_plays_whole_episodes(server):
    with _env(server) as env:
        assert isinstance(env, Env)
        assert (env.name, env.max_steps) == ("counter", 8)
        for target in (3, -2):  # two episodes on one instance
            obs = env.reset(target)
            assert obs.text == "The counter shows 0."
            assert obs.admissible_actions == ("inc", "dec", "hang")
            assert obs.anchor == ("counter", 0)  # JSON lists come back as tuples
            assert obs.task == f"Make the counter show {target}."
            results = _play(env, target)
            assert [r.reward for r in results] == [0.0] * (abs(target) - 1) + [1.0]
            assert [r.done for r in results] == [False] * (abs(target) - 1) + [True]
            assert not any(r.truncated for r in results)
            assert results[-1].info == {"valid": True, "won": True, "score": 1.0, "error": ""}
            assert results[-1].observation.anchor == ("counter", target)


def test_invalid_action_is_answered_not_fatal(server):
    with _env(server) as env:
        env.reset(1)
        result = env.step("jump")
        assert not result.done and not result.truncated
        assert result.info["valid"] is False
        assert result.info["error"] == "Unknown action 'jump'; try inc or dec."
        assert env.step("inc").info["won"]


def test_step_limit_truncates(server):
    with _env(server) as env:
        env.reset(9)
        results = [env.step("dec") for _ in range(8)]
        assert [r.truncated for r in results] == [False] * 7 + [True]
        assert not any(r.done for r in results)


def test_client_step_limit_below_the_servers(server):
    with _env(server, max_steps=2) as env:
        env.reset(5)
        assert [env.step("inc").truncated for _ in range(2)] == [False, True]


def test_no_request_after_done(server):
    with _env(server) as env:
        _play(env, 1)
        before = _stats(server.url)["requests"].get("/step", 0)
        with pytest.raises(RuntimeError, match="episode is over"):
            env.step("inc")
        assert _stats(server.url)["requests"].get("/step", 0) == before


def test_step_before_reset_sends_nothing(server):
    with _env(server) as env:
        before = _stats(server.url)["requests"].get("/step", 0)
        with pytest.raises(RuntimeError, match="call reset first"):
            env.step("inc")
        assert _stats(server.url)["requests"].get("/step", 0) == before


def test_error_key_on_200_raises_with_the_servers_message(server):
    with _env(server) as env:
        with pytest.raises(HttpEnvError, match=r"task must be an int in \[-9, 9\], got 30"):
            env.reset(30)


def test_serve_options_reach_the_server(server):
    with _env(server) as env:
        env.reset(1)
        fault = env.step("inc" * 40)
        assert fault.truncated and "max_action_chars=100" in fault.info["error"]


def test_close_releases_the_instance_and_is_idempotent(server):
    live = _stats(server.url)["envs"]
    env = _env(server)
    assert _stats(server.url)["envs"] == live + 1
    env.close()
    env.close()
    assert _stats(server.url)["envs"] == live
    with pytest.raises(RuntimeError, match="closed"):
        env.reset(1)


def test_many_episodes_in_parallel(server):
    targets = [1, 2, 3, -1, -2, -3, 4, -4]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        def run(target):
            with _env(server) as env:
                return _play(env, target)[-1].info["won"]
        assert all(pool.map(run, targets))


def test_server_killed_mid_episode_ends_only_that_episode():
    with start_server_process(COUNTER, pythonpath=[HERE]) as proc:
        connection = ServerConnection(proc.url, max_concurrency=8)
        envs = [HttpEnv(proc.url, config=FAST, connection=connection) for _ in range(3)]
        collected = _play(envs[0], 2)  # finished before the crash
        envs[1].reset(5)
        first = envs[1].step("inc")
        envs[2].reset(-5)
        proc.kill()
        killed = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            faults = list(pool.map(lambda env: env.step("inc"), envs[1:]))
        for fault in faults:
            assert fault.truncated and not fault.done and fault.reward == 0.0
            assert fault.info["server_error"] is True
            assert "ConnectError" in fault.info["error"]
        assert faults[0].observation == first.observation  # the last state seen
        assert collected[-1].info["won"] and len(collected) == 2
        with pytest.raises(RuntimeError, match="episode is over"):
            envs[1].step("inc")  # latched: no retry against a dead server
        with pytest.raises(HttpEnvError, match="ConnectError"):
            envs[1].reset(1)
        for env in envs:
            env.close()  # tolerant of the dead server
        connection.close()
        # Two retries with backoff of at most 0.2 s and connect timeouts of 0.5 s: a few
        # seconds at most, not the default client's minutes (the server's own start-up,
        # slow under load, is not counted).
        assert time.monotonic() - killed < 10


def test_server_that_stops_answering_times_out_and_ends_the_episode():
    with start_server_process(COUNTER, env_kwargs={"hang_s": 30}, pythonpath=[HERE]) as proc:
        with HttpEnv(proc.url, config=FAST) as stuck, HttpEnv(proc.url, config=FAST) as other:
            stuck.reset(2)
            start = time.monotonic()
            fault = stuck.step("hang")
            elapsed = time.monotonic() - start
            # A step is never retried after a timeout: the server may have applied it.
            assert 0.9 < elapsed < 3.0
            assert fault.truncated and "ReadTimeout" in fault.info["error"]
            assert fault.info["server_error"] is True
            assert _play(other, 1)[-1].info["won"]  # the server still serves others
            assert _stats(proc.url)["requests"]["/step"] == 2
            start = time.monotonic()
        assert time.monotonic() - start < 3  # closing the stuck one is bounded too
        proc.kill()  # a graceful stop would wait for the sleeping step
