"""The `stepcredit` command line: one entry point, one module per subcommand.

Each subcommand lives in its own module exposing `HELP` (one line),
`add_arguments(parser)` and `run(args) -> int`; the module is imported only when
its subcommand runs, so `stepcredit --help` stays fast.

A user's mistake (a bad argument or record, an unknown name, a missing or
unwritable file) ends the command with one line on stderr naming what was
wrong, and exit status 2; `--debug` shows the traceback instead. Real faults
keep their tracebacks.

Every subcommand takes `--import MODULE` (repeatable): the module is imported
before the command runs, so estimators and environments it registers
(`stepcredit.advantages.register`, `stepcredit.envs.registry.register`) can
be named like the built-in ones.

Every command keeps JAX's persistent compilation cache
(`stepcredit.compilation_cache`): a later run with the same shapes reads its
compiled programs back instead of compiling them again.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import sys

from stepcredit.compilation_cache import use_compilation_cache

_SUBCOMMANDS = {
    "demo": "stepcredit.demo",
    "serve": "stepcredit.serve",
    "train": "stepcredit.train.train_command",
    "eval": "stepcredit.train.eval_command",
    "credit": "stepcredit.credit_cli",
    "diagnose": "stepcredit.diagnose_cli",
    "sweep": "stepcredit.study.sweep_cli",
    "table": "stepcredit.study.table_cli",
    "reproduce": "stepcredit.study.reproduce_cli",
}


# Exceptions that report a user's mistake; their message is the one line shown.
USER_ERRORS = (ValueError, KeyError, FileNotFoundError, FileExistsError, PermissionError,
               IsADirectoryError, NotADirectoryError)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows an option's default where it has one to show: not for a flag, whose
    default is only "not given", nor for None or a repeatable option's empty list,
    which the option's help explains."""

    def _get_help_string(self, action):
        if action.nargs == 0 or action.default is None or action.default == []:
            return action.help
        return super()._get_help_string(action)


class _Parser(argparse.ArgumentParser):
    """argparse, with a bad argument reported in one line instead of the usage block."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="stepcredit",
        description="Step-level credit assignment for agentic RL of language models.")
    parser.add_argument("--version", action="version",
                        version=f"stepcredit {importlib.metadata.version('stepcredit')}")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module_name in _SUBCOMMANDS.items():
        module = importlib.import_module(module_name)
        # argparse %-formats the help it lists ("95% intervals" would raise); not the description.
        sub = subparsers.add_parser(name, help=module.HELP.replace("%", "%%"),
                                    description=module.HELP, formatter_class=HelpFormatter)
        module.add_arguments(sub)
        sub.add_argument("--debug", action="store_true",
                         help="show the traceback of an error instead of one line")
        sub.add_argument("--import", dest="imports", action="append", default=[],
                         metavar="MODULE",
                         help="import MODULE first, e.g. one that registers an estimator or an "
                              "environment (repeatable)")
        sub.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Runs one subcommand; returns its exit status (2 for a user's mistake)."""
    args = build_parser().parse_args(argv)
    use_compilation_cache()
    try:
        for module in args.imports:
            try:
                importlib.import_module(module)
            except ImportError as error:
                raise ValueError(f"--import {module}: {error}") from None
        return int(args._run(args) or 0)
    except USER_ERRORS as error:
        if args.debug:
            raise
        print(f"stepcredit {args.command}: {_message(error)}", file=sys.stderr)
        return 2


def _message(error: BaseException) -> str:
    """One line: a KeyError's message without its quotes, a path error with its path."""
    if isinstance(error, KeyError) and error.args:
        text = str(error.args[0])
    elif isinstance(error, OSError) and error.filename is not None:
        text = f"{error.filename}: {error.strerror or error}"
    else:
        text = str(error) or type(error).__name__
    return " ".join(text.split())


if __name__ == "__main__":
    sys.exit(main())
