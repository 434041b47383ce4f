"""The diagnosis report: Markdown table, CSV and JSON round trips, PNG plots, atomic writes."""

import csv
import math
import os

import matplotlib.image
import numpy as np
import pytest

from stepcredit.diagnose import report
from stepcredit.diagnose.result import METRICS, Diagnosis, Example, Score

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
ENVS = ("webshop", "alfworld")
ESTIMATORS = ("mc_advantage", "grpo", "step_gae", "random")
# AUC per (env, estimator): step_gae beats grpo on webshop; grpo's AUC is NaN on alfworld.
AUC = {("webshop", "mc_advantage"): 0.95, ("webshop", "grpo"): 0.62,
       ("webshop", "step_gae"): 0.81, ("webshop", "random"): 0.50,
       ("alfworld", "mc_advantage"): 0.97, ("alfworld", "grpo"): math.nan,
       ("alfworld", "step_gae"): 0.70, ("alfworld", "random"): 0.49}


def _score(env, estimator, metric, i):
    if metric == "auc":
        estimate = AUC[env, estimator]
    elif metric == "blame_localisation" and env == "alfworld":
        estimate = math.nan  # no failed trajectory with exactly one bad step
    else:
        estimate = 0.1 + 0.037 * i
    if (env, estimator) == ("webshop", "step_gae") and metric == "auc":
        low, high = 0.77, 0.85
    elif math.isnan(estimate):
        low = high = math.nan
    else:
        low, high = estimate - 0.0312, estimate + 0.0451
    n = 40 if metric == "blame_localisation" else 1200 + (estimator == "grpo")
    per_seed = (estimate + 0.01, estimate - 0.01, math.nan) if not math.isnan(estimate) else ()
    return Score(env, estimator, metric, estimate, low, high, n, per_seed)


def _example(env, task, won, steps, seed):
    rng = np.random.default_rng(seed)
    good = rng.random(steps) < 0.5
    advantage = np.where(good, 0.3, -0.2) + 0.05 * rng.standard_normal(steps)
    credit = {name: rng.standard_normal(steps).astype(np.float32) for name in ESTIMATORS}
    credit["gigpo"] = np.zeros(steps)  # all-zero credit: scaled by 1, not divided by 0
    return Example(env=env, task=task, won=won, actions=tuple(f"click[{i}]" for i in range(steps)),
                   good=good, advantage=advantage, advantage_se=np.full(steps, 0.04), credit=credit)


@pytest.fixture
def diagnosis():
    scores = tuple(_score(env, estimator, metric, i)
                   for i, (env, estimator, metric) in enumerate(
                       (e, s, m) for e in ENVS for s in ESTIMATORS for m in METRICS))
    return Diagnosis(
        settings={"envs": list(ENVS), "seeds": 3, "group_size": 8, "policy": "epsilon-oracle"},
        scores=scores,
        examples=(_example("webshop", 3, False, 6, 0), _example("alfworld", 1, True, 9, 1)),
        seconds={"sample": 12.5, "prm": 30.25, "credit": 4.0},
        notes=("values from a tabular critic", "prm: could not run (no model)"))


def _table(text, env):
    """The rows of `env`'s table, as lists of cells (header and separator dropped)."""
    block = text.split(f"## {env}\n", 1)[1].split("\n\n", 1)[0].strip()
    return [[c.strip() for c in line.strip("|").split("|")] for line in block.splitlines()[2:]]


def test_markdown_tables(diagnosis):
    text = report.markdown(diagnosis)
    webshop, alfworld = _table(text, "webshop"), _table(text, "alfworld")
    assert [row[0] for row in webshop] == ["mc_advantage", "step_gae", "grpo", "random", "*n*"]
    assert [row[0] for row in alfworld] == ["mc_advantage", "step_gae", "grpo", "random", "*n*"]
    assert all(len(row) == 1 + len(METRICS) for row in webshop + alfworld)
    assert webshop[1][1] == "0.81 [0.77, 0.85]"
    assert alfworld[2][1] == "n/a"  # grpo's NaN AUC
    assert [row[METRICS.index("blame_localisation") + 1] for row in alfworld[:4]] == ["n/a"] * 4
    assert webshop[-1] == ["*n*", "1200–1201", "1200–1201", "1200–1201", "40", "1200–1201"]
    assert "epsilon-oracle" in text.split("\n\n")[1] and "seeds=3" in text
    assert "- prm: could not run (no model)" in text
    assert "prm 30.2 s" in text and "total 46.8 s" in text
    assert "lower is better" in text and "Spearman" in text


def test_markdown_orders_nan_auc_last_but_before_random():
    scores = tuple(Score("e", name, "auc", auc, auc - 0.1, auc + 0.1, 10, ())
                   for name, auc in [("random", 0.9), ("a", math.nan), ("b", 0.6),
                                     ("mc_advantage", 0.1), ("c", 0.7)])
    d = Diagnosis(settings={}, scores=scores, examples=(), seconds={})
    assert [row[0] for row in _table(report.markdown(d), "e")][:-1] == [
        "mc_advantage", "c", "b", "a", "random"]


def _same_score(a, b):
    """Scores equal field by field, NaN equal to NaN."""
    def same(x, y):
        return (isinstance(x, float) and isinstance(y, float) and math.isnan(x) and math.isnan(y)
                ) or x == y
    return all(same(getattr(a, f), getattr(b, f)) for f in ("env", "estimator", "metric", "estimate",
                                                           "low", "high", "n")) and (
        len(a.per_seed) == len(b.per_seed) and all(map(same, a.per_seed, b.per_seed)))


def test_csv_round_trip(diagnosis, tmp_path):
    path = report.write_csv(diagnosis, tmp_path / "d.csv")
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    assert tuple(rows[0]) == report.CSV_COLUMNS and len(rows) == len(diagnosis.scores)
    assert rows[0]["per_seed"] == "0.96;0.94;nan"
    loaded = report.load_csv(path)
    assert len(loaded) == len(diagnosis.scores)
    assert all(_same_score(a, b) for a, b in zip(loaded, diagnosis.scores))
    assert not _same_score(loaded[1], diagnosis.scores[0])  # the comparison can fail


def test_json_round_trip(diagnosis, tmp_path):
    report.write_json(diagnosis, tmp_path / "diagnose.json")
    assert "NaN" not in (tmp_path / "diagnose.json").read_text()
    loaded = report.load_json(tmp_path)  # the folder finds diagnose.json
    assert loaded.settings == diagnosis.settings
    assert loaded.seconds == diagnosis.seconds and loaded.notes == diagnosis.notes
    assert len(loaded.scores) == len(diagnosis.scores)
    assert all(_same_score(a, b) for a, b in zip(loaded.scores, diagnosis.scores))
    assert len(loaded.examples) == len(diagnosis.examples)
    for a, b in zip(loaded.examples, diagnosis.examples):
        assert (a.env, a.task, a.won, a.actions) == (b.env, b.task, b.won, b.actions)
        assert a.good.dtype == bool
        for field in ("good", "advantage", "advantage_se"):
            np.testing.assert_array_equal(getattr(a, field), getattr(b, field))
        assert list(a.credit) == list(b.credit)
        for name in b.credit:
            np.testing.assert_array_equal(a.credit[name], b.credit[name])


def _check_png(path, min_pixels):
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    image = matplotlib.image.imread(path)
    assert image.ndim == 3 and image.shape[0] * image.shape[1] >= min_pixels
    assert image.std() > 0.05  # not a blank canvas


def test_write_report(diagnosis, tmp_path):
    directory = tmp_path / "out" / "nested"
    paths = report.write_report(diagnosis, directory)
    assert set(paths) == {"markdown", "csv", "json", "auc", "examples"}
    assert sorted(os.listdir(directory)) == sorted(report.FILES.values())
    assert paths["markdown"].read_text() == report.markdown(diagnosis)
    _check_png(paths["auc"], 300 * 300)
    _check_png(paths["examples"], 600 * 300)
    # Re-plotting from the JSON alone works.
    _check_png(report.plot_examples(report.load_json(paths["json"]), tmp_path / "again.png",
                                    estimators=["step_gae"]), 300 * 300)


def test_plot_examples_rejects_unknown_estimator(diagnosis, tmp_path):
    with pytest.raises(ValueError, match="no_such"):
        report.plot_examples(diagnosis, tmp_path / "x.png", estimators=["no_such"])
    assert not os.listdir(tmp_path)


def test_default_example_estimators(diagnosis):
    assert report._example_estimators(diagnosis.examples, None) == ["grpo", "gigpo", "step_gae"]


def test_failed_write_keeps_previous_files(diagnosis, tmp_path, monkeypatch):
    report.write_report(diagnosis, tmp_path)
    before = {name: (tmp_path / name).read_bytes() for name in report.FILES.values()}
    changed = Diagnosis(settings={"seeds": 99}, scores=diagnosis.scores[:3], examples=(),
                        seconds={}, notes=())

    def broken_markdown(d):
        raise RuntimeError("rendering failed midway")

    monkeypatch.setattr(report, "markdown", broken_markdown)
    with pytest.raises(RuntimeError, match="midway"):
        report.write_report(changed, tmp_path)
    monkeypatch.undo()

    def broken_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", broken_replace)
    for write, name in [(report.write_markdown, "diagnose.md"), (report.write_csv, "diagnose.csv"),
                        (report.write_json, "diagnose.json"), (report.plot_auc, "auc.png"),
                        (report.plot_examples, "examples.png")]:
        with pytest.raises(OSError, match="disk full"):
            write(changed, tmp_path / name)
    monkeypatch.undo()
    assert {name: (tmp_path / name).read_bytes() for name in report.FILES.values()} == before
    assert sorted(os.listdir(tmp_path)) == sorted(report.FILES.values())  # no temporaries left
