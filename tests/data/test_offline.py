"""Offline credit: estimators by name over step rows, atomic output beside the input."""

import argparse
import hashlib
import json
import os

import jax.numpy as jnp
import numpy as np
import pyarrow.parquet as pq
import pytest

import stepcredit
from stepcredit.advantages import group, masked_whiten
from stepcredit.advantages.gigpo import gigpo
from stepcredit.batch import collate
from stepcredit.data import RecordError, save_trajectories
from stepcredit.data.write import RowWriter
from stepcredit.data.offline import compute_credit
from stepcredit import credit_cli
from tests.data.test_io import random_trajectories


def _trajectories():
    trajectories = sorted(random_trajectories(3, count=12), key=lambda t: t.group_id)
    # every step with a value and an entropy, so every estimator applies; groups contiguous
    return [t.__class__(steps=[s.__class__(**{**s.__dict__, "value": s.value or 0.25,
                                              "action_entropy": s.action_entropy or [0.5] * len(s.action_ids)})
                               for s in t.steps],
                        group_id=t.group_id, score=t.score, bootstrap_value=t.bootstrap_value)
            for t in trajectories]


@pytest.fixture(scope="module")
def log(tmp_path_factory):
    trajectories = _trajectories()
    path = str(tmp_path_factory.mktemp("log") / "steps.jsonl")
    save_trajectories(trajectories, path)
    return trajectories, path


def _rows(path):
    if path.endswith(".parquet"):
        return pq.read_table(path).to_pylist()
    with open(path) as handle:
        return [json.loads(line) for line in handle]


def _digest(path):
    with open(path, "rb") as handle:
        return hashlib.sha256(handle.read()).hexdigest()


def _per_row(trajectories, step_values):
    return np.concatenate([np.asarray(step_values[b, :len(t.steps)]) for b, t in enumerate(trajectories)])


@pytest.mark.parametrize("out", ["credited.parquet", "credited.jsonl"])
def test_step_gae_matches_direct_call(log, tmp_path, out):
    trajectories, path = log
    before = _digest(path)
    output = str(tmp_path / out)
    summary = compute_credit(path, output, "step_gae", overrides={"gamma": 0.9, "lam": 0.8},
                             batch_rows=5, progress=False)
    assert summary.columns == ("advantage", "return") and summary.whiten == "steps"
    steps, _, _ = collate(trajectories)
    direct = stepcredit.step_gae(steps.reward, steps.value, steps.mask, gamma=0.9, lam=0.8,
                                 bootstrap_value=steps.bootstrap_value)
    whitened = masked_whiten(direct.advantages, jnp.asarray(steps.mask))
    rows = _rows(output)
    np.testing.assert_allclose([r["advantage"] for r in rows], _per_row(trajectories, whitened),
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose([r["return"] for r in rows], _per_row(trajectories, direct.returns),
                               rtol=1e-5, atol=1e-5)
    inputs = _rows(path)
    for row, original in zip(rows, inputs):
        assert {k: row[k] for k in original} == original
    assert _digest(path) == before


def test_group_estimators_match_direct_calls(log, tmp_path):
    trajectories, path = log
    steps, _, _ = collate(trajectories)
    scores = np.where([t.score is None for t in trajectories], steps.reward.sum(1),
                      [t.score or 0.0 for t in trajectories]).astype(np.float32)
    output = str(tmp_path / "g.jsonl")
    compute_credit(path, output, "grpo", batch_rows=4, progress=False)
    expected = group.grpo(scores, steps.group_id)
    np.testing.assert_allclose([r["advantage"] for r in _rows(output)],
                               np.repeat(np.asarray(expected), [len(t.steps) for t in trajectories]),
                               rtol=1e-5, atol=1e-6)
    compute_credit(path, output, "gigpo", overrides={"std": "none"}, batch_rows=4, progress=False)
    anchors = np.asarray([[-1 if t >= len(tr.steps) else (1000 + 100 * b + t if tr.steps[t].anchor is None
                                                          else tr.steps[t].anchor)
                           for t in range(steps.reward.shape[1])] for b, tr in enumerate(trajectories)])
    _, dense = np.unique(anchors, return_inverse=True)
    # GiGPO's episode score is the masked sum of step rewards, as in the trainer.
    expected = gigpo(steps.reward, dense.reshape(anchors.shape).astype(np.int32), steps.group_id,
                     steps.mask, std="none")
    np.testing.assert_allclose([r["advantage"] for r in _rows(output)],
                               _per_row(trajectories, expected), rtol=1e-5, atol=1e-6)


def test_token_whitening_of_trajectory_advantages(log, tmp_path):
    trajectories, path = log
    steps, tokens, _ = collate(trajectories, with_observations=False)
    scores = np.where([t.score is None for t in trajectories], steps.reward.sum(1),
                      [t.score or 0.0 for t in trajectories]).astype(np.float32)
    centred = group.reinforce_pp_baseline(scores, steps.group_id)
    expected = masked_whiten(jnp.broadcast_to(centred[:, None], tokens.action_mask.shape),
                             jnp.asarray(tokens.action_mask))[:, 0]
    output = str(tmp_path / "b.parquet")
    summary = compute_credit(path, output, "reinforce_pp_baseline", batch_rows=3, progress=False)
    assert summary.whiten == "tokens"
    np.testing.assert_allclose([r["advantage"] for r in _rows(output)],
                               np.repeat(np.asarray(expected), [len(t.steps) for t in trajectories]),
                               rtol=1e-5, atol=1e-5)


def test_token_gae_reads_token_values(tmp_path):
    rng = np.random.default_rng(5)
    rows, token_rewards, token_values, masks = [], [], [], []
    for b in range(3):
        rewards, values = [], []
        for t in range(b + 1):
            k = t + 1
            v = rng.normal(size=k).astype(np.float32)
            r = float(rng.normal())
            rows.append({"trajectory_id": b, "group_id": 0, "step_index": t, "prompt_ids": [1],
                         "response_ids": list(range(k)), "response_logprobs": [0.0] * k, "reward": r,
                         "done": t == b, "truncated": False, "response_values": v.tolist()})
            rewards += [0.0] * (k - 1) + [r]
            values += v.tolist()
        token_rewards.append(rewards)
        token_values.append(values)
    width = max(map(len, token_rewards))
    pad = lambda x: np.asarray([row + [0.0] * (width - len(row)) for row in x], np.float32)  # noqa: E731
    mask = np.asarray([[i < len(row) for i in range(width)] for row in token_rewards])
    direct = stepcredit.token_gae(pad(token_rewards), pad(token_values), mask, gamma=0.9, lam=0.7)
    path = str(tmp_path / "tokens.jsonl")
    with open(path, "w") as handle:
        handle.writelines(json.dumps(row) + "\n" for row in rows)
    output = str(tmp_path / "out.jsonl")
    compute_credit(path, output, "token_gae", overrides={"gamma": 0.9, "lam": 0.7}, whiten="none",
                   progress=False)
    got = [x for row in _rows(output) for x in row["token_advantages"]]
    np.testing.assert_allclose(got, np.asarray(direct.advantages)[mask], rtol=1e-5, atol=1e-6)
    assert [len(r["token_returns"]) for r in _rows(output)] == [len(r["response_ids"]) for r in rows]


def test_failure_mid_write_keeps_previous_output(log, tmp_path, monkeypatch):
    _, path = log
    output = str(tmp_path / "out.parquet")
    compute_credit(path, output, "grpo", progress=False)
    before, input_before = _digest(output), _digest(path)
    calls = []

    def failing(self, table):
        calls.append(1)
        if len(calls) == 2:
            raise OSError("disk full (injected)")
        original(self, table)

    original = RowWriter.write_table
    monkeypatch.setattr(RowWriter, "write_table", failing)
    with pytest.raises(OSError, match="injected"):
        compute_credit(path, output, "rloo", batch_rows=3, progress=False)
    assert len(calls) == 2
    assert _digest(output) == before and _digest(path) == input_before
    assert sorted(os.listdir(tmp_path)) == ["out.parquet"]


def test_cli_and_errors(log, tmp_path, capsys):
    _, path = log
    parser = argparse.ArgumentParser()
    credit_cli.add_arguments(parser)
    output = str(tmp_path / "cli.jsonl")
    args = parser.parse_args(["--input", path, "--estimator", "step_gae", "--set", "gamma=0.99",
                              "--set", "lam=0.95", "--output", output, "--no-progress"])
    assert credit_cli.run(args) == 0
    assert "new columns: advantage, return" in capsys.readouterr().out
    with pytest.raises(KeyError, match="unknown estimator"):
        compute_credit(path, output, "nope", progress=False)
    with pytest.raises(ValueError, match="no hyperparameter 'gama'"):
        compute_credit(path, output, "step_gae", overrides={"gama": 0.9}, progress=False)
    with pytest.raises(ValueError, match="reads prm_logp, ref_logp, which step rows do not hold"):
        compute_credit(path, output, "istar", progress=False)
    with pytest.raises(ValueError, match="is the input"):
        compute_credit(path, path, "grpo", progress=False)
    no_values = str(tmp_path / "nv.jsonl")
    with open(path) as source, open(no_values, "w") as target:
        for line in source:
            row = json.loads(line)
            row["value"] = None
            target.write(json.dumps(row) + "\n")
    with pytest.raises(RecordError, match="row 0, field 'value'"):
        compute_credit(no_values, output, "step_gae", progress=False)


def test_an_optional_input_that_logs_lack_is_left_out(log, tmp_path):
    """verl's optimal token baseline reads the sampling log-probs when given (ref_logp, not a
    step-row field) and weighs every token equally without them: it runs offline."""
    trajectories, path = log
    out = str(tmp_path / "otb.jsonl")
    compute_credit(path, out, "optimal_token_baseline", progress=False)
    rows = _rows(out)
    assert len(rows) == sum(len(t.steps) for t in trajectories)
    assert all(np.isfinite(r["token_advantages"]).all() for r in rows)
    with pytest.raises(ValueError, match="reads prm_logp, ref_logp, which step rows do not hold"):
        compute_credit(path, str(tmp_path / "x.jsonl"), "istar", progress=False)


def _edited(path, target, edit):
    """A copy of the JSONL log at `path` with `edit(row_number, row)` applied to each row."""
    with open(path) as source, open(target, "w") as out:
        for number, line in enumerate(source):
            out.write(json.dumps(edit(number, json.loads(line))) + "\n")
    return str(target)


def test_a_column_clash_in_any_row_is_refused_before_writing(log, tmp_path):
    _, path = log
    clashing = _edited(path, tmp_path / "clash.jsonl",
                       lambda number, row: {**row, "advantage": 1.5} if number == 3 else row)
    output = tmp_path / "out.jsonl"
    with pytest.raises(ValueError, match="row 3 of the input already has a column 'advantage'"):
        compute_credit(clashing, str(output), "grpo", progress=False)
    assert not output.exists()
    with pytest.raises(ValueError, match="the folder .*nowhere does not exist"):
        compute_credit(path, str(tmp_path / "nowhere" / "out.jsonl"), "grpo", progress=False)


def test_jsonl_rows_of_differing_columns_make_one_parquet_table(log, tmp_path):
    """Later rows may add an optional field or a column of their own, or lack one: as Parquet,
    every row holds every column of the log, null where it lacks one."""
    trajectories, path = log
    def edit(number, row):
        if number < 10:
            row.pop("value", None)
        else:
            row["note"] = f"row {number}"
        return row
    varied = _edited(path, tmp_path / "varied.jsonl", edit)
    output = str(tmp_path / "out.parquet")
    compute_credit(varied, output, "grpo", batch_rows=4, progress=False)
    rows = _rows(output)
    assert len(rows) == sum(len(t.steps) for t in trajectories)
    assert [r["note"] for r in rows[:10]] == [None] * 10 and rows[10]["note"] == "row 10"
    assert rows[0]["value"] is None and rows[10]["value"] is not None
    expected = _rows(str(compute_credit(path, str(tmp_path / "plain.parquet"), "grpo",
                                        progress=False).output))
    assert [r["advantage"] for r in rows] == [r["advantage"] for r in expected]


def test_a_value_json_cannot_hold_is_named_by_its_row(log, tmp_path):
    _, path = log
    def edit(number, row):
        if number == 5:
            row["response_logprobs"] = [float("nan")] * len(row["response_ids"])
        return row
    nan_logp = _edited(path, tmp_path / "nan.jsonl", edit)
    output = tmp_path / "out.jsonl"
    with pytest.raises(RecordError,
                       match="row 5, field 'response_logprobs': holds .*write .parquet"):
        compute_credit(nan_logp, str(output), "grpo", progress=False)
    assert not output.exists()
    compute_credit(nan_logp, str(tmp_path / "out.parquet"), "grpo", progress=False)  # it can
