"""Nothing lost, nobody confused: magnitudes beyond float32, killed runs, modes, encodings, empty logs."""

import argparse
import json
import os
import re
import signal
import socket
import stat
import subprocess
import sys
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from stepcredit import credit_cli
from stepcredit.batch import StepRecord, Trajectory, collate
from stepcredit.data import RecordError, save_trajectories, validate
from stepcredit.data.offline import compute_credit
from tests.data.test_io import _row
from tests.data.test_offline import _digest, _rows


def _write_log(path, rows):
    path = str(path)
    if path.endswith(".parquet"):
        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        with open(path, "w") as handle:
            handle.writelines(json.dumps(row) + "\n" for row in rows)
    return path


def _small_log(tmp_path, name="small.jsonl", scale=1.0, seed=0):
    """Three groups of three two-step trajectories, rewards and values of about `scale`."""
    rng = np.random.default_rng(seed)
    rows = []
    for t in range(9):
        for s in range(2):
            rows.append(_row(f"t{t}", s, f"g{t // 3}", reward=float(rng.normal()) * scale,
                             value=float(rng.normal()) * scale, done=s == 1))
    return _write_log(tmp_path / name, rows)


# ------------------------------------------------------------ magnitudes at entry

@pytest.mark.parametrize("ext", ["jsonl", "parquet"])
def test_an_id_beyond_int32_is_named_by_its_row(tmp_path, ext):
    rows = [_row(step=0), _row(step=1, response_ids=[3, 3_000_000_000])]
    path = _write_log(tmp_path / f"ids.{ext}", rows)
    with pytest.raises(RecordError) as error:
        validate(path)
    assert (error.value.row, error.value.field) == (1, "response_ids"), str(error.value)
    assert "3000000000" in str(error.value)


@pytest.mark.parametrize("metadata", ["oops", "[1, 2]"])
def test_metadata_that_is_not_a_json_object_is_named_by_its_row(tmp_path, metadata):
    rows = [_row(step=0, metadata='{"source": "test"}'), _row(step=1, metadata=metadata)]
    with pytest.raises(RecordError, match="row 1, field 'metadata': .* must be a JSON object"):
        validate(_write_log(tmp_path / "meta.jsonl", rows))


# field values of the second row (the last step), and how the message shows them
BEYOND_FLOAT32 = {
    "reward 1e39": ({"reward": 1e39}, "reward", "1e+39"),
    "reward 1e200": ({"reward": 1e200}, "reward", "1e+200"),
    "reward -inf": ({"reward": float("-inf")}, "reward", "-inf"),
    "value": ({"value": -5e38}, "value", "-5e+38"),
    "score": ({"score": 4e38}, "score", "4e+38"),
    "bootstrap_value": ({"bootstrap_value": 1e39, "truncated": True}, "bootstrap_value", "1e+39"),
    "entropy": ({"entropy": 1e39}, "entropy", "1e+39"),
    "response_values": ({"response_values": [0.5, 1e39]}, "response_values", "1e+39"),
    "response_entropies nan": ({"response_entropies": [0.0, float("nan")]}, "response_entropies", "nan"),
}


@pytest.mark.parametrize("ext", ["jsonl", "parquet"])
@pytest.mark.parametrize("case", sorted(BEYOND_FLOAT32))
def test_numbers_not_finite_in_float32_are_rejected_naming_row_and_field(tmp_path, ext, case):
    extra, field, shown = BEYOND_FLOAT32[case]
    first = {name: ([0.0, 0.0] if isinstance(value, list) else None) for name, value in extra.items()
             if name not in ("reward", "truncated")}
    rows = [_row(step=0, **first), _row(step=1, **extra)]
    path = _write_log(tmp_path / f"big.{ext}", rows)
    with pytest.raises(RecordError) as error:
        validate(path)
    assert (error.value.row, error.value.field) == (1, field), str(error.value)
    assert f"row 1, field {field!r}: {shown} is not finite in float32" in str(error.value)
    with pytest.raises(RecordError, match=f"row 1, field '{field}'"):
        compute_credit(path, str(tmp_path / "out.parquet"), "grpo", progress=False)
    assert not os.path.exists(tmp_path / "out.parquet")


def test_float32_maximum_itself_is_accepted(tmp_path):
    biggest = float(np.finfo(np.float32).max)
    rows = [_row(reward=biggest), _row(step=1, reward=-biggest)]
    assert validate(_write_log(tmp_path / "max.jsonl", rows)).rows == 2


@pytest.mark.parametrize("field, value", [("reward", 1e39), ("value", -1e39), ("reward", float("inf"))])
def test_collate_rejects_host_records_not_finite_in_its_dtype(field, value):
    step = StepRecord([1], [2], [-0.1], **{"reward": 0.0, field: value})
    with pytest.raises(ValueError, match=rf"trajectories\[0\]\.steps\[0\]: {field} is .* not finite "
                                         rf"in float32"):
        collate([Trajectory(steps=[step])])
    if np.isfinite(value):  # the limit is the dtype's
        collate([Trajectory(steps=[step])], dtype=np.float64)


@pytest.mark.parametrize("attribute", ["score", "bootstrap_value"])
def test_collate_rejects_trajectory_numbers_not_finite_in_float32(attribute):
    step = StepRecord([1], [2], [-0.1], 0.0, truncated=True)
    with pytest.raises(ValueError, match=rf"trajectories\[0\]: {attribute} is 1e\+39; it is not "
                                         rf"finite in float32"):
        collate([Trajectory(steps=[step], **{attribute: 1e39})])


# ------------------------------------------------------------ large finite magnitudes


@pytest.mark.parametrize("estimator, whiten, scale", [
    ("grpo", "default", 1.0), ("rloo", "none", 1e20), ("step_gae", "none", 1e20),
    ("step_gae", "steps", 1.0)])
def test_rewards_of_1e20_give_the_credit_of_rescaled_rewards(tmp_path, estimator, whiten, scale):
    # 1e20 is finite in float32, but its square is not: float32 group statistics gave all zeros.
    # scale: how the advantages scale with the rewards (normalised ones do not)
    unit = _small_log(tmp_path, "unit.jsonl")
    big = _small_log(tmp_path, "big.jsonl", scale=1e20)
    compute_credit(unit, str(tmp_path / "unit.parquet"), estimator, whiten=whiten, progress=False)
    compute_credit(big, str(tmp_path / "big.parquet"), estimator, whiten=whiten, progress=False)
    expected, got = _rows(str(tmp_path / "unit.parquet")), _rows(str(tmp_path / "big.parquet"))
    assert np.ptp([r["advantage"] for r in got]) > 0.1 * scale
    np.testing.assert_allclose([r["advantage"] for r in got],
                               [r["advantage"] * scale for r in expected], rtol=1e-4, atol=1e-6 * scale)
    if "return" in expected[0]:
        np.testing.assert_allclose([r["return"] for r in got], [r["return"] * 1e20 for r in expected],
                                   rtol=1e-5)


def test_credit_beyond_float32_is_an_error_before_anything_is_written(tmp_path):
    # each reward is finite in float32, their sum (the return, the advantage) is not
    rows = [_row("a", 0, reward=3e38, value=0.0), _row("a", 1, reward=3e38, value=0.0, done=True)]
    path = _write_log(tmp_path / "sum.jsonl", rows)
    output = str(tmp_path / "out.parquet")
    compute_credit(_small_log(tmp_path), output, "step_gae", progress=False)
    before = _digest(output)
    with pytest.raises(RecordError) as error:
        compute_credit(path, output, "step_gae", overrides={"gamma": 1.0, "lam": 1.0}, whiten="none",
                       progress=False)
    message = str(error.value)
    assert message.startswith("row 0, field 'advantage': ") and "not finite in float32" in message
    assert "rescale" in message
    assert _digest(output) == before
    assert sorted(os.listdir(tmp_path)) == ["out.parquet", "small.jsonl", "sum.jsonl"]


# ------------------------------------------------------------ temporary files, modes


def _temporary(output, pid, random="deadbeef"):
    """A temporary file's name: .OUTPUT.tmp-HOST-PID-RANDOM (HOST with '_' for other than [A-Za-z0-9.])."""
    host = re.sub(r"[^A-Za-z0-9.]", "_", socket.gethostname())
    return os.path.join(os.path.dirname(output), f".{os.path.basename(output)}.tmp-{host}-{pid}-{random}")


def _dead_pid():
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_stale_temporary_files_of_dead_runs_are_removed_at_the_next_run(tmp_path):
    log = _small_log(tmp_path)
    output = str(tmp_path / "out.jsonl")
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        stale = _temporary(output, _dead_pid())
        kept = [_temporary(output, alive.pid), _temporary(output, os.getpid(), "0123abcd"),
                _temporary(str(tmp_path / "other.jsonl"), _dead_pid()),
                str(tmp_path / ".out.jsonl.tmp-notapid"), str(tmp_path / ".out.jsonl.notes")]
        for path in [stale] + kept:
            with open(path, "w") as handle:
                handle.write("partial")
        compute_credit(log, output, "grpo", progress=False)
        assert not os.path.exists(stale)
        assert all(os.path.exists(path) for path in kept)
        assert len(_rows(output)) == 18
    finally:
        alive.kill()
        alive.wait()


@pytest.mark.parametrize("umask", [0o022, 0o027, 0o002])
@pytest.mark.parametrize("ext", ["jsonl", "parquet"])
def test_outputs_get_the_mode_of_the_umask(tmp_path, umask, ext):
    log = _small_log(tmp_path)
    previous = os.umask(umask)
    try:
        output = str(tmp_path / f"out.{ext}")
        compute_credit(log, output, "grpo", progress=False)
        saved = str(tmp_path / f"saved.{ext}")
        save_trajectories([Trajectory(steps=[StepRecord([1], [2], [-0.1], 1.0, done=True)])], saved)
    finally:
        os.umask(previous)
    for path in (output, saved):
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o666 & ~umask, path


def _cli_command():
    script = os.path.join(os.path.dirname(sys.executable), "stepcredit")
    return [script] if os.path.exists(script) else [sys.executable, "-m", "stepcredit.cli"]


def test_killed_run_keeps_the_previous_output_and_the_next_run_cleans_up(tmp_path):
    rng = np.random.default_rng(0)
    count = 6000
    table = pa.table({
        "trajectory_id": [f"t{i // 2}" for i in range(count)],
        "group_id": [f"g{i // 8}" for i in range(count)],
        "step_index": [i % 2 for i in range(count)],
        "prompt_ids": pa.array([list(range(400))] * count, pa.list_(pa.int32())),
        "response_ids": pa.array([[5, 6]] * count, pa.list_(pa.int32())),
        "response_logprobs": pa.array([[-0.5, -0.25]] * count, pa.list_(pa.float32())),
        "reward": rng.normal(size=count),
        "done": [i % 2 == 1 for i in range(count)],
        "truncated": [False] * count,
    })
    log = str(tmp_path / "big.parquet")
    pq.write_table(table, log)
    output = str(tmp_path / "out.jsonl")
    compute_credit(_small_log(tmp_path), output, "grpo", progress=False)
    before = _digest(output)
    command = _cli_command() + ["credit", "--input", log, "--estimator", "grpo", "--output", output,
                                "--no-progress", "--batch-rows", "1000"]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    prefix = ".out.jsonl."
    deadline = time.monotonic() + 120
    partial = None
    while partial is None and process.poll() is None and time.monotonic() < deadline:
        for name in os.listdir(tmp_path):
            path = os.path.join(tmp_path, name)
            if name.startswith(prefix) and os.path.exists(path) and os.path.getsize(path) > 0:
                partial = path
                break
        else:
            time.sleep(0.002)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert partial is not None, f"the run ended before its output was half written: " \
                                f"{process.stderr.read().decode()[-2000:]}"
    assert process.returncode == -signal.SIGKILL
    assert _digest(output) == before
    leftovers = [name for name in os.listdir(tmp_path) if name.startswith(prefix)]
    assert leftovers == [os.path.basename(partial)]
    compute_credit(_small_log(tmp_path), output, "rloo", progress=False)
    assert not [name for name in os.listdir(tmp_path) if name.startswith(prefix)]
    assert "advantage" in _rows(output)[0]


# ------------------------------------------------------------ encodings, empty inputs


def test_non_utf8_input_names_its_line(tmp_path):
    path = tmp_path / "latin1.jsonl"
    lines = [json.dumps(_row(step=0)).encode(), b"", json.dumps(_row(step=1)).encode(),
             json.dumps(_row(step=2, metadata="caf\u00e9")).encode().replace(b"\\u00e9", b"\xe9")]
    path.write_bytes(b"\n".join(lines) + b"\n")
    for call in (lambda: validate(str(path)),
                 lambda: compute_credit(str(path), str(tmp_path / "out.jsonl"), "grpo", progress=False)):
        with pytest.raises(RecordError) as error:
            call()
        assert (error.value.row, error.value.field) == (2, "<line>")
        assert "input line 4 is not UTF-8" in str(error.value) and "byte" in str(error.value)


def _empty_logs(tmp_path):
    blank = tmp_path / "blank.jsonl"
    blank.write_text("\n\n")
    (tmp_path / "empty.jsonl").write_text("")
    schema_only = str(tmp_path / "empty.parquet")
    pq.write_table(pa.Table.from_pylist([_row()]).slice(0, 0), schema_only)
    return [str(tmp_path / "empty.jsonl"), str(blank), schema_only]


@pytest.mark.parametrize("out", ["out.jsonl", "out.parquet"])
def test_an_empty_input_is_an_error_unless_allowed(tmp_path, out):
    output = str(tmp_path / out)
    for log in _empty_logs(tmp_path):
        with pytest.raises(ValueError, match=r"^--input .* has no rows.*--allow-empty"):
            compute_credit(log, output, "step_gae", progress=False)
        assert not os.path.exists(output)
        summary = compute_credit(log, output, "step_gae", allow_empty=True, progress=False)
        assert summary.rows == 0 and summary.columns == ("advantage", "return")
        if out.endswith(".parquet"):
            written = pq.read_table(output)
            assert written.num_rows == 0
            assert {"reward", "advantage", "return"} <= set(written.column_names)
        else:
            assert os.path.getsize(output) == 0
        os.unlink(output)


def test_cli_allow_empty(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    credit_cli.add_arguments(parser)
    assert "default: an empty input is an error" in " ".join(parser.format_help().split())
    log = _empty_logs(tmp_path)[0]
    output = str(tmp_path / "out.jsonl")
    base = ["--input", log, "--estimator", "grpo", "--output", output, "--no-progress"]
    with pytest.raises(ValueError, match="has no rows"):
        credit_cli.run(parser.parse_args(base))
    assert credit_cli.run(parser.parse_args(base + ["--allow-empty"])) == 0
    assert os.path.exists(output) and "0 steps" in capsys.readouterr().out


def test_save_trajectories_refuses_one_id_for_two_trajectories(tmp_path):
    """Their rows would read back as one trajectory, which validate refuses."""
    trajectory = Trajectory(steps=[StepRecord([1], [2], [-0.1], 1.0, done=True)])
    path = tmp_path / "saved.jsonl"
    with pytest.raises(ValueError, match=r"trajectory_ids\[2\] is 'a', as is trajectory_ids\[0\]"):
        save_trajectories([trajectory] * 3, str(path), trajectory_ids=["a", "b", "a"])
    assert not path.exists()


@pytest.mark.parametrize("ext", ["jsonl", "parquet"])
def test_save_trajectories_names_a_bad_step_and_writes_nothing(tmp_path, ext):
    good = StepRecord([1], [2], [-0.1], 0.0)
    cases = [
        ([Trajectory(steps=[good, StepRecord([1], [2], [-0.1], float("nan"), done=True)])],
         r"trajectories\[0\]\.steps\[1\], field 'reward': nan is not finite"),
        ([Trajectory(steps=[good]), Trajectory(steps=[StepRecord([1], [2], [-0.1], 0.0, done=True),
                                                      good])],
         r"trajectories\[1\]\.steps\[0\], field 'done': is true on step 0"),
        # Checked a batch at a time: the row is named within its own trajectory and batch.
        ([Trajectory(steps=[good, StepRecord([1], [2], [-0.1], 1.0, done=True)])] * 3
         + [Trajectory(steps=[good, good, StepRecord([1], [2], [-0.1], float("inf"), done=True)])],
         r"trajectories\[3\]\.steps\[2\], field 'reward': inf is not finite"),
        ([Trajectory(steps=[StepRecord([1], [2], [-0.1], 0.0, info={"x": np.zeros(2)})])],
         r"trajectories\[0\]: Object of type ndarray is not JSON serializable"),
    ]
    path = tmp_path / f"saved.{ext}"
    for trajectories, message in cases:
        for batch_rows in (3, 1000):  # the bad step in a later batch, and in the first
            with pytest.raises(ValueError, match=message):
                save_trajectories(trajectories, str(path), batch_rows=batch_rows)
            assert not path.exists()
