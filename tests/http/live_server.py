"""`stepcredit serve`'s uvicorn server in a thread of the test process: starts
in a fraction of the second a subprocess needs, and can be stopped and started
again on the same port (a server restart)."""

from __future__ import annotations

import threading
import time
from typing import Any

from stepcredit.envs.http_server import build_server, free_port


class LiveServer:
    """Serves `app` on 127.0.0.1 (`port`, or a free one) until `stop`; a context manager.

    Attributes:
      url: the base URL.
    """

    def __init__(self, app: Any, port: int | None = None, **server_kwargs: Any):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._server = build_server(app, port=self.port, **server_kwargs)
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 10.0
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server on port {self.port} did not start")
            time.sleep(0.01)

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(10.0)

    def __enter__(self) -> "LiveServer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()
