"""Schema, loading, validation and the Trajectory round trip."""

import json
import os

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from stepcredit.batch import StepRecord, Trajectory
from stepcredit.data import (FEATURES, RecordError, iter_batches, load, load_trajectories,
                             save_trajectories, validate)


def random_trajectories(seed=0, count=9):
    rng = np.random.default_rng(seed)
    trajectories = []
    for i in range(count):
        length = int(rng.integers(1, 5))
        steps = []
        for t in range(length):
            k = int(rng.integers(1, 6))
            last = t == length - 1
            steps.append(StepRecord(
                observation_ids=[int(x) for x in rng.integers(0, 2**31 - 1, int(rng.integers(0, 4)))],
                action_ids=[int(x) for x in rng.integers(0, 2**31 - 1, k)],
                action_logp=[float(x) for x in rng.normal(size=k).astype(np.float32)],
                reward=float(rng.normal()), done=last and i % 3 != 0, truncated=last and i % 3 == 0,
                action_entropy=None if i % 2 else [float(x) for x in rng.random(k).astype(np.float32)],
                value=None if i == 4 else float(rng.normal()),
                anchor=None if t == 1 else int(rng.integers(-3, 3)),
                info={"valid": bool(t % 2), "text": f"step {t}"} if i % 4 else {}))
        trajectories.append(Trajectory(steps=steps, group_id=int(rng.integers(0, 3)) * 1000 - 7,
                                       score=None if i % 2 else float(rng.normal()),
                                       bootstrap_value=float(rng.normal()) if i % 3 == 0 else 0.0))
    return trajectories


def assert_same(expected, actual):
    assert len(expected) == len(actual)
    for a, b in zip(expected, actual):
        assert (a.group_id, a.score, a.bootstrap_value) == (b.group_id, b.score, b.bootstrap_value)
        assert len(a.steps) == len(b.steps)
        for s, r in zip(a.steps, b.steps):
            assert list(s.observation_ids) == list(r.observation_ids)
            assert list(s.action_ids) == list(r.action_ids)
            np.testing.assert_array_equal(np.float32(s.action_logp), np.float32(r.action_logp))
            if s.action_entropy is None:
                assert r.action_entropy is None
            else:
                np.testing.assert_array_equal(np.float32(s.action_entropy), np.float32(r.action_entropy))
            assert (s.reward, s.done, s.truncated, s.value, s.anchor, dict(s.info)) == \
                (r.reward, r.done, r.truncated, r.value, r.anchor, dict(r.info))


@pytest.mark.parametrize("ext", ["jsonl", "parquet"])
def test_round_trip_is_lossless(tmp_path, ext):
    trajectories = random_trajectories()
    path = tmp_path / f"steps.{ext}"
    rows = save_trajectories(trajectories, str(path), batch_rows=4)
    assert rows == sum(len(t.steps) for t in trajectories)
    assert_same(trajectories, load_trajectories(str(path), batch_rows=3))
    assert not [p for p in os.listdir(tmp_path) if ".tmp" in p]


def test_dataset_and_folder_sources(tmp_path):
    trajectories = random_trajectories(1)
    path = tmp_path / "steps.parquet"
    save_trajectories(trajectories, str(path))
    dataset = load(str(path))
    assert dataset.features["group_id"] == FEATURES["group_id"]
    assert dataset.features["response_logprobs"] == FEATURES["response_logprobs"]
    assert_same(trajectories, load_trajectories(dataset))
    dataset.save_to_disk(str(tmp_path / "folder"))
    assert_same(trajectories, load_trajectories(str(tmp_path / "folder"), batch_rows=2))
    summary = validate(dataset)
    assert summary.rows == len(dataset) and summary.trajectories == len(trajectories)


def _row(trajectory="a", step=0, group="g", **extra):
    row = {"trajectory_id": trajectory, "group_id": group, "step_index": step, "prompt_ids": [1],
           "response_ids": [5, 6], "response_logprobs": [-0.5, -0.25], "reward": 0.0,
           "done": False, "truncated": False}
    row.update(extra)
    return row


def _jsonl(path, rows):
    with open(path, "w") as handle:
        for row in rows:
            handle.write(json.dumps(row) + "\n")
    return str(path)


BAD = {
    "missing field": ([_row(), {k: v for k, v in _row(step=1).items() if k != "reward"}], 1, "reward"),
    "wrong type": ([_row(), _row(step=1, reward="high")], 1, "reward"),
    "wrong token type": ([_row(response_ids=[1, 2.5], response_logprobs=[0.0, 0.0])], 0, "response_ids"),
    "null required": ([_row(done=None)], 0, "done"),
    "gap": ([_row(step=0), _row(step=2)], 1, "step_index"),
    "not starting at 0": ([_row(step=1), _row(step=2)], 0, "step_index"),
    "duplicate": ([_row(step=0), _row(step=1), _row(step=1)], 2, "step_index"),
    "split across groups": ([_row(step=0), _row(step=1, group="h")], 1, "group_id"),
    "not contiguous": ([_row("a"), _row("b"), _row("a", step=0)], 2, "trajectory_id"),
    "length mismatch": ([_row(response_logprobs=[0.0])], 0, "response_logprobs"),
    "empty response": ([_row(response_ids=[], response_logprobs=[])], 0, "response_ids"),
    "done too early": ([_row(done=True), _row(step=1)], 0, "done"),
    "done and truncated": ([_row(done=True, truncated=True)], 0, "truncated"),
    "two scores": ([_row(score=1.0), _row(step=1, score=2.0)], 1, "score"),
    "nan reward": ([_row(reward=float("nan"))], 0, "reward"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_records_name_row_and_field(tmp_path, case):
    rows, row, field = BAD[case]
    with pytest.raises(RecordError) as error:
        validate(_jsonl(tmp_path / "bad.jsonl", rows), batch_rows=2)
    assert (error.value.row, error.value.field) == (row, field), str(error.value)
    assert f"row {row}" in str(error.value) and field in str(error.value)


def test_wrong_column_type_in_parquet(tmp_path):
    table = pa.Table.from_pylist([_row(), _row(step=1)])
    table = table.set_column(table.column_names.index("reward"), "reward",
                             pa.array(["x", "y"]))
    pq.write_table(table, tmp_path / "bad.parquet")
    with pytest.raises(RecordError, match="row 0, field 'reward'"):
        validate(str(tmp_path / "bad.parquet"))


def test_batches_hold_whole_units(tmp_path):
    rows = [_row("a", 0, "g"), _row("a", 1, "g"), _row("b", 1, "g"), _row("b", 0, "g"),
            _row("c", 0, "h"), _row("c", 1, "h"), _row("c", 2, "h"), _row("d", 0, "i")]
    path = _jsonl(tmp_path / "steps.jsonl", rows)
    assert validate(path, batch_rows=3) == (8, 4, 3)
    batches = list(iter_batches(path, batch_rows=3))
    assert [b.start for b in batches] == [0, 2, 4, 7]
    assert [len(b.table) for b in batches] == [2, 2, 3, 1]
    groups = list(iter_batches(path, by="group", batch_rows=3))
    assert [len(b.table) for b in groups] == [4, 3, 1]
    np.testing.assert_array_equal(groups[0].trajectory_starts, [0, 2, 4])
    interleaved = _jsonl(tmp_path / "mixed.jsonl", [_row("a", 0, "g"), _row("b", 0, "h"),
                                                    _row("c", 0, "g")])
    assert validate(interleaved).trajectories == 3
    with pytest.raises(RecordError, match="group 'g' appears again"):
        validate(interleaved, by="group")
    for bad in (0, "10"):
        with pytest.raises(ValueError, match=f"iter_batches: batch_rows={bad!r}; it must be a "
                                             "positive int"):
            validate(path, batch_rows=bad)


def test_integer_ids_and_anchors_become_strings(tmp_path):
    path = _jsonl(tmp_path / "ints.jsonl", [_row(7, group=-3, anchor=42)])
    dataset = load(path)
    assert dataset[0]["trajectory_id"] == "7" and dataset[0]["group_id"] == "-3"
    assert dataset[0]["anchor"] == "42"
    assert isinstance(load_trajectories(datasets.Dataset.from_list([_row(group="5", anchor="x")]))[0]
                      .steps[0].anchor, int)


def test_a_column_mixing_integer_and_string_ids_loads_as_the_ids_strings(tmp_path):
    """`datasets` keeps such a column as JSON text; `load` gives what `iter_batches` reads."""
    rows = [_row(7, group=1, anchor=42), _row("b", group="h", anchor="kitchen", extra_field=3),
            _row(8, group=1)]
    path = _jsonl(tmp_path / "mixed.jsonl", rows)
    dataset = load(path)
    assert dataset["trajectory_id"] == ["7", "b", "8"]
    assert dataset["group_id"] == ["1", "h", "1"]
    assert dataset["anchor"] == ["42", "kitchen", None]
    assert dataset.features["anchor"] == FEATURES["anchor"]
    assert dataset["extra_field"] == [None, 3, None]
    read = [i for batch in iter_batches(path) for i in batch.table.column("group_id").to_pylist()]
    assert dataset["group_id"] == read
