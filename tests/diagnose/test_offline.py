"""`stepcredit diagnose --input LOG --label-column COLUMN`: labelled logs of the user's own."""

import json

import numpy as np
import pytest

from stepcredit.cli import main
from stepcredit.diagnose import metrics
from stepcredit.diagnose.episodes import stack
from stepcredit.diagnose.estimates import step_credit, word_tokens
from stepcredit.diagnose.offline import diagnose_log
from stepcredit.diagnose.policies import EpsilonExpert
from stepcredit.diagnose.run import grade
from stepcredit.diagnose.sample import sample_episodes
from stepcredit.envs import registry


@pytest.fixture(scope="module")
def episodes():
    env = registry.make("hotpotqa")
    return sample_episodes(env, EpsilonExpert(0.4), list(range(6)), group_size=4, seed=0,
                           continuations=0)


def _write_log(path, episodes, label=lambda e, t: bool(e.good[t])):
    with open(path, "w") as handle:
        for b, e in enumerate(episodes):
            for t in range(e.length):
                last = t == e.length - 1
                handle.write(json.dumps({
                    "trajectory_id": f"traj-{b}", "group_id": f"task-{e.task}", "step_index": t,
                    "prompt_ids": [1, 2], "response_ids": [3] * (1 + t % 2),
                    "response_logprobs": [-0.5] * (1 + t % 2), "reward": float(e.rewards[t]),
                    "done": last and not e.truncated, "truncated": last and e.truncated,
                    "anchor": str(e.anchors[t]), "good_step": label(e, t)}) + "\n")
    return str(path)


def test_logged_labels_grade_like_the_simulator(episodes, tmp_path):
    log = _write_log(tmp_path / "steps.jsonl", episodes)
    diagnosis = diagnose_log(log, "good_step", estimators=("grpo", "gigpo", "step_gae"),
                             bootstrap=20, progress=False)
    assert set(diagnosis.estimators) == {"grpo", "gigpo"}
    assert any(note.startswith("step_gae: not run") for note in diagnosis.notes)
    stacked = stack(episodes)
    direct, _ = step_credit(["grpo"], episodes, stacked, [np.zeros(e.length) for e in episodes],
                            word_tokens(episodes))
    expected = {s.metric: s for s in grade("x", "grpo", direct["grpo"], stacked, seeds=(0,),
                                           bootstrap=20)}
    for metric in ("auc", "blame_localisation", "collateral_blame"):
        got = diagnosis.score("steps.jsonl", "grpo", metric)
        assert got.n == expected[metric].n
        np.testing.assert_allclose(got.estimate, expected[metric].estimate, atol=1e-9)
    # The labels are the truth of Spearman and of sign agreement: bad steps count as negative.
    real = stacked.mask
    labels = np.where(stacked.good, 1.0, -1.0)
    np.testing.assert_allclose(
        diagnosis.score("steps.jsonl", "grpo", "spearman").estimate,
        metrics.spearman(direct["grpo"], np.where(real, labels, np.nan), real).value, atol=1e-9)
    agreement = diagnosis.score("steps.jsonl", "grpo", "sign_agreement")
    assert agreement.n == real.sum()
    expected_agreement = (np.sign(direct["grpo"][real]) == labels[real]).mean()
    np.testing.assert_allclose(agreement.estimate, expected_agreement, atol=1e-9)


def test_a_missing_or_bad_label_is_one_clear_line(episodes, tmp_path):
    log = _write_log(tmp_path / "steps.jsonl", episodes)
    with pytest.raises(ValueError, match="'nope' is not a column"):
        diagnose_log(log, "nope", estimators=("grpo",), progress=False)
    bad = _write_log(tmp_path / "bad.jsonl", episodes,
                     label=lambda e, t: "yes" if e is episodes[1] and t == 0 else 1.0)
    with pytest.raises(ValueError, match=f"row {episodes[0].length} holds 'yes'"):
        diagnose_log(bad, "good_step", estimators=("grpo",), progress=False)


def test_command_line(episodes, tmp_path, capsys):
    log = _write_log(tmp_path / "steps.jsonl", episodes)
    out = tmp_path / "report"
    assert main(["diagnose", "--input", log, "--label-column", "good_step", "--estimators",
                 "grpo,gigpo", "--bootstrap", "10", "--output", str(out), "--no-progress"]) == 0
    assert "| gigpo |" in capsys.readouterr().out and (out / "diagnose.csv").exists()
    assert main(["diagnose", "--input", log, "--output", str(out)]) == 2
    assert "--input needs --label-column" in capsys.readouterr().err
