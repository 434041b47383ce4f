"""The README's "Add your own estimator" recipe, run as written.

The section's Python block is written to a module outside the package; the
estimator it registers is then used by name in `compute_advantages`, in
offline credit and in a short training run (through `--import`), with no
package file edited.
"""

import importlib
import json
import os
import re
import sys

import numpy as np
import pytest

from stepcredit import advantages as adv
from stepcredit.cli import main
from stepcredit.credit import compute_advantages
from stepcredit.data import save_trajectories
from stepcredit.train.metrics import read_metrics
from tests.test_credit import random_batch
from tests.train.test_trainer import TINY

README = os.path.join(os.path.dirname(__file__), os.pardir, "README.md")
MODULE = "my_estimators"


def recipe_code() -> str:
    with open(README, encoding="utf-8") as f:
        text = f.read()
    section = text.split("## Add your own estimator", 1)[1].split("\n## ", 1)[0]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    (tmp_path / f"{MODULE}.py").write_text(recipe_code(), encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    sys.modules.pop(MODULE, None)
    if "return_to_go" in adv.names():
        adv.unregister("return_to_go")


def test_the_recipe_registers_an_estimator_every_entry_point_knows(plugin, tmp_path, capsys):
    assert "return_to_go" not in adv.names()
    importlib.import_module(MODULE)
    entry = adv.get("return_to_go")
    assert entry.fields == {"step_rewards", "mask"} and not entry.needs_groups

    steps, tokens, _ = random_batch()
    credit = compute_advantages(steps, tokens, "return_to_go", gamma=0.5)
    raw = adv.discounted_returns(steps.reward, steps.mask, gamma=0.5)
    np.testing.assert_allclose(credit.step_advantages, adv.masked_whiten(raw, steps.mask),
                               atol=1e-6)
    np.testing.assert_allclose(credit.token_advantages,
                               adv.broadcast_to_tokens(credit.step_advantages, tokens.step_index),
                               atol=1e-6)
    with pytest.raises(ValueError, match="'return_to_go' has no hyperparameter 'lam'; it "
                                         "takes gamma"):
        compute_advantages(steps, tokens, "return_to_go", lam=0.9)

    # Offline credit through the CLI, the module imported by --import.
    from tests.data.test_offline import _trajectories

    trajectories = _trajectories()
    log, out = str(tmp_path / "log.jsonl"), str(tmp_path / "credited.jsonl")
    save_trajectories(trajectories, log)
    assert main(["credit", "--import", MODULE, "--estimator", "return_to_go", "--set",
                 "gamma=0.5", "--input", log, "--output", out, "--no-progress"]) == 0
    with open(out, encoding="utf-8") as f:
        written = [json.loads(line)["advantage"] for line in f]
    from stepcredit.batch import collate

    log_steps, _, _ = collate(trajectories)
    raw = np.asarray(adv.discounted_returns(log_steps.reward, log_steps.mask, gamma=0.5))
    expected = np.concatenate([raw[b, :len(t.steps)] for b, t in enumerate(trajectories)])
    expected = (expected - expected.mean()) / np.sqrt(expected.var(ddof=1) + 1e-8)
    np.testing.assert_allclose(written, expected, rtol=1e-5, atol=1e-5)

    # A short training run, and its saved configuration names what ran.
    logdir = tmp_path / "run"
    assert main(["train", "--import", MODULE, "--env", "alfworld", "--estimator",
                 "return_to_go", "--set", "gamma=0.5", "--logdir", str(logdir), *TINY]) == 0
    rows = read_metrics(str(logdir))
    assert [r["iteration"] for r in rows] == [0] and rows[0]["advantage/abs_max"] >= 0
    with open(logdir / "config.json", encoding="utf-8") as f:
        saved = json.load(f)
    assert saved["estimator"] == "return_to_go" and saved["estimator_config"] == [["gamma", 0.5]]
    assert saved["loss"]["value_coef"] == 0.0  # no critic: it reads no values
    capsys.readouterr()


def test_a_missing_import_is_one_line(capsys):
    assert main(["credit", "--import", "no_such_module_xyz", "--estimator", "grpo", "--input",
                 "x.jsonl", "--output", "y.jsonl"]) == 2
    assert capsys.readouterr().err == ("stepcredit credit: --import no_such_module_xyz: No module "
                                       "named 'no_such_module_xyz'\n")
