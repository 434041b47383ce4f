"""`HttpEnv`: an `Env` backed by an AgentGym-style environment server.

One `HttpEnv` is one environment instance on a server (`POST /create` when it
is built, `POST /close` when it is closed). It speaks both AgentGym dialects
through a `ServerSchema` (see `stepcredit.envs.agentgym_schema`) and adds what
a training loop needs from a remote environment:

- errors that servers return as HTTP 200 `{"error": ...}` are errors;
- `done` latching: after the episode ends, `step` raises without sending
  anything (the servers refuse it anyway, and an extra round trip per finished
  sample adds up);
- time bounds: each attempt of a request (its wait for a concurrency slot
  included) within `timeout_s`, construction within one `create_timeout_s`
  deadline, and `close_all` closing many instances in parallel within one
  `close_timeout_s`;
- retries with exponential backoff and jitter on connection errors and 5xx
  answers. A `step` is retried only when the server cannot have applied it
  (the connection was never made, no slot was free, or it answered 503),
  because applying an action twice would corrupt the episode;
- bounded concurrency: every `HttpEnv` talking to one server shares one
  connection pool and one semaphore (`ServerConnection`);
- a server fault in the middle of an episode does not raise: `step` returns a
  truncated `StepResult` whose `info["error"]` holds the fault, so a batch of
  episodes loses only that episode. `reset` and construction do raise
  `HttpEnvError`: there is no episode yet to end;
- closing is tolerant: servers without `/close` (ALFWorld, WebShop, SQLGym)
  are not asked, and a close that fails is logged, never raised;
- server identity: the boot id a `stepcredit serve` server sends (the
  `X-Stepcredit-Boot` header) is recorded at `/create` and sent back with every
  later request. An answer from another boot (the server restarted, or another
  server took its address) ends the episode as truncated with that reason,
  and the instance is never addressed again: its id may name another client's
  instance there. Servers that send no boot id (AgentGym's) are not checked.

Example:
  with HttpEnv("http://127.0.0.1:36001", "alfworld") as env:
      obs = env.reset(0)
      result = env.step(obs.admissible_actions[0])
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import random
import threading
import time
from typing import Any, Hashable, Iterable

import httpx

from stepcredit.envs.agentgym_schema import ServerSchema, get_schema, webshop_actions
from stepcredit.envs.base import Observation, StepResult, as_actions, step_info
from stepcredit.envs.http_protocol import BOOT_HEADER

_log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class HttpConfig:
    """Timeouts, retries and concurrency of an `HttpEnv`.

    Attributes:
      timeout_s: the limit on one attempt of a request: its wait for a
        concurrency slot, then each read or write, within what the wait left
        (default 60 s). AgentGym-RL uses 2400 s because some servers block for
        minutes under load; lower it where a stuck server should cost less.
      connect_timeout_s: the limit on opening a connection (default 5 s).
      close_timeout_s: the limit on `/close`, slot wait included (default
        5 s), kept short so that closing many environments of a dead server
        ends quickly; `close_all` closes many in parallel within it.
      create_timeout_s: the one deadline of construction: `GET /info` and
        `POST /create` with all their attempts, waits for a slot and backoff
        (default 60 s).
      retries: how many times a failed request is retried (0: never).
      backoff_s: the wait before the first retry; it doubles on each retry.
      backoff_max_s: the longest wait between retries.
      max_concurrency: the most requests in flight to one server, over all
        the `HttpEnv`s that share its connection.
    """

    timeout_s: float = 60.0
    connect_timeout_s: float = 5.0
    close_timeout_s: float = 5.0
    create_timeout_s: float = 60.0
    retries: int = 3
    backoff_s: float = 0.5
    backoff_max_s: float = 8.0
    max_concurrency: int = 64

    def __post_init__(self) -> None:
        for field in ("timeout_s", "connect_timeout_s", "close_timeout_s", "create_timeout_s"):
            if getattr(self, field) <= 0:
                raise ValueError(f"HttpConfig.{field} must be > 0, got {getattr(self, field)}")
        if self.retries < 0:
            raise ValueError(f"HttpConfig.retries must be >= 0, got {self.retries}")
        if self.backoff_s < 0 or self.backoff_max_s < self.backoff_s:
            raise ValueError(f"HttpConfig: need 0 <= backoff_s <= backoff_max_s, got "
                             f"backoff_s={self.backoff_s}, backoff_max_s={self.backoff_max_s}")
        if self.max_concurrency < 1:
            raise ValueError(f"HttpConfig.max_concurrency must be >= 1, "
                             f"got {self.max_concurrency}")


class HttpEnvError(RuntimeError):
    """A server failed or refused a request (after any retries).

    Attributes:
      status: the HTTP status of a non-200 answer, else None.
    """

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


class ServerChangedError(HttpEnvError):
    """The server answering is not the one that created the instance (it
    restarted, or another server took its address); the instance is gone."""


class ServerConnection:
    """The connection pool and concurrency limit shared by all `HttpEnv`s of one server.

    Args:
      base_url: the server, e.g. "http://127.0.0.1:36001".
      max_concurrency: the most requests in flight at once; callers beyond it
        wait their turn rather than overload the server.
    """

    def __init__(self, base_url: str, max_concurrency: int = 64):
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
        self.base_url = base_url.rstrip("/")
        self.max_concurrency = max_concurrency
        self.semaphore = threading.BoundedSemaphore(max_concurrency)
        self.client = httpx.Client(limits=httpx.Limits(max_connections=max_concurrency,
                                                       max_keepalive_connections=max_concurrency))

    def close(self) -> None:
        """Closes the pooled connections."""
        self.client.close()


_shared: dict[str, ServerConnection] = {}
_shared_lock = threading.Lock()


def shared_connection(base_url: str, max_concurrency: int = 64) -> ServerConnection:
    """Returns the process-wide `ServerConnection` of `base_url`, creating it once.

    Args:
      base_url: the server.
      max_concurrency: the limit for a new connection; it must match the limit
        of an existing one, so that two callers never believe in different
        bounds on the same server.

    Raises:
      ValueError: the connection exists with another `max_concurrency`.
    """
    key = base_url.rstrip("/")
    with _shared_lock:
        connection = _shared.get(key)
        if connection is None:
            connection = _shared[key] = ServerConnection(key, max_concurrency)
        elif connection.max_concurrency != max_concurrency:
            raise ValueError(f"{key} already has a shared connection with max_concurrency="
                             f"{connection.max_concurrency}, asked for {max_concurrency}; pass a "
                             "ServerConnection explicitly to use another limit")
        return connection


def _freeze(value: Any) -> Hashable:
    """Makes a JSON anchor hashable again (lists become tuples)."""
    if isinstance(value, list):
        return tuple(_freeze(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in value.items()))
    return value


class HttpEnv:
    """One environment instance on an AgentGym-style server (implements `Env`).

    Not thread-safe: use one `HttpEnv` per thread (they share the server's
    connection pool and concurrency limit). No snapshots: the episode lives on
    the server, so it is not a `SnapshotEnv`.

    Args:
      base_url: the server, e.g. "http://127.0.0.1:36001".
      schema: a key of `agentgym_schema.SCHEMAS` ("alfworld", "webshop", ...,
        "stepcredit" for `stepcredit serve`) or a `ServerSchema`.
      max_steps: the step limit, after which an episode is truncated; None
        takes the server's (stepcredit) or the schema's.
      name: the environment name; None takes the server's or the schema's.
      config: timeouts, retries and concurrency.
      connection: the connection to share; None uses the process-wide one of
        `base_url` (see `shared_connection`).

    Raises:
      HttpEnvError: the server could not create an instance within
        `config.create_timeout_s`.
    """

    def __init__(self, base_url: str, schema: str | ServerSchema = "stepcredit", *,
                 max_steps: int | None = None, name: str | None = None,
                 config: HttpConfig = HttpConfig(), connection: ServerConnection | None = None):
        if max_steps is not None and max_steps < 1:
            raise ValueError(f"max_steps must be >= 1 or None, got {max_steps}")
        self.schema = get_schema(schema)
        self.config = config
        self._connection = connection or shared_connection(base_url, config.max_concurrency)
        self._url = base_url.rstrip("/")
        self._closed = False
        self._finished = True  # no episode until the first reset
        self._observation: Observation | None = None
        self._steps = 0
        self._score = 0.0
        self._id: int | None = None
        self._boot: str | None = None  # the creating server's boot id, if it sends one
        self._gone = ""  # why the instance is gone (the server changed), once it is
        deadline = time.monotonic() + config.create_timeout_s
        served = (self._request("GET", "/info", idempotent=True, deadline=deadline)
                  if self.schema.stepcredit_extras else {})
        self.name: str = name or served.get("name", self.schema.name)
        # A server without a step limit answers `max_steps: null`: the schema's applies.
        self.max_steps: int = max_steps or int(served.get("max_steps") or self.schema.max_steps)
        # The task count a stepcredit server reports (None from AgentGym's servers).
        self.num_tasks: int | None = served.get("num_tasks")
        # Retried like an idempotent request: a create that timed out but succeeded
        # leaves an orphan instance on the server, which beats failing a batch.
        created, self._boot = self._request("POST", "/create", json=dict(self.schema.create_body),
                                            idempotent=True, deadline=deadline, with_boot=True)
        created_id = (created.get("id", created.get(self.schema.id_field))
                      if isinstance(created, dict) else created)
        if isinstance(created_id, bool) or not isinstance(created_id, int):
            raise HttpEnvError(f"POST {self._url}/create answered {created!r}; expected an "
                               f"integer id ({self.schema.family} family)")
        self._id = created_id

    # -- Env protocol ---------------------------------------------------------

    def reset(self, task: Any) -> Observation:
        """Starts an episode on `task` (sent as the schema's task field).

        Raises:
          HttpEnvError: the server failed or refused the reset.
          RuntimeError: the environment is closed.
        """
        self._check_open("reset")
        if self._gone:
            raise ServerChangedError(f"HttpEnv.reset: {self._gone}")
        body = {self.schema.id_field: self._id, self.schema.reset_task_field: task,
                **self.schema.reset_extra}
        payload = self._request("POST", "/reset", json=body, idempotent=True)
        text, extras = self._split_reset(payload)
        if self.schema.stepcredit_extras and "anchor" not in extras:
            raise HttpEnvError(f"POST {self._url}/reset answered {str(payload)[:200]!r} without "
                               "the 'anchor' that a stepcredit server sends")
        task_text = extras.get("task") or (
            self._request("GET", self.schema.task_path, idempotent=True)
            if self.schema.task_path else "")
        self._observation = Observation(
            text=text, admissible_actions=self._actions(extras), task=str(task_text),
            anchor=_freeze(extras["anchor"]) if self.schema.stepcredit_extras else text)
        self._steps, self._score, self._finished = 0, 0.0, False
        return self._observation

    def step(self, action: str) -> StepResult:
        """Sends `action`; a server fault ends the episode instead of raising.

        Returns:
          The `StepResult`. On a server fault (after retries): the previous
          observation, reward 0, `truncated=True`, and `info["error"]` holding
          the fault with `info["server_error"] = True`.

        Raises:
          RuntimeError: the episode is over (no request is sent), was never
            reset, or the environment is closed.
        """
        self._check_open("step")
        if self._finished:
            raise RuntimeError(f"HttpEnv.step({action!r}): the episode is over (done, truncated "
                               "or never reset); call reset first")
        try:
            payload = self._request("POST", "/step", json={self.schema.id_field: self._id,
                                                           "action": action}, idempotent=False)
            result = self._parse_step(action, payload)
        except HttpEnvError as e:
            result = self._server_fault(str(e))
        self._observation = result.observation
        self._finished = result.done or result.truncated
        return result

    def close(self) -> None:
        """Releases the server's instance; idempotent, never raises.

        One `/close`, not retried, within `config.close_timeout_s`; a failure is
        logged. To close many environments, `close_all` runs them in parallel.
        """
        failure = self._close(deadline=None)
        if failure:
            _log.warning("HttpEnv.close: %s", failure)

    def _close(self, deadline: float | None) -> str:
        """Sends `/close` once, unless there is nothing to close; returns the
        failure worth reporting, or ""."""
        if self._closed:
            return ""
        self._closed = True
        if self._gone or self._id is None:
            return ""  # a changed server's instance with this id is not ours to close
        try:
            self._request("POST", "/close", json={self.schema.id_field: self._id},
                          idempotent=False, retries=0, timeout_s=self.config.close_timeout_s,
                          deadline=deadline)
        except ServerChangedError:
            pass  # the instance went with the server that created it
        except HttpEnvError as e:
            # The instance may be gone already (a dead server); closing must not
            # turn one fault into many at the end of a batch.
            # 404/405: the server has no /close (AgentGym's ALFWorld, WebShop and SQLGym
            # servers; `stepcredit serve`'s dialects of them have one).
            if e.status not in (404, 405):
                return str(e)
        return ""

    def __enter__(self) -> "HttpEnv":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- parsing --------------------------------------------------------------

    def _split_reset(self, payload: Any) -> tuple[str, dict]:
        """Returns the observation text and the other fields of a reset answer."""
        shape = self.schema.reset_shape
        if shape == "dict" and isinstance(payload, dict) and isinstance(
                payload.get("observation"), str):
            return payload["observation"], payload
        if shape == "pair" and isinstance(payload, list) and payload and isinstance(
                payload[0], str):
            extras = payload[1] if len(payload) > 1 and isinstance(payload[1], dict) else {}
            return payload[0], extras
        if shape == "text" and isinstance(payload, str):
            return payload, {}
        raise HttpEnvError(f"POST {self._url}/reset answered {str(payload)[:200]!r}; the "
                           f"{self.schema.name} schema expects a reset answer shaped {shape!r}")

    def _actions(self, fields: dict) -> tuple[str, ...] | None:
        """The admissible actions, from the answer's fields or the actions endpoint."""
        if self.schema.actions_key is not None:
            return as_actions(fields.get(self.schema.actions_key))
        if self.schema.actions_path is None:
            return None
        available = self._request("GET", self.schema.actions_path, idempotent=True)
        if self.schema.actions_format == "webshop":
            return webshop_actions(available)
        return as_actions(available)

    def _parse_step(self, action: str, payload: Any) -> StepResult:
        """Turns a step answer into a `StepResult`.

        Raises:
          HttpEnvError: the answer lacks a field the schema promises.
        """
        try:
            reward, done, truncated, info, observation = (
                self._read_stepcredit_step(payload) if self.schema.stepcredit_extras
                else self._read_agentgym_step(action, payload))
        except (KeyError, TypeError, ValueError) as e:
            raise HttpEnvError(f"POST {self._url}/step answered {str(payload)[:200]!r}, which the "
                               f"{self.schema.name} schema cannot read: {e!r}") from e
        self._steps += 1
        truncated = truncated or (not done and self._steps >= self.max_steps)
        return StepResult(observation, reward, done, truncated, info)

    def _read_stepcredit_step(self, payload: dict) -> tuple:
        """Reads a `stepcredit serve` answer, which carries the env's own flags and info."""
        truncated = bool(payload.get("truncated", False))
        # The server sets `done` on truncation too, for AgentGym clients.
        done = bool(payload["done"]) and not truncated
        reward = float(payload["reward"])
        info = dict(payload.get("info") or {})
        self._score = float(info.get("score", self._score + reward))
        observation = Observation(payload[self.schema.step_observation_key],
                                  as_actions(payload.get("available_actions")),
                                  _freeze(payload["anchor"]),
                                  payload.get("task", self._observation.task))
        return reward, done, truncated, info, observation

    def _read_agentgym_step(self, action: str, payload: dict) -> tuple:
        """Reads an AgentGym server's answer, deriving reward, score and validity."""
        schema, previous = self.schema, self._observation
        text = str(payload[schema.step_observation_key])
        done = bool(payload["done"])
        if schema.reward_from == "score_delta":
            score = float(payload["score"]) / schema.score_scale
            reward, self._score = score - self._score, score
        else:
            reward = float(payload.get("reward") or 0.0)
            self._score = (float(payload["score"]) / schema.score_scale if "score" in payload
                           else self._score + reward)
        # Real servers do not say whether an action was admissible; they answer an
        # inadmissible one in the observation ("Nothing happens."). Judge it
        # against the last list of admissible actions when there is one.
        valid = previous.admissible_actions is None or action in previous.admissible_actions
        info = step_info(valid=valid, won=done and self._score >= schema.won_at,
                         score=self._score, error="" if valid else text)
        actions = None if done else self._actions(payload)
        return reward, done, False, info, Observation(text, actions, text, previous.task)

    def _server_fault(self, message: str) -> StepResult:
        """Ends the episode on a server fault: truncated (the state was cut off,
        not terminal) and `valid=True`, since the fault is not the policy's and
        must not draw an invalid-action penalty."""
        return StepResult(self._observation, 0.0, False, True,
                          step_info(valid=True, won=False, score=self._score, error=message,
                                    server_error=True))

    # -- transport ------------------------------------------------------------

    def _check_open(self, method: str) -> None:
        if self._closed:
            raise RuntimeError(f"HttpEnv.{method}: the environment is closed")

    def _backoff(self, attempt: int, deadline: float | None) -> bool:
        """Sleeps before retry `attempt + 1`; False (no sleep) if the retry
        would start after `deadline`."""
        # Jitter spreads the retries of many clients that failed together.
        delay = min(self.config.backoff_max_s, self.config.backoff_s * 2 ** attempt)
        delay *= random.uniform(0.5, 1.0)
        if deadline is not None and time.monotonic() + delay >= deadline:
            return False
        time.sleep(delay)
        return True

    def _send(self, method: str, url: str, end: float, **kwargs: Any) -> httpx.Response:
        """One attempt, which ends by `end` (monotonic seconds): waits for a
        concurrency slot, then sends with the time left as its timeouts.

        Raises:
          httpx.PoolTimeout: no slot was free in time (nothing was sent).
        """
        connection = self._connection
        if not connection.semaphore.acquire(timeout=max(0.0, end - time.monotonic())):
            raise httpx.PoolTimeout(f"no concurrency slot free in time (max_concurrency="
                                    f"{connection.max_concurrency} requests in flight)")
        try:
            left = end - time.monotonic()
            if left <= 0:
                raise httpx.PoolTimeout("no time left to send after waiting for a slot")
            timeout = httpx.Timeout(left, connect=min(self.config.connect_timeout_s, left))
            return connection.client.request(method, url, timeout=timeout, **kwargs)
        finally:
            connection.semaphore.release()

    def _request(self, method: str, path: str, *, json: Any = None, idempotent: bool,
                 retries: int | None = None, timeout_s: float | None = None,
                 deadline: float | None = None, with_boot: bool = False) -> Any:
        """Sends one request (with retries) and returns its decoded JSON answer.

        Args:
          method: "GET" or "POST".
          path: the endpoint; GETs carry the instance id as a query parameter.
          json: the POST body.
          idempotent: whether a repeat is harmless; if not, only failures that
            prove the server never saw the request (no connection, no slot,
            503) are retried.
          retries: overrides `config.retries`.
          timeout_s: overrides `config.timeout_s`, the limit on each attempt.
          deadline: a monotonic time by which all attempts end (no retry starts
            after it), or None.
          with_boot: return `(payload, boot id)` (None if the server sends none).

        Raises:
          ServerChangedError: the answer came from another server than the one
            that created the instance; the instance is then gone for good.
          HttpEnvError: the request failed after all retries (or at the
            deadline), the answer was not HTTP 200 JSON, or it carried an
            `error` key.
        """
        url = f"{self._url}{path}"
        params = ({self.schema.id_field: self._id}
                  if method == "GET" and self._id is not None else None)
        headers = {BOOT_HEADER: self._boot} if self._boot else None
        retries = self.config.retries if retries is None else retries
        limit = self.config.timeout_s if timeout_s is None else timeout_s
        attempt = 0
        while True:
            end = time.monotonic() + limit
            try:
                response = self._send(method, url, end if deadline is None else min(end, deadline),
                                      json=json, params=params, headers=headers)
            except httpx.RequestError as e:
                unsent = isinstance(e, (httpx.ConnectError, httpx.ConnectTimeout,
                                        httpx.PoolTimeout))
                if attempt < retries and (idempotent or unsent):
                    if self._backoff(attempt, deadline):
                        attempt += 1
                        continue
                    cut = " (its deadline cut the retries)"
                else:
                    cut = ""
                raise HttpEnvError(f"{method} {url} failed after {attempt + 1} attempt(s){cut}: "
                                   f"{type(e).__name__}: {e}") from e
            boot = response.headers.get(BOOT_HEADER)
            if self._id is not None and (boot != self._boot if boot is not None else
                                         self._boot is not None and response.status_code == 200):
                self._gone = (f"{self._url} is not the server that created instance {self._id} "
                              f"(boot {self._boot}, now {boot}): it restarted or was replaced, "
                              "and the instance is gone")
                raise ServerChangedError(f"{method} {url}: {self._gone}", response.status_code)
            if response.status_code >= 500 and attempt < retries and (
                    idempotent or response.status_code == 503) and self._backoff(attempt, deadline):
                attempt += 1
                continue
            if response.status_code != 200:
                raise HttpEnvError(f"{method} {url} answered HTTP {response.status_code}: "
                                   f"{response.text[:200]!r}", status=response.status_code)
            try:
                payload = response.json()
            except ValueError as e:
                raise HttpEnvError(f"{method} {url} answered non-JSON: "
                                   f"{response.text[:200]!r}") from e
            if isinstance(payload, dict) and payload.get("error"):
                raise HttpEnvError(f"{method} {url}: the server reports: {payload['error']}")
            return (payload, boot) if with_boot else payload


def close_all(envs: Iterable[HttpEnv], timeout_s: float | None = None) -> None:
    """Closes many `HttpEnv`s at once; never raises on a server's failure (only on a bad
    `timeout_s`).

    Their `/close` requests run in parallel, as many at a time as each
    server's `max_concurrency` allows, and all within `timeout_s` (default:
    the longest `close_timeout_s` among them): closing N instances of a server
    that stopped answering costs one `close_timeout_s`, not N of them. A close
    that gets no slot in time is given up (`stepcredit serve` expires idle
    instances). The failures are logged in one line.

    Args:
      envs: the environments; closed ones are skipped.
      timeout_s: the bound on the whole call, or None for the default.
    """
    envs = list(dict.fromkeys(envs))  # each once, in order
    if not envs:
        return
    if timeout_s is not None and timeout_s <= 0:
        raise ValueError(f"close_all: timeout_s must be > 0 or None, got {timeout_s}")
    bound = timeout_s or max(env.config.close_timeout_s for env in envs)
    deadline = time.monotonic() + bound
    connections = {id(env._connection): env._connection for env in envs}
    workers = min(len(envs), sum(c.max_concurrency for c in connections.values()), 256)
    with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="close_all") as pool:
        failures = [f for f in pool.map(lambda env: env._close(deadline), envs) if f]
    if failures:
        _log.warning("close_all: %d of %d instance(s) not confirmed closed within %g s; "
                     "the first: %s", len(failures), len(envs), bound, failures[0])
