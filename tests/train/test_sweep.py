"""`stepcredit sweep` in real worker processes: a killed worker fails its run only, and a
sweep killed mid-run is finished by the next one without redoing finished runs."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from stepcredit.study import records
from stepcredit.study.sweep import sweep

STUDY = """
name = "tiny"
seeds = [0]
[train]
iterations = 3
tasks_per_iteration = 2
group_size = 2
d_model = 16
num_layers = 1
minibatch_rows = 16
eval_tasks = 2
checkpoint_every = 1
[train.rollout]
action_format = "choice"
[envs.hotpotqa]
max_steps = 3
[methods.GRPO]
estimator = "grpo"
[methods.RLOO]
estimator = "rloo"
[methods.StepPO]
estimator = "step_gae"
iterations = 60  # still training when the sweep is killed after its first checkpoint
"""
RUNS = ("hotpotqa-GRPO-s0", "hotpotqa-RLOO-s0", "hotpotqa-StepPO-s0")


def _worker_pids(run_id, out):
    """Process ids of the worker processes training `run_id` into `out` (from /proc's
    command lines; another test's sweep may train a run of the same name at once)."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if (b"stepcredit.study.worker" in argv and run_id.encode() in argv
                and os.path.abspath(out).encode() in argv):
            pids.append(int(pid))
    return pids


def _wait_for(condition, what, timeout=240):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def _record(out, run_id):
    return records.read_record(out, run_id) or {}


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds worker processes through /proc")
def test_a_killed_worker_fails_its_run_and_a_killed_sweep_is_finished_by_the_next(tmp_path):
    study = tmp_path / "tiny.toml"
    study.write_text(STUDY)
    out = str(tmp_path / "out")
    first, second, third = RUNS
    sweep_process = subprocess.Popen(
        [sys.executable, "-m", "stepcredit", "sweep", str(study), "--out", out, "--workers", "2",
         "--no-progress"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        start_new_session=True)
    try:
        # The first run's worker dies by SIGKILL as soon as it runs; the second goes on.
        _wait_for(lambda: _worker_pids(first, out), "the first run's worker")
        for pid in _worker_pids(first, out):
            os.kill(pid, signal.SIGKILL)
        _wait_for(lambda: _record(out, first).get("status") == records.FAILED,
                  "the killed run's failed record")
        assert "killed by signal SIGKILL" in _record(out, first)["error"]
        # The sweep dies with everything in it once the second run has finished and the
        # third has checkpointed.
        _wait_for(lambda: _record(out, second).get("status") == records.DONE,
                  "the second run's record")
        _wait_for(lambda: os.path.exists(os.path.join(records.run_dir(out, third),
                                                      "config.json")),
                  "the third run's first checkpoint")
        os.killpg(sweep_process.pid, signal.SIGKILL)
        sweep_process.wait()
    finally:
        if sweep_process.poll() is None:
            os.killpg(sweep_process.pid, signal.SIGKILL)
            sweep_process.wait()
    assert not _record(out, third)
    finished = open(records.record_path(out, second)).read()

    summary = sweep(str(study), out, progress=False, note=lambda line: None)

    assert summary.skipped == (second,)
    assert sorted(summary.finished) == sorted([first, third]) and not summary.failed
    assert open(records.record_path(out, second)).read() == finished  # not redone
    assert _record(out, third)["resumed"] and not _record(out, first)["resumed"]
    for run_id, iterations in zip(RUNS, (3, 3, 60)):
        record = _record(out, run_id)
        assert record["status"] == records.DONE and record["iterations"] == iterations
        metrics = [json.loads(line)["iteration"]
                   for line in open(os.path.join(records.run_dir(out, run_id), "metrics.jsonl"))]
        assert metrics == list(range(iterations)), run_id  # none repeated or skipped
        assert set(record["eval"]) == {"test"}


def test_reproduce_sweeps_a_preset_and_prints_its_table(tmp_path, monkeypatch, capsys):
    from stepcredit import cli
    from stepcredit.study import reproduce_cli

    studies = tmp_path / "experiments"
    studies.mkdir()
    (studies / "quick.toml").write_text(
        STUDY[:STUDY.index("[methods.RLOO]")]
        + "[diagnose]\ntasks = 2\nseeds = [0]\ncontinuations = 2\n")
    monkeypatch.setattr(reproduce_cli, "STUDIES", str(studies))
    out = tmp_path / "out"

    assert cli.main(["reproduce", "--preset", "quick", "--out", str(out), "--no-progress"]) == 0

    printed = capsys.readouterr().out
    assert "# Study tiny" in printed and "| GRPO | `grpo` | 1 |" in printed
    assert "AUC" in printed  # the diagnosis ran and is in the table
    for name in ("table.md", "table.csv", "curves.png", "diagnose/diagnose.json"):
        assert (out / name).exists(), name
