"""Serves any stepcredit environment over the AgentGym HTTP protocol.

The server hosts many instances of one environment keyed by an integer, like
the AgentGym servers (FastAPI on uvicorn), in one of five dialects.

stepcredit's own two, for `HttpEnv` (schemas "stepcredit" and
"stepcredit-env_idx"):

- "id" (ALFWorld's family): `POST /create` -> `{"id": int}`; `POST /reset
  {"id", "data_idx"}` -> `{"id", "observation", "available_actions", ...}`;
  `POST /step {"id", "action"}` -> `{"observation", "reward", "done", ...}`.
- "env_idx" (WebShop's family): `POST /create` -> bare int; `POST /reset
  {"env_idx", "session_id"}` -> `[observation, extras]`; `POST /step
  {"env_idx", "action"}` -> `{"state", "reward", "done", "info", ...}`.

Both also answer `GET /observation`, `GET /available_actions` (with `?id=` or
`?env_idx=`) and `POST /close`. Reset accepts the task under any of AgentGym's
field names (`data_idx`, `game`, `session_id`, `item_id`, `task`). Answers
carry `anchor`, `task`, `truncated` and the step `info` as extra keys, which
AgentGym clients ignore; `done` is true on truncation too, because AgentGym
clients stop only on `done`. The observation text is the environment's, without
the goal (which is in `task`).

Three that answer field for field as an original AgentGym server (AgentGym
snapshot 3ef9235), for AgentGym's own clients, with the goal in the text the
client shows (see `agentgym_dialects`):

- "alfworld": reset `{"id", "game", "world_type"}` (one of Text, Embody,
  Hybrid) -> `{"id", "observation", "available_actions", "task_type"}`, the
  observation ending with "\nYour task is to: ..."; step -> `{"observation",
  "reward", "available_actions", "done"}`; `GET /detail`. Errors are HTTP 200
  `{"error": ...}`, as the original's `_check_id`.
- "webshop": reset `{"env_idx", "session_id"}` -> `[page, null]` (no
  `session_id`: a random goal); step -> `{"state", "reward", "done", "info":
  null}`; pages read `WebShop [SEP] Instruction: [SEP] <instruction> [SEP]
  Search` (results and item pages start with the instruction); an invalid action
  leaves the page unchanged; `GET /available_actions` -> `{"has_search_bar",
  "clickables"}`, `/instruction_text`, `/state` -> `{"url", "html",
  "instruction_text"}`, `/list_envs`; `POST /close` -> `{"closed"}`.
- "searchqa" (for the HotpotQA simulator): create `{"id"}` -> bare int; reset
  `{"env_idx", "id": task}` -> the question text; step -> `{"observation",
  "reward", "done", "info": null}`, the action's first `<search> q </search>`,
  `<answer> a </answer>` (or stepcredit's `<lookup> k </lookup>`) played as
  `search[q]`, `finish[a]`, `lookup[k]`; a wrong answer lets the agent try
  again, as in the original; `POST /close` -> bool.

In "webshop" and "searchqa" an error is an HTTP error status (400 for a
client's mistake, 500 for an environment's failure) with `{"detail": ...}`:
their clients assert a 200, and the original servers have no error answers.
Every dialect answers `GET /info` (environment name, step limit, dialect, task
count where the environment has one) and
`GET /stats` (live and expired instances, the boot id, requests per path).

Step limit (`create_app(max_steps=...)`, `stepcredit serve --max-steps`): none by
default in the AgentGym dialects, as the original servers (the client decides
how many rounds to play); the environment's own in the native ones.

Errors in the native dialects come back as HTTP 200 with `{"error": "..."}`, as
the AgentGym servers of the `id` family do, including a step on a finished
episode (their `_check_id`); a body over `max_body_bytes` is answered HTTP 413.

Limits (see `create_app` and `build_server`): an instance idle for
`idle_timeout_s` expires, freeing its slot; bodies and actions are
size-limited; a connection slow to send its headers or body is closed.

Identity: each start draws a random boot id and a random first instance id, so
ids (still integers, below 2**53) do not repeat across restarts and an old
client's id is answered "invalid id" rather than naming another client's
instance. Every answer carries the boot id in the `X-Stepcredit-Boot` header,
which AgentGym clients ignore; a request that sends that header with another
boot id (an `HttpEnv` whose server restarted) is refused with HTTP 409 before
anything is done.
"""

# No `from __future__ import annotations`: FastAPI reads the route functions'
# annotations at runtime, and `fastapi` is imported inside `create_app` only.
import asyncio
import collections
import contextlib
import dataclasses
import importlib
import json
import logging
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Callable, Mapping, Sequence

from stepcredit.envs import agentgym_dialects as ag
from stepcredit.envs.base import Env, Observation
from stepcredit.envs.http_protocol import BOOT_HEADER, ProtocolError, clip, short  # noqa: F401 (BOOT_HEADER re-exported)

_log = logging.getLogger(__name__)

EnvFactory = Callable[[], Env]

# Every name under which an AgentGym client sends the task to /reset (ALFWorld
# `game`, BabyAI/SciWorld/TextCraft `data_idx`, WebShop `session_id`, SQLGym
# `item_id`), plus our own `task` for tasks that are not integers.
_TASK_FIELDS = ("task", "data_idx", "game", "session_id", "item_id")

# The field each AgentGym dialect's client sends the task in, looked at first
# (SearchQA's is `id`, which the `id` family uses for the instance).
_DIALECT_TASK_FIELD = {"alfworld": "game", "webshop": "session_id", "searchqa": "id"}

# An environment's step limit when the server sets none: larger than any episode.
_NO_LIMIT = sys.maxsize

# Instance ids stay below 2**53, which every JSON parser holds exactly; a start
# draws its first id below 2**52, which leaves room for 2**52 creates.
_ID_SPACE = 2**52


# The defaults of the limits (also `stepcredit serve`'s).
IDLE_TIMEOUT_S = 3600.0
MAX_BODY_BYTES = 1 << 20
MAX_ACTION_CHARS = 65536
HEADER_TIMEOUT_S = 10.0
BODY_TIMEOUT_S = 30.0

# How many expired ids are remembered, to answer "expired" rather than "invalid id".
_EXPIRED_MEMORY = 1 << 16


@dataclasses.dataclass
class _Slot:
    """One hosted environment instance.

    `lock` serialises calls on it; `last_used` (monotonic seconds) is when a
    request last named it or finished with it; `closed` tells a request that
    waited for `lock` that the instance was closed or expired meanwhile.
    """

    env: Env
    last_used: float
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    observation: Observation | None = None
    finished: bool = False
    closed: bool = False
    steps: int = 0
    # What the dialect showed last (the page text for WebShop) and its
    # per-episode facts (ALFWorld's `/detail`).
    shown: str = ""
    detail: dict = dataclasses.field(default_factory=dict)


def _jsonable(value: Any) -> Any:
    """Converts an anchor or info value to JSON: tuples become lists, and a
    value JSON cannot hold becomes its repr, which keeps equal anchors equal."""
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    return repr(value)


def _observation_fields(obs: Observation) -> dict[str, Any]:
    actions = None if obs.admissible_actions is None else list(obs.admissible_actions)
    return {"available_actions": actions, "anchor": _jsonable(obs.anchor), "task": obs.task}


class _EnvHost:
    """A thread-safe table of environment instances and the protocol's operations.

    Ids run up from `first_id`. An instance no request has named for
    `idle_timeout_s` (0: never) is closed and its id answered as expired; one
    that a request is using is never idle.
    """

    def __init__(self, factory: EnvFactory, max_envs: int, first_id: int,
                 idle_timeout_s: float, max_steps: int | None = None, id_field: str = "id"):
        self._factory = factory
        self._id_field = id_field
        self._max_steps = max_steps
        self._max_envs = max_envs
        self._idle_timeout_s = idle_timeout_s
        self._slots: dict[int, _Slot] = {}
        self._building = 0  # creates under way, counted against max_envs
        self._next_id = first_id
        self._expired: collections.OrderedDict[int, None] = collections.OrderedDict()
        self.expired_total = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._slots)

    def create(self) -> int:
        self.expire_idle()
        with self._lock:
            if len(self._slots) + self._building >= self._max_envs:
                expiry = (f" (idle ones expire after idle_timeout_s={self._idle_timeout_s:g})"
                          if self._idle_timeout_s > 0 else "")
                raise ProtocolError(f"server holds max_envs={self._max_envs} environments; "
                                     f"close some first{expiry}")
            idx = self._next_id
            self._next_id += 1
            self._building += 1
        # Built outside the table lock: constructing an environment may be slow.
        try:
            env = self._factory()
        except BaseException:
            with self._lock:
                self._building -= 1
            raise
        with self._lock:
            self._building -= 1
            self._slots[idx] = _Slot(env, last_used=time.monotonic())
        return idx

    def _idle(self, slot: _Slot, now: float) -> bool:
        return self._idle_timeout_s > 0 and now - slot.last_used > self._idle_timeout_s

    def _retire(self, idx: int, slot: _Slot) -> None:
        """Removes an expired instance; call with the table lock and `slot.lock` held."""
        del self._slots[idx]
        slot.closed = True
        self._expired[idx] = None
        while len(self._expired) > _EXPIRED_MEMORY:
            self._expired.popitem(last=False)
        self.expired_total += 1

    @staticmethod
    def _close_env(idx: int, slot: _Slot) -> None:
        try:
            slot.env.close()
        except Exception:  # a broken close must not stop the others
            _log.exception("closing environment %d failed", idx)

    def expire_idle(self) -> int:
        """Closes every idle instance; returns how many."""
        if self._idle_timeout_s <= 0:
            return 0
        now, retired = time.monotonic(), []
        with self._lock:
            for idx, slot in list(self._slots.items()):
                # A request holding `slot.lock` is using it: not idle.
                if self._idle(slot, now) and slot.lock.acquire(blocking=False):
                    self._retire(idx, slot)
                    slot.lock.release()
                    retired.append((idx, slot))
        for idx, slot in retired:
            self._close_env(idx, slot)
        if retired:
            _log.info("expired %d environment(s) idle for over %g s", len(retired),
                      self._idle_timeout_s)
        return len(retired)

    def _slot(self, idx: Any) -> _Slot:
        """The live instance `idx`, marked as used now."""
        if idx is None:
            raise ProtocolError(f"the request names no environment: {self._id_field!r} is missing")
        if isinstance(idx, bool) or not isinstance(idx, int):
            raise ProtocolError(f"the environment id {self._id_field!r} must be an integer, got "
                                f"{short(idx)}")
        now = time.monotonic()
        with self._lock:
            slot = self._slots.get(idx)
            if slot is not None and not (self._idle(slot, now)
                                         and slot.lock.acquire(blocking=False)):
                slot.last_used = now
                return slot
            if slot is not None:  # idle, and no request is using it: it expires now
                self._retire(idx, slot)
                slot.lock.release()
            expired = idx in self._expired
        if slot is not None:
            self._close_env(idx, slot)
        if expired:
            raise ProtocolError(f"environment {idx} expired: no request named it for "
                                 f"idle_timeout_s={self._idle_timeout_s:g}; create a new one")
        raise ProtocolError(f"invalid id {idx}: no such environment (never created, "
                             "or closed)")

    @contextlib.contextmanager
    def _using(self, idx: int, slot: _Slot):
        """Holds `slot.lock` for one operation and marks the slot used when it ends."""
        with slot.lock:
            if slot.closed:
                raise ProtocolError(f"environment {idx} was closed or expired while this "
                                     "request waited for it")
            try:
                yield
            finally:
                slot.last_used = time.monotonic()

    def reset(self, idx: Any, task: Any) -> Observation:
        """Resets `idx` on `task`. The environment's ValueError, TypeError or
        LookupError is taken for a bad task: the client's mistake."""
        slot = self._slot(idx)
        with self._using(idx, slot):
            try:
                observation = slot.env.reset(task)
            except (ValueError, TypeError, LookupError) as e:
                raise ProtocolError(f"{type(e).__name__}: {clip(str(e))}") from e
            slot.observation, slot.finished, slot.steps = observation, False, 0
            return observation

    def step(self, idx: Any, action: Any) -> tuple[Observation, float, bool, bool, dict]:
        if not isinstance(action, str):
            raise ProtocolError(f"action must be a string, got {short(action)}")
        slot = self._slot(idx)
        with self._using(idx, slot):
            if slot.observation is None:
                raise ProtocolError(f"environment {idx} has not been reset")
            if slot.finished:
                raise ProtocolError(f"environment {idx} is done; reset it before stepping")
            result = slot.env.step(action)
            slot.steps += 1
            truncated = bool(result.truncated) or (
                self._max_steps is not None and not result.done
                and slot.steps >= self._max_steps)
            slot.observation = result.observation
            slot.finished = result.done or truncated
            return (result.observation, float(result.reward), bool(result.done), truncated,
                    dict(result.info))

    def slot(self, idx: Any) -> _Slot:
        """The live instance `idx` (for a dialect's own bookkeeping)."""
        return self._slot(idx)

    def ids(self) -> list[int]:
        """The ids of the live instances."""
        with self._lock:
            return list(self._slots)

    def observation(self, idx: Any) -> Observation:
        slot = self._slot(idx)
        if slot.observation is None:
            raise ProtocolError(f"environment {idx} has not been reset")
        return slot.observation

    def close(self, idx: Any) -> None:
        slot = self._slot(idx)
        with self._lock:
            if self._slots.get(idx) is slot:
                del self._slots[idx]
        with slot.lock:
            if slot.closed:
                return
            slot.closed = True
            slot.env.close()

    def close_all(self) -> None:
        with self._lock:
            slots, self._slots = list(self._slots.items()), {}
        for idx, slot in slots:
            self._close_env(idx, slot)


def _limit_steps(env: Env, limit: int | None) -> Env:
    """Sets `env.max_steps` to the server's limit (`limit`, or none), so that the
    environment itself does not cut an episode the server lets run; an
    environment whose `max_steps` cannot be set keeps its own limit."""
    try:
        env.max_steps = _NO_LIMIT if limit is None else limit
    except (AttributeError, TypeError):
        _log.warning("%s: cannot set max_steps; its own step limit stays", type(env).__name__)
    return env


def create_app(env_factory: EnvFactory, *, dialect: str = "id", max_envs: int = 1024,
               idle_timeout_s: float = IDLE_TIMEOUT_S, max_body_bytes: int = MAX_BODY_BYTES,
               max_action_chars: int = MAX_ACTION_CHARS, max_steps: int | None = None):
    """Builds the FastAPI app that serves `env_factory`'s environments.

    Args:
      env_factory: makes one fresh environment per `/create`. It is called once
        here too, to check it and read the environment's name and step limit.
      dialect: stepcredit's own "id" (ALFWorld's family: BabyAI, SciWorld,
        TextCraft) or "env_idx" (WebShop's family: SQLGym, SearchQA), whose
        answers carry stepcredit's extra keys for `HttpEnv`; or "alfworld",
        "webshop" or "searchqa", which answer field for field as that original
        AgentGym server (see the module docstring).
      max_envs: the most live instances; `/create` beyond it answers an error
        (WebShop's server silently hands out existing ids instead).
      idle_timeout_s: an instance no request has named for this long (default
        an hour) is closed, freeing its slot, and its id is answered as
        expired; 0 keeps instances until they are closed.
      max_body_bytes: the largest request body (default 1 MiB); a larger one
        is answered HTTP 413 without being read further.
      max_action_chars: the longest action (default 65536 characters); a
        longer one is refused without stepping.
      max_steps: the step limit: the step that reaches it without finishing
        answers `done` (and `truncated` in the native dialects). None (the
        default) means the environment's own limit in the native dialects
        (which `HttpEnv` reads from `/info`) and no limit in the AgentGym
        dialects, as the original servers, whose client decides how many
        rounds to play; 0 means no limit in any dialect.

    Client mistakes (a bad id, body, task or action) are answered `{"error":
    ...}` with HTTP 200 in the native and ALFWorld dialects, and with HTTP 400
    `{"detail": ...}` in the WebShop and SearchQA dialects, whose clients
    assert a 200 (the original servers fail with an error status); they are
    logged in one line. An environment's own failure is answered the same way
    (HTTP 500 in those two dialects) and logged with its traceback. Messages
    quote at most a short prefix of a bad value.

    Returns:
      A `fastapi.FastAPI` app; run it with `serve` (which adds header and body
      read timeouts) or any ASGI server. The protocol's endpoints are answered
      by its middleware (`http_asgi.Endpoints`, for speed), so only `/info`,
      `/stats` (and WebShop's `/list_envs`) are FastAPI routes.
    """
    import fastapi
    from fastapi.concurrency import run_in_threadpool

    from stepcredit.envs import http_asgi

    if dialect not in ag.DIALECTS:
        raise ValueError(f"dialect must be one of {ag.DIALECTS}, got {dialect!r}")
    for name, value, least in (("max_envs", max_envs, 1), ("idle_timeout_s", idle_timeout_s, 0),
                               ("max_body_bytes", max_body_bytes, 1),
                               ("max_action_chars", max_action_chars, 1),
                               ("max_steps", 0 if max_steps is None else max_steps, 0)):
        if value < least:
            raise ValueError(f"{name} must be >= {least}, got {value}")
    native = dialect in ag.NATIVE_DIALECTS
    probe = env_factory()
    if max_steps is None and native:
        limit: int | None = int(probe.max_steps)
    else:
        limit = max_steps or None
    num_tasks = getattr(probe, "num_tasks", None)
    info = {"name": probe.name, "max_steps": limit, "dialect": dialect,
            "num_tasks": None if num_tasks is None else int(num_tasks)}
    probe.close()
    # The native dialects' default keeps the environment as it is.
    factory = env_factory if native and max_steps is None else (
        lambda: _limit_steps(env_factory(), limit))

    boot = secrets.token_hex(8)
    # A random first id per start: a client of an earlier start (which may hold
    # any id of that start's run) almost surely names no instance of this one.
    id_field = ag.ID_FIELD[dialect]
    host = _EnvHost(factory, max_envs, first_id=secrets.randbelow(_ID_SPACE),
                    idle_timeout_s=idle_timeout_s, max_steps=limit, id_field=id_field)
    requests: collections.Counter[str] = collections.Counter()
    obs_key = "state" if dialect in ("env_idx", "webshop") else "observation"
    loud = dialect in ("webshop", "searchqa")  # errors as HTTP error statuses
    task_fields = tuple(dict.fromkeys((_DIALECT_TASK_FIELD.get(dialect, "task"),
                                       *_TASK_FIELDS)))

    async def expire_idle_instances():
        # Frees idle instances' resources even when no create comes to sweep them.
        while True:
            await asyncio.sleep(min(60.0, max(0.05, idle_timeout_s / 4)))
            await run_in_threadpool(host.expire_idle)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        sweeper = asyncio.create_task(expire_idle_instances()) if idle_timeout_s > 0 else None
        try:
            yield
        finally:
            if sweeper is not None:
                sweeper.cancel()
            host.close_all()

    app = fastapi.FastAPI(title=f"stepcredit {info['name']} ({dialect} dialect)",
                          lifespan=lifespan)

    def task_of(body: dict) -> Any:
        for field in task_fields:
            if field in body and body[field] is not None:
                task = body[field]
                # JSON has no tuples; environments key tasks by hashable values.
                return tuple(task) if isinstance(task, list) else task
        if dialect == "webshop":
            # WebShop's server draws a random goal when the reset names none.
            slot = host.slot(body.get(id_field))
            num_tasks = getattr(slot.env, "num_tasks", None)
            if isinstance(num_tasks, int) and num_tasks > 0:
                return secrets.randbelow(num_tasks)
        raise ProtocolError(f"reset needs the task under one of {task_fields}")

    def actions_of(obs: Observation) -> list[str] | None:
        return None if obs.admissible_actions is None else list(obs.admissible_actions)

    def do_create(body: dict) -> Any:
        if dialect == "searchqa" and body.get("id") is not None and (
                isinstance(body["id"], bool) or not isinstance(body["id"], int)):
            raise ProtocolError(f"create's id must be an integer, got {short(body['id'])}")
        idx = host.create()
        return {"id": idx} if id_field == "id" else idx

    def do_reset(body: dict) -> Any:
        idx = body.get(id_field)
        if dialect == "alfworld":
            world_type = body.get("world_type", "Text")
            if world_type not in ag.ALFWORLD_WORLD_TYPES:
                raise ProtocolError(f"world_type must be one of {ag.ALFWORLD_WORLD_TYPES}, "
                                     f"got {short(world_type)}")
        task = task_of(body)
        obs = host.reset(idx, task)
        if dialect == "id":
            return {"id": idx, "observation": obs.text, "reward": 0.0, "done": False,
                    **_observation_fields(obs)}
        if dialect == "env_idx":
            return [obs.text, _observation_fields(obs)]
        slot = host.slot(idx)
        if dialect == "alfworld":
            text = slot.shown = ag.alfworld_reset_text(obs)
            task_type = getattr(slot.env, "task_type", None)
            slot.detail = {"world_type": world_type, "game": task, "observation": text,
                           "available_actions": actions_of(obs) or [], "done": False,
                           "reward": 0, "deleted": False}
            return {"id": idx, "observation": text, "available_actions": actions_of(obs) or [],
                    "task_type": "" if task_type is None else str(task_type)}
        if dialect == "webshop":
            slot.shown = ag.webshop_page(obs)
            return [slot.shown, None]
        slot.shown = ag.searchqa_prompt(obs.task or obs.text)  # searchqa
        slot.detail = {"task": task, "history": []}  # to replay after a wrong answer
        return slot.shown

    def check_action(action: Any) -> None:
        if isinstance(action, str) and len(action) > max_action_chars:
            raise ProtocolError(f"action is {len(action)} characters; the limit is "
                                 f"max_action_chars={max_action_chars}")

    def do_step(body: dict) -> Any:
        action, idx = body.get("action"), body.get(id_field)
        check_action(action)
        if dialect == "searchqa":
            return searchqa_step(idx, action)
        obs, reward, done, truncated, step_info = host.step(idx, action)
        if native:
            return {obs_key: obs.text, "reward": reward, "done": done or truncated,
                    "truncated": truncated, "info": _jsonable(step_info),
                    **_observation_fields(obs)}
        slot = host.slot(idx)
        if dialect == "alfworld":
            slot.shown = obs.text
            payload = {"observation": obs.text, "reward": reward,
                       "available_actions": actions_of(obs) or [], "done": done or truncated}
            slot.detail.update(payload)
            return payload
        # webshop: an invalid action leaves the page as it was, as in WebShop.
        if step_info.get("valid", True) or done or truncated:
            slot.shown = ag.webshop_page(obs)
        return {"state": slot.shown, "reward": reward, "done": done or truncated, "info": None}

    def searchqa_step(idx: Any, action: Any) -> Any:
        """SearchQA's step: the action's tag played as the simulator's action.
        A text without a tag is played as the empty action (invalid, the state
        unchanged). A wrong answer lets the agent try again, as in the original:
        the simulator is reset and its searches replayed (it is deterministic),
        so only a right answer (or the step limit) ends the episode."""
        if not isinstance(action, str):
            raise ProtocolError(f"action must be a string, got {short(action)}")
        mapped = ag.searchqa_action(action)
        tag, simulator_action = mapped if mapped is not None else ("", "")
        obs, reward, done, truncated, step_info = host.step(idx, simulator_action)
        slot = host.slot(idx)
        if not tag:
            return {"observation": ag.SEARCHQA_INVALID, "reward": 0.0, "done": done or truncated,
                    "info": None}
        if tag != "answer":
            slot.detail["history"].append(simulator_action)
            return {"observation": f"<information>{obs.text}</information>", "reward": reward,
                    "done": done or truncated, "info": None}
        if step_info.get("won"):
            return {"observation": ag.SEARCHQA_CORRECT, "reward": reward, "done": True,
                    "info": None}
        steps = slot.steps
        finished = limit is not None and steps >= limit
        if not finished:
            host.reset(idx, slot.detail["task"])
            for earlier in slot.detail["history"]:
                host.step(idx, earlier)
            slot.steps = steps
        return {"observation": ag.SEARCHQA_WRONG, "reward": reward, "done": finished,
                "info": None}

    def do_observation(body: dict) -> Any:
        idx = body.get(id_field)
        obs = host.observation(idx)
        return obs.text if native else host.slot(idx).shown

    def do_available_actions(body: dict) -> Any:
        obs = host.observation(body.get(id_field))
        if dialect == "webshop":
            return ag.webshop_available_actions(obs.admissible_actions)
        if dialect == "searchqa":  # in the tags its /step reads
            return [ag.searchqa_tagged(action) for action in actions_of(obs) or []]
        return actions_of(obs) if native else actions_of(obs) or []

    def do_close(body: dict) -> Any:
        if dialect == "searchqa":
            try:
                host.close(body.get(id_field))
            except ProtocolError:
                return False  # SearchQA's server answers false for an unknown id
            return True
        host.close(body.get(id_field))
        return {"closed": True} if dialect == "webshop" else True

    routes = {"/create": ("POST", do_create), "/reset": ("POST", do_reset),
              "/step": ("POST", do_step), "/observation": ("GET", do_observation),
              "/available_actions": ("GET", do_available_actions),
              "/close": ("POST", do_close)}
    if dialect == "alfworld":
        def do_detail(body: dict) -> Any:
            host.observation(body.get(id_field))
            return host.slot(body.get(id_field)).detail
        routes["/detail"] = ("GET", do_detail)

    if dialect == "webshop":
        def do_state(body: dict) -> Any:
            obs = host.observation(body.get(id_field))
            page = str(obs.anchor).split("|", 1)[0]
            return {"url": f"stepcredit://{info['name']}/{page}",
                    "html": host.slot(body.get(id_field)).shown,
                    "instruction_text": obs.task}
        routes["/instruction_text"] = ("GET", lambda body: (
            f"Instruction: {host.observation(body.get(id_field)).task}"))
        routes["/state"] = ("GET", do_state)

        @app.get("/list_envs")
        async def list_envs():
            return host.ids()

    @app.get("/info")
    async def server_info():
        return info

    @app.get("/stats")
    async def stats():
        return {"envs": len(host), "expired": host.expired_total, "boot": boot,
                "requests": dict(requests)}

    # Added innermost first: every request is counted and identified, and
    # only then answered as a protocol endpoint or passed to FastAPI.
    app.add_middleware(http_asgi.Endpoints, routes=routes, max_body_bytes=max_body_bytes,
                       loud=loud)
    app.add_middleware(http_asgi.CountAndIdentify, boot=boot, requests=requests)
    return app


def resolve_env_factory(spec: str, env_kwargs: Mapping[str, Any] | None = None) -> EnvFactory:
    """Turns an environment spec into a factory of fresh environments.

    Args:
      spec: a name known to `stepcredit.envs.registry` (e.g. "webshop"), or
        "module.path:callable" naming any importable callable that returns an
        `Env` (your own environment).
      env_kwargs: keyword arguments passed to the registry or the callable.

    Returns:
      A zero-argument callable returning a new environment.

    Raises:
      ValueError: the spec names no importable callable.
    """
    kwargs = dict(env_kwargs or {})
    if ":" in spec:
        module_name, _, attr = spec.partition(":")
        try:
            target = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"env spec {spec!r}: cannot import {attr!r} from {module_name!r}: "
                             f"{e}") from e
        if not callable(target):
            raise ValueError(f"env spec {spec!r} names {type(target).__name__}, not a callable")
        return lambda: target(**kwargs)
    from stepcredit.envs import registry

    if spec not in registry.names():
        raise ValueError(f"env spec {spec!r}: not a registered environment "
                         f"({', '.join(registry.names())}) nor 'module:callable'")
    return lambda: registry.make(spec, **kwargs)


def _timed_protocol(header_timeout_s: float, body_timeout_s: float) -> type:
    """uvicorn's httptools protocol with read deadlines, which uvicorn lacks.

    A connection is closed (and one line logged) when a request's headers do
    not arrive within `header_timeout_s` of the connection's start or of their
    first byte, or its body within `body_timeout_s` of its headers. Between
    requests, uvicorn's keep-alive timeout closes idle connections.

    httptools (a C parser) rather than uvicorn's default h11 (pure Python),
    whose parsing and response framing cost about as much as the rest of a
    request together.
    """
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class TimedHttpToolsProtocol(HttpToolsProtocol):
        _phase: str | None = None
        _timer: Any = None
        # What the parser last saw of the request being received: its first
        # byte ("headers"), its headers ("body"), or all of it (None).
        _receiving: str | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm("headers")

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            self._arm(self._receiving)

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._receiving = "headers"

        def on_headers_complete(self) -> None:
            super().on_headers_complete()
            self._receiving = "body"

        def on_message_complete(self) -> None:
            super().on_message_complete()
            self._receiving = None

        def on_response_complete(self) -> None:
            super().on_response_complete()
            # Idle between requests (headers not begun): keep-alive's business.
            self._arm("body" if self._receiving == "body" else None)

        def connection_lost(self, exc) -> None:
            self._arm(None)
            super().connection_lost(exc)

        def _arm(self, phase: str | None) -> None:
            if phase == self._phase:
                return
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            self._phase = phase
            if phase is not None:
                limit = header_timeout_s if phase == "headers" else body_timeout_s
                self._timer = self.loop.call_later(limit, self._cut_off, phase, limit)

        def _cut_off(self, phase: str, limit: float) -> None:
            self._timer = None
            if not self.transport.is_closing():
                peer = "%s:%d" % self.client if self.client else "?"
                _log.warning("closed the connection from %s: its request %s did not arrive "
                             "within %g s", peer, phase, limit)
                self.transport.close()

    return TimedHttpToolsProtocol


def build_server(app: Any, *, host: str = "127.0.0.1", port: int = 8000,
                 header_timeout_s: float = HEADER_TIMEOUT_S,
                 body_timeout_s: float = BODY_TIMEOUT_S, log_level: str = "warning"):
    """A `uvicorn.Server` for `app` that cuts off slow requests.

    Args:
      app: the ASGI app, e.g. from `create_app`.
      host, port, log_level: see `serve`.
      header_timeout_s: a connection whose request headers take longer (from
        its start or their first byte) is closed; default 10 s.
      body_timeout_s: a connection whose request body takes longer after its
        headers (e.g. it announced more than it sends) is closed; default 30 s.

    Returns:
      The server: `.run()` serves until `.should_exit` is set (blocks; it may
      run in a thread, then without signal handlers).
    """
    import uvicorn

    for name, value in (("header_timeout_s", header_timeout_s),
                        ("body_timeout_s", body_timeout_s)):
        if value <= 0:
            raise ValueError(f"{name} must be > 0, got {value}")
    return uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                         http=_timed_protocol(header_timeout_s, body_timeout_s)))


def serve(env_factory: EnvFactory, *, host: str = "127.0.0.1", port: int = 8000,
          dialect: str = "id", max_envs: int = 1024, idle_timeout_s: float = IDLE_TIMEOUT_S,
          max_body_bytes: int = MAX_BODY_BYTES, max_action_chars: int = MAX_ACTION_CHARS,
          max_steps: int | None = None, header_timeout_s: float = HEADER_TIMEOUT_S,
          body_timeout_s: float = BODY_TIMEOUT_S, log_level: str = "warning") -> None:
    """Serves `env_factory`'s environments until interrupted (blocks).

    Args:
      env_factory: see `create_app`.
      host: the interface to bind; 0.0.0.0 exposes the server to the network.
      port: the TCP port (AgentGym's servers default to 8000).
      dialect: "id", "env_idx", "alfworld", "webshop" or "searchqa", see `create_app`.
      max_envs, idle_timeout_s, max_body_bytes, max_action_chars, max_steps: see
        `create_app`.
      header_timeout_s, body_timeout_s: see `build_server`.
      log_level: uvicorn's log level.
    """
    app = create_app(env_factory, dialect=dialect, max_envs=max_envs,
                     idle_timeout_s=idle_timeout_s, max_body_bytes=max_body_bytes,
                     max_action_chars=max_action_chars, max_steps=max_steps)
    build_server(app, host=host, port=port, header_timeout_s=header_timeout_s,
                 body_timeout_s=body_timeout_s, log_level=log_level).run()


def free_port(host: str = "127.0.0.1") -> int:
    """Returns a TCP port on `host` that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class ServerProcess:
    """A `stepcredit serve` subprocess; a context manager that stops it on exit.

    Attributes:
      url: the base URL, e.g. "http://127.0.0.1:40123".
      process: the `subprocess.Popen` handle.
    """

    def __init__(self, process: subprocess.Popen, url: str, log: Any):
        self.process = process
        self.url = url
        self._log = log

    def log_text(self) -> str:
        """Returns what the server wrote to stderr so far."""
        self._log.seek(0)
        return self._log.read().decode(errors="replace")

    def kill(self) -> None:
        """Kills the server at once (SIGKILL), as a crash would."""
        self.process.kill()
        self.process.wait()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stops the server (SIGTERM, then SIGKILL after `timeout_s`)."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
        self._log.close()

    def __enter__(self) -> "ServerProcess":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def start_server_process(env: str, *, env_kwargs: Mapping[str, Any] | None = None,
                         dialect: str = "id", host: str = "127.0.0.1", port: int | None = None,
                         pythonpath: Sequence[str] = (), options: Sequence[str] = (),
                         cwd: str | None = None, ready_timeout_s: float = 30.0,
                         attempts: int = 3) -> ServerProcess:
    """Starts `python -m stepcredit.serve` in a subprocess and waits until it answers.

    Args:
      env: the environment spec, see `resolve_env_factory`.
      env_kwargs: keyword arguments for the environment (sent as JSON).
      dialect: a `create_app` dialect.
      host: the interface to bind.
      port: the port; None picks a free one (retried on a lost race).
      pythonpath: directories prepended to the child's PYTHONPATH, where a
        "module:callable" spec lives (e.g. a test directory).
      options: further `stepcredit serve` options, e.g. `("--idle-timeout-s", "60")`.
      cwd: the child's working directory (None: this one); `python -m` imports
        `stepcredit` from there first, so a checkout of another revision serves
        that revision's code (as benchmarks/server_load.py's baseline).
      ready_timeout_s: how long to wait for `GET /info` to answer.
      attempts: how many free ports to try when `port` is None.

    Returns:
      The running `ServerProcess`.

    Raises:
      RuntimeError: the server exited or did not answer in time; the message
        holds its stderr.
    """
    import httpx

    child_env = dict(os.environ)
    if pythonpath:
        child_env["PYTHONPATH"] = os.pathsep.join(
            [*pythonpath, *filter(None, [child_env.get("PYTHONPATH")])])
    failure = ""
    for _ in range(attempts if port is None else 1):
        chosen = free_port(host) if port is None else port
        log = tempfile.TemporaryFile()
        cmd = [sys.executable, "-m", "stepcredit.serve", "--env", env,
               "--env-kwargs", json.dumps(dict(env_kwargs or {})), "--dialect", dialect,
               "--host", host, "--port", str(chosen), *options]
        server = ServerProcess(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log,
                                                env=child_env, cwd=cwd), f"http://{host}:{chosen}", log)
        deadline = time.monotonic() + ready_timeout_s
        while time.monotonic() < deadline and server.process.poll() is None:
            try:
                if httpx.get(f"{server.url}/info", timeout=1.0).status_code == 200:
                    return server
            except httpx.TransportError:
                time.sleep(0.05)
        failure = server.log_text()
        server.stop()
    raise RuntimeError(f"stepcredit serve --env {env} did not start within {ready_timeout_s} s; "
                       f"its stderr:\n{failure}")
