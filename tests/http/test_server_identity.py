"""Server identity: instance ids never repeat across server starts, and a client
whose server restarted ends its episode instead of acting on another client's."""

from __future__ import annotations

import httpx
import pytest
from fastapi.testclient import TestClient

from counter_env import CounterEnv
from live_server import LiveServer
from stepcredit.envs.http_client import HttpConfig, HttpEnv, HttpEnvError
from stepcredit.envs.http_server import BOOT_HEADER, create_app

FAST = HttpConfig(timeout_s=1.0, connect_timeout_s=0.5, close_timeout_s=0.5, retries=2,
                  backoff_s=0.05, backoff_max_s=0.2)


@pytest.mark.parametrize("dialect", ["id", "env_idx"])
def test_ids_differ_across_server_starts(dialect):
    def first_id(client):
        answer = client.post("/create").json()
        return answer["id"] if dialect == "id" else answer

    with TestClient(create_app(CounterEnv, dialect=dialect)) as old, \
            TestClient(create_app(CounterEnv, dialect=dialect)) as new:
        old_id, new_id = first_id(old), first_id(new)
        assert isinstance(old_id, int) and isinstance(new_id, int)
        assert 0 <= old_id < 2**53 and 0 <= new_id < 2**53  # exact in any JSON parser
        assert old_id != new_id
        assert first_id(new) == new_id + 1  # sequential within one start
        # A client of the old server (an AgentGym one, which sends no identity)
        # is refused by the new one instead of acting on its instance.
        refused = new.post("/reset", json={dialect: old_id, "data_idx": 1}).json()
        assert f"invalid id {old_id}" in refused["error"]


def test_answers_carry_the_boot_id_and_a_stale_one_is_refused():
    with TestClient(create_app(CounterEnv)) as client:
        created = client.post("/create")
        boot, idx = created.headers[BOOT_HEADER], created.json()["id"]
        assert client.get("/info").headers[BOOT_HEADER] == boot
        client.post("/reset", json={"id": idx, "data_idx": 1})
        stale = client.post("/step", json={"id": idx, "action": "inc"},
                            headers={BOOT_HEADER: "0123456789abcdef"})
        assert stale.status_code == 409 and "restarted" in stale.json()["error"]
        assert stale.headers[BOOT_HEADER] == boot
        # The refused step was not applied: the episode is still at its start.
        assert client.get("/observation", params={"id": idx}).json() == "The counter shows 0."
        same = client.post("/step", json={"id": idx, "action": "inc"}, headers={BOOT_HEADER: boot})
        assert same.json()["done"] is True


def test_restarted_server_ends_the_old_episode_and_spares_the_new_clients():
    first = LiveServer(create_app(CounterEnv))
    old = HttpEnv(first.url, config=FAST)
    old.reset(3)
    assert old.step("inc").observation.text == "The counter shows 1."
    first.stop()
    with LiveServer(create_app(CounterEnv), port=first.port) as second:
        new = HttpEnv(second.url, config=FAST)
        new.reset(3)
        fault = old.step("inc")  # the old instance is gone; `new` must not move
        assert fault.truncated and not fault.done and fault.reward == 0.0
        assert fault.info["server_error"] is True and "restarted" in fault.info["error"]
        assert fault.observation.text == "The counter shows 1."  # the last state seen
        with pytest.raises(HttpEnvError, match="restarted"):
            old.reset(1)
        old.close()  # sends nothing that could close `new`'s instance
        assert httpx.get(f"{second.url}/stats", timeout=1.0).json()["envs"] == 1
        assert [new.step("inc").observation.text for _ in range(3)] == [
            "The counter shows 1.", "The counter shows 2.", "The counter shows 3."]
        new.close()
