"""An in-process stand-in for real AgentGym servers, on the standard library.

Each route is a function of the decoded JSON body (or query) returning
`(status, payload)`; the server counts requests per path and the most
requests in flight at once, so tests can check retries and concurrency.
"""

from __future__ import annotations

import collections
import http.server
import json
import threading
import urllib.parse
from typing import Any, Callable

Route = Callable[[dict], tuple[int, Any]]


class _QuietServer(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a client that timed out before the answer: expected in the fault tests


class FakeServer:
    """A threaded HTTP server on 127.0.0.1 serving `routes` ("POST /step" -> Route)."""

    def __init__(self, routes: dict[str, Route]):
        self.routes = routes
        self.requests: collections.Counter[str] = collections.Counter()
        self.in_flight = self.max_in_flight = 0
        self._lock = threading.Lock()
        fake = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def _serve(self, method: str) -> None:
                parsed = urllib.parse.urlsplit(self.path)
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                body = json.loads(raw) if raw else {}
                for key, values in urllib.parse.parse_qs(parsed.query).items():
                    body[key] = int(values[0]) if values[0].isdigit() else values[0]
                with fake._lock:
                    fake.requests[parsed.path] += 1
                    fake.in_flight += 1
                    fake.max_in_flight = max(fake.max_in_flight, fake.in_flight)
                try:
                    route = fake.routes.get(f"{method} {parsed.path}")
                    status, payload = (404, {"detail": "Not Found"}) if route is None \
                        else route(body)
                finally:
                    with fake._lock:
                        fake.in_flight -= 1
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                self._serve("GET")

            def do_POST(self) -> None:
                self._serve("POST")

            def log_message(self, *args: Any) -> None:
                pass  # keep test output clean

        self._server = _QuietServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> "FakeServer":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._server.shutdown()
        self._server.server_close()
