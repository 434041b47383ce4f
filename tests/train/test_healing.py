"""Resume heals what a kill or a bad disk leaves, and a log directory is never mixed.

A damaged latest checkpoint is reported in one line and the one before it is
used; a half-written last metrics line is dropped with a note; a directory
that holds a run is refused without --resume or --overwrite; --resume names
every setting that differs from the saved run's.
"""

import json
import os

import pytest

from stepcredit.cli import main
from stepcredit.train.metrics import read_metrics
from tests.train.test_trainer import TINY

RUN = ["train", "--env", "alfworld", "--estimator", "grpo", *TINY]


def run(logdir, *extra) -> int:
    return main([*RUN, "--logdir", str(logdir), *extra])


def damage(checkpoint_dir) -> None:
    """Truncates the largest array file of a checkpoint, as a failing disk would."""
    files = [os.path.join(d, f) for d, _, fs in os.walk(checkpoint_dir) for f in fs
             if os.sep + "d" + os.sep in os.path.join(d, f)]
    largest = max(files, key=os.path.getsize)
    with open(largest, "r+b") as f:
        f.truncate(os.path.getsize(largest) // 2)


@pytest.fixture(scope="module")
def two_iterations(tmp_path_factory):
    logdir = tmp_path_factory.mktemp("run")
    assert run(logdir, "--iterations", "2") == 0
    return logdir


def copy(source, tmp_path):
    import shutil

    target = tmp_path / "copy"
    shutil.copytree(source, target)
    return target


def test_a_damaged_latest_checkpoint_falls_back_to_the_one_before(two_iterations, tmp_path,
                                                                 capsys):
    logdir = copy(two_iterations, tmp_path)
    damage(logdir / "checkpoints" / "2")
    capsys.readouterr()
    assert run(logdir, "--iterations", "3", "--resume") == 0
    out = capsys.readouterr().out
    note = [line for line in out.splitlines() if "is damaged" in line]
    assert len(note) == 1 and "checkpoint 2 in" in note[0] and "moved to" in note[0]
    assert "Traceback" not in out
    # Resumed at iteration 1 (the intact checkpoint 1): iterations 1 and 2 ran again, once each.
    assert [r["iteration"] for r in read_metrics(str(logdir))] == [0, 1, 2]
    assert (logdir / "checkpoints" / "2.damaged").is_dir()  # kept, not deleted
    assert (logdir / "checkpoints" / "3").is_dir()


def test_no_intact_checkpoint_is_one_line(two_iterations, tmp_path, capsys):
    logdir = copy(two_iterations, tmp_path)
    for step in ("1", "2"):
        damage(logdir / "checkpoints" / step)
    capsys.readouterr()
    assert run(logdir, "--iterations", "3", "--resume") == 2
    err = capsys.readouterr().err
    assert err.startswith("stepcredit train: every checkpoint in") and err.count("\n") == 1


def test_a_partial_last_metrics_line_is_dropped_with_a_note(two_iterations, tmp_path, capsys):
    logdir = copy(two_iterations, tmp_path)
    with open(logdir / "metrics.jsonl", "a", encoding="utf-8") as f:
        f.write('{"iteration": 2, "rollout/succ')  # what a kill mid-write leaves
    assert [r["iteration"] for r in read_metrics(str(logdir))] == [0, 1]
    capsys.readouterr()
    assert run(logdir, "--iterations", "3", "--resume") == 0
    assert "dropped a partial last line" in capsys.readouterr().out
    assert [r["iteration"] for r in read_metrics(str(logdir))] == [0, 1, 2]
    with open(logdir / "metrics.jsonl", "a", encoding="utf-8") as f:
        f.write("not json\n")
        f.write(json.dumps({"iteration": 9}) + "\n")
    with pytest.raises(ValueError, match=r"metrics.jsonl: line 4 is not a metrics record"):
        read_metrics(str(logdir))


def test_a_directory_holding_a_run_is_refused_unless_resumed_or_overwritten(two_iterations,
                                                                           tmp_path, capsys):
    logdir = copy(two_iterations, tmp_path)
    before = (logdir / "metrics.jsonl").read_text(encoding="utf-8")
    capsys.readouterr()
    assert run(logdir, "--iterations", "1") == 2
    err = capsys.readouterr().err
    assert "already holds a run (config.json, metrics.jsonl, tokenizer.json, checkpoints" in err
    assert "pass --resume to continue it or --overwrite to replace it" in err
    assert (logdir / "metrics.jsonl").read_text(encoding="utf-8") == before  # nothing lost
    assert run(logdir, "--iterations", "1", "--overwrite") == 0
    assert [r["iteration"] for r in read_metrics(str(logdir))] == [0]
    assert sorted(os.listdir(logdir / "checkpoints")) == ["1"]


def test_resume_names_every_setting_that_differs(two_iterations, capsys):
    capsys.readouterr()
    assert run(two_iterations, "--iterations", "3", "--resume", "--d-model", "64",
               "--env", "hotpotqa") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--resume: the run in" in err
    assert "d_model: 32 -> 64" in err and 'env: "alfworld" -> "hotpotqa"' in err
    assert "iterations" not in err  # a longer run is what resuming is for
