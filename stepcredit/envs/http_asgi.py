"""The plain ASGI layer in front of `stepcredit serve`'s FastAPI app.

The protocol's endpoints (`/create`, `/reset`, `/step`, ...) are answered here,
as ASGI middleware, rather than as FastAPI routes: FastAPI's per-request work
(its middleware stack, routing, dependency solving, request objects and value
encoding) cost several times what a request to an embedded simulator needs
(see benchmarks/SERVER_LOAD.md). The answers are the same bytes FastAPI sent:
starlette's `JSONResponse` of the same values. Every other path (`/info`,
`/stats`, the docs, FastAPI's 404) falls through to the app.

Imported by `http_server.create_app` only, so that the client's import of
`http_server` does not load starlette.
"""

import asyncio
import collections
import concurrent.futures
import json
import logging
from typing import Any, Callable, Mapping

from starlette.datastructures import QueryParams
from starlette.requests import ClientDisconnect
from starlette.responses import JSONResponse, Response

from stepcredit.envs.http_protocol import BOOT_HEADER, ProtocolError, TooLarge, clip, short

# The server's logger: its one-line messages name the server module, as before this layer.
_log = logging.getLogger("stepcredit.envs.http_server")

Handler = Callable[[dict], Any]

# The threads the handlers run on, shared by the apps of a process as anyio's
# default thread limiter (also 40) is; asyncio's executor hand-off costs a
# fraction of anyio's `to_thread` (its cancel scope, limiter and checkpoints),
# which took a third of a request's time.
_WORKERS = concurrent.futures.ThreadPoolExecutor(40, thread_name_prefix="stepcredit-serve")


def _header(scope: Mapping[str, Any], name: bytes) -> str | None:
    """The first value of request header `name` (lower case), or None."""
    return next((v.decode("latin-1") for k, v in scope["headers"] if k.lower() == name), None)


class CountAndIdentify:
    """ASGI middleware: counts requests per path (for `/stats`), refuses with
    HTTP 409 a request that names another boot in `BOOT_HEADER`, and sends the
    boot id in that header with every answer.

    Plain ASGI rather than `@app.middleware("http")`, whose per-request task
    group and response streaming cost more than the rest of a request.
    """

    def __init__(self, app: Any, boot: str, requests: collections.Counter):
        self._app, self._boot, self._requests = app, boot, requests
        self._header = (BOOT_HEADER.lower().encode(), boot.encode())

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self._app(scope, receive, send)
        # It runs on the event loop thread, so the counter needs no lock.
        self._requests[scope["path"]] += 1
        expected = _header(scope, self._header[0])

        async def send_identified(message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", ()), self._header]
            await send(message)

        if expected is not None and expected != self._boot:
            _log.warning("%s %s: refused a request for boot %s (this server is boot %s)",
                         scope["method"], scope["path"], short(expected), self._boot)
            refusal = JSONResponse(
                {"error": f"the request is for server boot {short(expected)}, but this is boot "
                          f"{self._boot}: the server restarted and the instances of that boot "
                          "are gone"}, status_code=409)
            return await refusal(scope, receive, send_identified)
        await self._app(scope, receive, send_identified)


class Endpoints:
    """ASGI middleware that answers the protocol's endpoints itself.

    Args:
      app: the app that answers every other path.
      routes: path -> (HTTP method, handler). A handler takes the request's
        JSON object (the query's fields added, integers parsed) and returns a
        JSON value; it runs on a worker thread (at most 40 at once), so that
        slow environments do not block the event loop. Another method on a
        route's path is answered 405, as FastAPI would.
      max_body_bytes: a larger body is answered 413 without being read further.
      loud: errors as HTTP error statuses with `{"detail": ...}` (the WebShop
        and SearchQA dialects, whose clients assert a 200) rather than 200
        `{"error": ...}`.
    """

    def __init__(self, app: Any, routes: Mapping[str, tuple[str, Handler]],
                 max_body_bytes: int, loud: bool):
        self._app, self._routes = app, dict(routes)
        self._max_body_bytes, self._loud = max_body_bytes, loud

    async def __call__(self, scope, receive, send) -> None:
        route = self._routes.get(scope["path"]) if scope["type"] == "http" else None
        if route is None:
            return await self._app(scope, receive, send)
        method, handler = route
        if scope["method"] == method:
            response = await self._answer(scope, receive, handler)
        else:
            response = JSONResponse({"detail": "Method Not Allowed"}, status_code=405,
                                    headers={"Allow": method})
        await response(scope, receive, send)

    async def _read_body(self, scope, receive) -> bytes:
        """The request body, refused beyond `max_body_bytes` without reading on."""
        limit = self._max_body_bytes
        declared = _header(scope, b"content-length") or ""
        if declared.isdigit() and int(declared) > limit:
            raise TooLarge(f"the request body has {int(declared)} bytes; the limit is "
                            f"max_body_bytes={limit}")
        raw, more = bytearray(), True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise ClientDisconnect()
            raw += message.get("body", b"")
            more = message.get("more_body", False)
            if len(raw) > limit:
                raise TooLarge(f"the request body has over {limit} bytes; the limit "
                                f"is max_body_bytes={limit}")
        return bytes(raw)

    def _mistake(self, scope, error: Exception) -> None:
        client = "%s:%d" % tuple(scope["client"]) if scope.get("client") else "?"
        _log.warning("%s %s from %s: %s", scope["method"], scope["path"], client,
                     str(error).replace("\n", " "))

    def _failure(self, message: str, status: int) -> Response:
        """An error answer: 200 `{"error": ...}`, or when loud, `{"detail": ...}`
        with the HTTP error `status`."""
        if self._loud:
            return JSONResponse({"detail": message}, status_code=status)
        return JSONResponse({"error": message})

    async def _answer(self, scope, receive, handler: Handler) -> Response:
        """Parses the JSON body (or query), runs `handler` on a worker thread, and
        turns every failure into an error answer (see `_failure`; 413 for a body
        over the limit, after which the connection is closed, as the rest is
        unread)."""
        try:
            raw = await self._read_body(scope, receive)
            try:
                body = json.loads(raw) if raw.strip() else {}
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise ProtocolError(f"the request body is not JSON: {clip(str(e))}") from None
            if not isinstance(body, dict):
                raise ProtocolError(f"the request body must be a JSON object, got {short(raw)}")
            if scope["query_string"]:
                for key, value in QueryParams(scope["query_string"]).items():
                    body.setdefault(key, int(value) if value.lstrip("-").isdigit() else value)
            result = await asyncio.get_running_loop().run_in_executor(_WORKERS, handler, body)
        except TooLarge as e:
            self._mistake(scope, e)
            key = "detail" if self._loud else "error"
            return JSONResponse({key: str(e)}, status_code=413, headers={"Connection": "close"})
        except ProtocolError as e:
            self._mistake(scope, e)
            return self._failure(str(e), 400)
        except ClientDisconnect:  # e.g. closed by the body read timeout; nobody reads this
            return Response(status_code=400)
        except Exception as e:  # an environment's own failure: report it, keep serving
            _log.exception("%s %s failed", scope["method"], scope["path"])
            return self._failure(clip(f"{type(e).__name__}: {e}"), 500)
        return JSONResponse(result)
