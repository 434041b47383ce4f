"""What the environment server's layers share: the boot header, the protocol's
refusals and the quoting of bad values in its one-line messages.

`http_server` (the app, the hosting of environments) and `http_asgi` (the
endpoints in front of it) both import this module, and the client reads the
boot header from it, so that neither server module imports the other at load.
"""

from typing import Any

# The response header naming the server's start (and the request header that
# names the start a client expects); AgentGym clients ignore unknown headers.
BOOT_HEADER = "X-Stepcredit-Boot"


class ProtocolError(Exception):
    """A client's mistake, which the protocol refuses: answered as `{"error":
    message}` and logged in one line."""


class TooLarge(ProtocolError):
    """A request body over `max_body_bytes`: answered with HTTP 413."""


def short(value: Any, limit: int = 60) -> str:
    """The repr of `value`, cut to `limit` characters, for quoting in a message."""
    return clip(repr(value), limit)


def clip(text: str, limit: int = 200) -> str:
    """`text` cut to `limit` characters, saying how long it was."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"
