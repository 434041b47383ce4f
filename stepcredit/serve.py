"""`stepcredit serve`: serves a stepcredit environment over the AgentGym HTTP protocol.

Examples:
  stepcredit serve --env webshop --host 127.0.0.1 --port 36001
  stepcredit serve --env webshop --dialect webshop --port 36003   # for AgentGym's client
  stepcredit serve --env hotpotqa --dialect searchqa --max-steps 10 --port 36005
  stepcredit serve --env stepcredit.envs.textworld_env:TextWorldEnv --port 36002 \
      --dialect env_idx --env-kwargs '{"game_files": ["games/tw1.z8"]}'
"""

from __future__ import annotations

import argparse
import json
import sys

from stepcredit.envs import http_server
from stepcredit.envs.agentgym_dialects import DIALECTS

HELP = "Serve a stepcredit environment over the AgentGym HTTP protocol (FastAPI + uvicorn)."


def _number(kind: type, least: float, inclusive: bool = True, most: float | None = None):
    """An argparse type: a `kind` number >= `least` (> `least` if not inclusive), and at most
    `most` where given."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a {kind.__name__}, got {text!r}") from None
        if value < least or (value == least and not inclusive):
            raise argparse.ArgumentTypeError(
                f"must be {'>=' if inclusive else '>'} {least:g}, got {text}")
        if most is not None and value > most:
            raise argparse.ArgumentTypeError(f"must be <= {most:g}, got {text}")
        return value
    parse.__name__ = kind.__name__
    return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the `serve` options to `parser`."""
    parser.add_argument("--env", required=True,
                        help="a registered environment name, or module.path:callable")
    parser.add_argument("--env-kwargs", default="{}",
                        help="JSON object of keyword arguments for the environment")
    parser.add_argument("--host", default="127.0.0.1",
                        help="interface to bind (0.0.0.0 exposes it to the network)")
    parser.add_argument("--port", type=_number(int, 0, most=65535), default=8000,
                        help="TCP port (AgentGym's default)")
    parser.add_argument("--dialect", choices=DIALECTS, default="id",
                        help="what to answer as: stepcredit's own id (ALFWorld's family) or "
                             "env_idx (WebShop's family), with extra keys for HttpEnv; or "
                             "alfworld, webshop, searchqa: field for field as that original "
                             "AgentGym server, goal text and errors included")
    parser.add_argument("--max-steps", type=_number(int, 0), default=None,
                        help="end an episode (done=true) at this many steps; 0: no limit. "
                             "Default: no limit in the alfworld, webshop and searchqa "
                             "dialects, as the original servers (the client decides how many "
                             "rounds to play); the environment's own limit in id and env_idx")
    parser.add_argument("--max-envs", type=_number(int, 1), default=1024,
                        help="most live environment instances; /create beyond it is refused")
    parser.add_argument("--idle-timeout-s", type=_number(float, 0),
                        default=http_server.IDLE_TIMEOUT_S,
                        help="close an instance that no request named for this many seconds, "
                             "freeing its slot; its id is then answered as expired (0: never)")
    parser.add_argument("--max-body-bytes", type=_number(int, 1),
                        default=http_server.MAX_BODY_BYTES,
                        help="largest request body; a larger one is answered HTTP 413")
    parser.add_argument("--max-action-chars", type=_number(int, 1),
                        default=http_server.MAX_ACTION_CHARS,
                        help="longest action; a longer one is refused without stepping")
    parser.add_argument("--header-timeout-s", type=_number(float, 0, inclusive=False),
                        default=http_server.HEADER_TIMEOUT_S,
                        help="close a connection whose request headers take longer (seconds)")
    parser.add_argument("--body-timeout-s", type=_number(float, 0, inclusive=False),
                        default=http_server.BODY_TIMEOUT_S,
                        help="close a connection whose request body takes longer after its "
                             "headers, e.g. one that announced more than it sends (seconds)")
    parser.add_argument("--log-level", default="warning", help="uvicorn log level")


def run(args: argparse.Namespace) -> int:
    """Serves until interrupted; returns the exit code (2 on a bad argument)."""
    try:
        env_kwargs = json.loads(args.env_kwargs)
        if not isinstance(env_kwargs, dict):
            raise ValueError(f"expected a JSON object, got {args.env_kwargs!r}")
        factory = http_server.resolve_env_factory(args.env, env_kwargs)
        # Builds (and probes) one environment: an unknown keyword fails here, in one line.
        app = http_server.create_app(factory, dialect=args.dialect, max_envs=args.max_envs,
                                     idle_timeout_s=args.idle_timeout_s,
                                     max_body_bytes=args.max_body_bytes,
                                     max_action_chars=args.max_action_chars,
                                     max_steps=args.max_steps)
    except (ValueError, TypeError) as e:  # json.JSONDecodeError is a ValueError
        print(f"stepcredit serve: bad --env/--env-kwargs: {e}", file=sys.stderr)
        return 2
    print(f"stepcredit serve: {args.env} ({args.dialect} dialect) on "
          f"http://{args.host}:{args.port}", flush=True)
    http_server.build_server(app, host=args.host, port=args.port,
                             header_timeout_s=args.header_timeout_s,
                             body_timeout_s=args.body_timeout_s, log_level=args.log_level).run()
    return 0


if __name__ == "__main__":
    # `python -m stepcredit.serve` works without the `stepcredit` entry point
    # (used by http_server.start_server_process).
    from stepcredit.cli import HelpFormatter

    _parser = argparse.ArgumentParser(prog="stepcredit serve", description=HELP,
                                      formatter_class=HelpFormatter)
    add_arguments(_parser)
    sys.exit(run(_parser.parse_args()))
