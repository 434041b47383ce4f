"""`stepcredit serve`'s alfworld, webshop and searchqa dialects played by clients
that behave as AgentGym's own (`agentenv.envs.AlfWorldEnvClient`,
`WebshopEnvClient`, `SearchQAEnvClient`, AgentGym snapshot 3ef9235): the same
requests in the same order, the same field names, the same `assert
status_code == 200`. Each plays whole episodes and checks that the goal reaches
the agent in the text it is shown, that a failed reset is loud, and that an
episode runs as long as the client asks."""

from __future__ import annotations

import argparse
from typing import Any

import httpx
import pytest

from live_server import LiveServer
from stepcredit import serve
from stepcredit.envs import agentgym_dialects as ag
from stepcredit.envs import registry
from stepcredit.envs.base import Observation
from stepcredit.envs.http_server import create_app, start_server_process

TIMEOUT = 5.0


class AlfWorldClient:
    """As `AlfWorldEnvClient`: `/create` answers `{"id"}`; `_post` adds `id` and
    asserts 200; reset retries 3 times and raises KeyError without an
    `observation`; step raises KeyError without one; the agent sees
    `observe()`: the observation and the available actions."""

    def __init__(self, url: str):
        self.url = url
        ok = httpx.post(f"{url}/create", timeout=TIMEOUT)
        if ok.status_code != 200:
            raise RuntimeError(f"Failed to create environment: {ok}")
        self.env_id = ok.json()["id"]
        self.info: dict[str, Any] = {}

    def _post(self, path: str, data: dict) -> Any:
        data["id"] = self.env_id
        res = httpx.post(f"{self.url}/{path}", json=data, timeout=TIMEOUT)
        assert res.status_code == 200
        return res.json()

    def _get(self, path: str) -> Any:
        res = httpx.get(f"{self.url}/{path}?id={self.env_id}", timeout=TIMEOUT)
        assert res.status_code == 200
        return res.json()

    def observe(self) -> str:
        return (f"{self.info['observation']}\nAVAILABLE ACTIONS: "
                f"{','.join(self.info['available_actions'])}")

    def reset(self, game: int, world_type: str = "Text") -> dict:
        response: dict = {}
        for _ in range(3):
            response = self._post("reset", {"game": game, "world_type": world_type})
            if "observation" in response:
                break
        if "observation" not in response:
            raise KeyError(f"AlfWorld reset failed: {response}")
        self.info = {"observation": response["observation"],
                     "available_actions": response.get("available_actions", []),
                     "reward": 0, "done": False}
        return response

    def step(self, action: str) -> tuple[str, float, bool]:
        response = self._post("step", {"action": action})
        if "observation" not in response:
            raise KeyError(f"AlfWorld step response missing 'observation': {response}")
        self.info = {"observation": response["observation"],
                     "available_actions": response.get("available_actions", []),
                     "reward": response.get("reward", 0.0), "done": response.get("done", False)}
        return response["observation"], response.get("reward", 0.0), response.get("done", False)

    def close(self) -> Any:
        return self._post("close", {})


class WebshopClient:
    """As `WebshopEnvClient`: `/create` answers a bare int; `_post` adds
    `env_idx`, retries on 503 and asserts 200; reset posts `session_id` and
    then shows `GET /observation`; step reads `state`, `reward`, `done`."""

    def __init__(self, url: str):
        self.url = url
        ok = httpx.post(f"{url}/create", timeout=TIMEOUT)
        if ok.status_code != 200:
            raise RuntimeError(f"Failed to create environment: {ok}")
        self.env_id = ok.json()

    def _post(self, path: str, data: dict) -> Any:
        data["env_idx"] = self.env_id
        for _ in range(5):
            res = httpx.post(f"{self.url}/{path}", json=data, timeout=TIMEOUT)
            if res.status_code != 503:
                break
        assert res.status_code == 200
        return res.json()

    def _get(self, path: str) -> Any:
        res = httpx.get(f"{self.url}/{path}?env_idx={self.env_id}", timeout=TIMEOUT)
        assert res.status_code == 200
        return res.json()

    def observe(self) -> str:
        return self._get("observation")

    def step(self, action: str) -> tuple[str, float, bool]:
        response = self._post("step", {"action": action})
        return response["state"], response["reward"], response["done"]

    def reset(self, idx: int) -> list:
        response = self._post("reset", {"session_id": idx})
        response[0] = self.observe()
        return response


class SearchQAClient:
    """As `SearchQAEnvClient`: `/create` posts `{"id": 0}` and gets a bare int;
    `_post` adds `env_idx` and asserts 200; reset posts the task as `id` and
    gets the question text; step reads `observation`, `reward`, `done`."""

    def __init__(self, url: str):
        self.url = url
        ok = httpx.post(f"{url}/create", json={"id": 0}, timeout=TIMEOUT)
        if ok.status_code != 200:
            raise RuntimeError(f"Failed to create environment: {ok}")
        self.env_id = ok.json()

    def _post(self, path: str, data: dict) -> Any:
        data["env_idx"] = self.env_id
        res = httpx.post(f"{self.url}/{path}", json=data, timeout=TIMEOUT)
        assert res.status_code == 200
        return res.json()

    def observe(self) -> str:
        res = httpx.get(f"{self.url}/observation?env_idx={self.env_id}", timeout=TIMEOUT)
        assert res.status_code == 200
        return res.json()

    def step(self, action: str) -> tuple[str, float, bool]:
        response = self._post("step", {"action": action})
        return response["observation"], response["reward"], response["done"]

    def reset(self, id: int) -> str:
        return self._post("reset", {"id": id})

    def close(self) -> Any:
        return self._post("close", {})


def _server(env: str, dialect: str, **kwargs: Any) -> LiveServer:
    return LiveServer(create_app(lambda: registry.make(env), dialect=dialect, **kwargs))


@pytest.fixture(scope="module")
def alfworld_url():
    with _server("alfworld", "alfworld") as server:
        yield server.url


@pytest.fixture(scope="module")
def webshop_url():
    with _server("webshop", "webshop") as server:
        yield server.url


@pytest.fixture(scope="module")
def searchqa_url():
    with _server("hotpotqa", "searchqa") as server:
        yield server.url


# --- ALFWorld ---------------------------------------------------------------

def test_alfworld_client_sees_its_goal_and_wins(alfworld_url):
    local = registry.make("alfworld")
    for game in (0, 1):
        client = AlfWorldClient(alfworld_url)
        first = local.reset(game)
        response = client.reset(game)
        assert response["observation"] == f"{first.text}\nYour task is to: {first.task}"
        assert client.observe().split("\n")[1] == f"Your task is to: {first.task}"
        assert response["task_type"] == local.task_type
        assert set(response) == {"id", "observation", "available_actions", "task_type"}
        done = False
        while not done:
            action = local.oracle_actions()[0]
            want = local.step(action)
            text, reward, done = client.step(action)
            assert (text, reward, done) == (want.observation.text, want.reward, want.done)
        assert reward == 1.0
        detail = client._get("detail")
        assert detail["done"] is True and detail["world_type"] == "Text" and detail["game"] == game
        # The original's _check_id refuses a step after done: its client raises.
        with pytest.raises(KeyError, match="missing 'observation'"):
            client.step("look")
        assert client.close() is True
    local.close()


def test_alfworld_failed_reset_is_loud(alfworld_url):
    client = AlfWorldClient(alfworld_url)
    with pytest.raises(KeyError, match="out of range"):
        client.reset(100000)
    with pytest.raises(KeyError, match="world_type must be one of"):
        client.reset(0, world_type="Textual")
    client.close()


def test_alfworld_episode_runs_as_long_as_the_client_asks(alfworld_url):
    client = AlfWorldClient(alfworld_url)
    client.reset(0)
    limit = registry.make("alfworld").max_steps
    for _ in range(limit + 10):
        assert client.step("look")[2] is False
    assert httpx.get(f"{alfworld_url}/info").json()["max_steps"] is None
    client.close()


@pytest.mark.parametrize("dialect", ["alfworld", "webshop"])
def test_http_env_closes_its_instances_on_a_dialect_server(dialect):
    from stepcredit.envs.http_client import HttpEnv

    with _server(dialect, dialect, max_envs=1) as server:
        for _ in range(3):  # each needs the one slot the one before it released
            with HttpEnv(server.url, dialect) as env:
                env.reset(0)


def test_the_step_limit_is_a_server_option():
    with _server("alfworld", "alfworld", max_steps=3) as server:
        client = AlfWorldClient(server.url)
        client.reset(0)
        assert [client.step("look")[2] for _ in range(3)] == [False, False, True]


# --- WebShop ----------------------------------------------------------------

def test_webshop_client_sees_its_goal_on_every_page_and_buys(webshop_url):
    local = registry.make("webshop")
    client = WebshopClient(webshop_url)
    first = local.reset(3)
    page, extra = client.reset(3)
    instruction = first.task
    assert page == f"WebShop [SEP] Instruction: [SEP] {instruction} [SEP] Search"
    assert extra is None
    assert client._get("instruction_text") == f"Instruction: {instruction}"
    assert client._get("available_actions")["has_search_bar"] is True
    done = False
    while not done:
        action = local.oracle_actions()[0]
        want = local.step(action)
        state, reward, done = client.step(action)
        if not done:
            assert state.startswith(f"Instruction: [SEP] {instruction} [SEP] ")
            assert state.endswith(want.observation.text) and client.observe() == state
            clickables = client._get("available_actions")["clickables"]
            assert {f"click[{c}]" for c in clickables} == set(want.observation.admissible_actions)
    assert reward == want.reward == 1.0
    assert client.env_id in client._get("list_envs")
    state_answer = client._get("state")
    assert set(state_answer) == {"url", "html", "instruction_text"}
    assert state_answer["instruction_text"] == instruction
    local.close()


def test_webshop_invalid_action_leaves_the_page(webshop_url):
    client = WebshopClient(webshop_url)
    page, _ = client.reset(0)
    assert client.step("click[no such button]") == (page, 0.0, False)


def test_webshop_failed_reset_is_loud(webshop_url):
    client = WebshopClient(webshop_url)
    client.reset(0)
    with pytest.raises(AssertionError):
        client.reset(100000)
    # A bad id and a step on a finished episode are HTTP errors too.
    res = httpx.post(f"{webshop_url}/step", json={"env_idx": -5, "action": "search[x]"})
    assert res.status_code == 400 and "invalid id" in res.json()["detail"]


def test_webshop_episode_runs_as_long_as_the_client_asks(webshop_url):
    client = WebshopClient(webshop_url)
    client.reset(1)
    limit = registry.make("webshop").max_steps
    for _ in range(limit + 5):
        assert client.step("search[red mug]")[2] is False
        assert client.step("click[back to search]")[2] is False


def test_webshop_reset_without_a_session_draws_a_goal(webshop_url):
    client = WebshopClient(webshop_url)
    page, _ = client._post("reset", {})
    assert page.startswith("WebShop [SEP] Instruction: [SEP] ")


# --- SearchQA ---------------------------------------------------------------

def _tagged(action: str) -> str:
    """The HotpotQA oracle's action as an LLM's SearchQA reply."""
    verb, _, rest = action.partition("[")
    tag = {"search": "search", "lookup": "lookup", "finish": "answer"}[verb]
    return f"<think>I should {verb}.</think> <{tag}> {rest[:-1]} </{tag}>"


def test_searchqa_client_sees_its_question_and_answers(searchqa_url):
    local = registry.make("hotpotqa")
    for task in (0, 1):
        client = SearchQAClient(searchqa_url)
        first = local.reset(task)
        prompt = client.reset(task)
        assert prompt.endswith(f"Question: {first.task}") and client.observe() == prompt
        done = False
        while not done:
            action = local.oracle_actions()[0]
            want = local.step(action)
            text, reward, done = client.step(_tagged(action))
            if not done:
                assert text == f"<information>{want.observation.text}</information>"
        assert (text, reward) == (ag.SEARCHQA_CORRECT, 1.0)
        assert client.close() is True
    local.close()


def test_searchqa_lists_its_actions_in_the_tags_its_step_reads(searchqa_url):
    client = SearchQAClient(searchqa_url)
    client.reset(0)
    listed = httpx.get(f"{searchqa_url}/available_actions?env_idx={client.env_id}",
                       timeout=TIMEOUT).json()
    searches = [action for action in listed if action.startswith("<search> ")]
    assert searches and all(a.endswith(" </search>") or a.endswith(" </answer>")
                            or a.endswith(" </lookup>") for a in listed)
    text, _, _ = client.step(searches[0])
    assert text.startswith("<information>")  # not the invalid-action answer
    assert ag.searchqa_action(ag.searchqa_tagged("finish[Yes]")) == ("answer", "finish[Yes]")


def test_searchqa_invalid_and_wrong_answers(searchqa_url):
    client = SearchQAClient(searchqa_url)
    client.reset(0)
    assert client.step("I will just think.") == (ag.SEARCHQA_INVALID, 0.0, False)
    found = client.step("<search> Rosa Moreau </search>")[0]
    # A wrong answer lets the agent try again, from where it was.
    assert client.step("<answer> Atlantis </answer>") == (ag.SEARCHQA_WRONG, 0.0, False)
    assert client.step("<lookup> born </lookup>")[0].startswith("<information>(Result 1 / 1)")
    assert client.step("<search> Rosa Moreau </search>")[0] == found
    assert client.step("<search> East Pellam </search>")[2] is False
    assert client.step("<answer>1086</answer>") == (ag.SEARCHQA_CORRECT, 1.0, True)


def test_searchqa_step_limit_counts_every_round():
    with _server("hotpotqa", "searchqa", max_steps=3) as server:
        client = SearchQAClient(server.url)
        client.reset(0)
        assert client.step("no tag")[2] is False
        assert client.step("<answer> Atlantis </answer>")[2] is False
        assert client.step("<answer> Atlantis </answer>") == (ag.SEARCHQA_WRONG, 0.0, True)


def test_searchqa_failed_reset_is_loud(searchqa_url):
    client = SearchQAClient(searchqa_url)
    with pytest.raises(AssertionError):
        client.reset(100000)
    res = httpx.post(f"{searchqa_url}/close", json={"env_idx": -5})
    assert res.status_code == 200 and res.json() is False  # as the original server


def test_searchqa_episode_runs_as_long_as_the_client_asks(searchqa_url):
    client = SearchQAClient(searchqa_url)
    client.reset(0)
    limit = registry.make("hotpotqa").max_steps
    for _ in range(limit + 5):
        assert client.step("<search> Rosa Moreau </search>")[2] is False


# --- pieces -----------------------------------------------------------------

def test_text_helpers():
    obs = Observation("Back to Search [SEP] Page 1", None, "a", "buy a mug")
    assert ag.webshop_page(obs) == "Instruction: [SEP] buy a mug [SEP] Back to Search [SEP] Page 1"
    assert ag.webshop_available_actions(["search[x]", "click[buy now]", "look"]) == {
        "has_search_bar": True, "clickables": ["buy now"]}
    assert ag.searchqa_action("<answer>\n Paris </answer><search>x</search>") == (
        "answer", "finish[Paris]")
    assert ag.searchqa_action("<search>x</answer>") is None


def test_serve_options_name_the_dialects_and_the_step_limit():
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    args = parser.parse_args(["--env", "webshop", "--dialect", "webshop", "--max-steps", "15"])
    assert (args.dialect, args.max_steps) == ("webshop", 15)
    assert parser.parse_args(["--env", "webshop"]).max_steps is None
    help_text = parser.format_help()
    assert "--max-steps" in help_text and "searchqa" in help_text
    with pytest.raises(ValueError, match="max_steps must be >= 0"):
        create_app(lambda: registry.make("webshop"), dialect="webshop", max_steps=-1)


@pytest.mark.parametrize("env, dialect", [("alfworld", "alfworld"), ("webshop", "webshop"),
                                          ("hotpotqa", "searchqa")])
def test_httpenv_with_the_original_schema_plays_the_dialect(env, dialect):
    # HttpEnv's schema for a real AgentGym server also speaks to its imitation.
    from stepcredit.envs.http_client import HttpConfig, HttpEnv

    local = registry.make(env)
    config = HttpConfig(timeout_s=TIMEOUT, connect_timeout_s=1.0, retries=1, backoff_s=0.01)
    with _server(env, dialect) as server, HttpEnv(server.url, dialect, config=config) as remote:
        first, obs = local.reset(0), remote.reset(0)
        assert first.task in obs.text or first.task in obs.task
        result = None
        while result is None or not result.done:
            action = local.oracle_actions()[0]
            local.step(action)
            result = remote.step(_tagged(action) if dialect == "searchqa" else action)
            assert not result.truncated, result.info
        assert result.info["won"]
    local.close()


def test_stepcredit_serve_runs_a_dialect_with_a_step_limit():
    options = ("--max-steps", "2")
    with start_server_process("hotpotqa", dialect="searchqa", options=options) as server:
        assert httpx.get(f"{server.url}/info", timeout=TIMEOUT).json() == {
            "name": "hotpotqa", "max_steps": 2, "dialect": "searchqa",
            "num_tasks": registry.make("hotpotqa").num_tasks}
        client = SearchQAClient(server.url)
        assert "Question: " in client.reset(0)
        assert [client.step("<search> Rosa Moreau </search>")[2] for _ in range(2)] == [
            False, True]
