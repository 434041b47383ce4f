"""The `stepcredit` command line: one entry point, one module per subcommand.

Each subcommand lives in its own module exposing `HELP` (one line),
`add_arguments(parser)` and `run(args) -> int`; the module is imported only when
its subcommand runs, so `stepcredit --help` stays fast.

Every subcommand takes `--import MODULE` (repeatable): the module is imported
before the command runs, so estimators and environments it registers
(`stepcredit.advantages.register`, `stepcredit.envs.registry.register`) can
be named like the built-in ones.
"""

from __future__ import annotations

import argparse
import importlib
import sys

_SUBCOMMANDS = {
    "demo": "stepcredit.demo",
    "serve": "stepcredit.serve",
    "train": "stepcredit.train.train_command",
    "eval": "stepcredit.train.eval_command",
    "credit": "stepcredit.credit_cli",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="stepcredit",
        description="Step-level credit assignment for agentic RL of language models.")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module_name in _SUBCOMMANDS.items():
        module = importlib.import_module(module_name)
        sub = subparsers.add_parser(name, help=module.HELP, description=module.HELP)
        module.add_arguments(sub)
        sub.add_argument("--import", dest="imports", action="append", default=[],
                         metavar="MODULE",
                         help="import MODULE first, e.g. one that registers an estimator or an "
                              "environment (repeatable)")
        sub.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    for module in args.imports:
        try:
            importlib.import_module(module)
        except ImportError as error:
            raise SystemExit(f"stepcredit {args.command}: --import {module}: {error}") from None
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
