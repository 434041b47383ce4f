"""The command line's one error style, help on every option, and --version."""

import argparse
import subprocess
import sys

import pytest

from stepcredit.cli import build_parser, main
from stepcredit.compilation_cache import DEFAULT_DIRECTORY


def _subparsers():
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices


@pytest.mark.parametrize("argv, message", [
    (["train", "--env", "nosuch"], "unknown environment 'nosuch'; registered: alfworld, hotpotqa, "
                                   "webshop"),
    (["train", "--estimator", "nosuch"], "unknown estimator 'nosuch'; registered: "),
    (["credit", "--input", "/no/such/log.jsonl", "--estimator", "grpo", "--output", "x.jsonl"],
     "/no/such/log.jsonl"),
    (["credit", "--input", "x.jsonl", "--estimator", "istar", "--output", "y.jsonl"],
     "reads prm_logp, ref_logp, which step rows do not hold"),
    (["eval", "--checkpoint", "/no/such/run"], "--checkpoint: /no/such/run/config.json not found"),
])
def test_a_user_mistake_is_one_line_with_exit_status_2(argv, message, capsys, tmp_path,
                                                       monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith(f"stepcredit {argv[0]}: ") and message in captured.err
    assert captured.err.count("\n") == 1 and "Traceback" not in captured.err


def test_debug_shows_the_traceback_instead():
    with pytest.raises(KeyError, match="unknown estimator 'nosuch'"):
        main(["train", "--estimator", "nosuch", "--debug"])


def test_every_option_has_help_and_the_help_shows_defaults():
    missing = [f"{name} {option}" for name, sub in _subparsers().items()
               for action in sub._actions if action.help is None
               for option in action.option_strings[:1]]
    assert not missing, f"options without help: {missing}"
    text = " ".join(_subparsers()["train"].format_help().split())
    assert "(default: 100)" in text  # --iterations
    # A flag's default is only "not given", and None is explained by the option's help.
    assert "--free-choice" in text and "(default: True)" not in text
    assert "(default: False)" not in text and "(default: None)" not in text
    assert "(default: [])" not in text  # --import, repeatable


def test_the_top_level_help_lists_every_subcommand():
    text = build_parser().format_help()
    assert all(name in text for name in _subparsers())
    assert "95% intervals" in text  # `table`'s one line, its % shown as written


def test_version():
    out = subprocess.run([sys.executable, "-m", "stepcredit.cli", "--version"], check=True,
                         capture_output=True, text=True).stdout
    assert out.startswith("stepcredit ") and out.strip() != "stepcredit"


def test_a_malformed_argument_is_one_line_too(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--set", "lam"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == ("stepcredit train: argument --set: --set 'lam': expected "
                                       "key=value (see stepcredit train --help)\n")



@pytest.mark.parametrize("variable", [None, "", "chosen"])
def test_commands_keep_the_persistent_compilation_cache(monkeypatch, tmp_path, variable):
    import jax

    expected = DEFAULT_DIRECTORY
    if variable is None:
        monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    else:
        expected = str(tmp_path / variable) if variable else DEFAULT_DIRECTORY
        monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / variable) if variable else "")
    before = jax.config.jax_compilation_cache_dir
    try:
        assert main(["table", str(tmp_path / "no-results")]) == 2  # a command ran, and failed
        assert jax.config.jax_compilation_cache_dir == expected
    finally:
        jax.config.update("jax_compilation_cache_dir", before)
