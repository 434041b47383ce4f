"""Tests of `stepcredit.diagnose.progress.fit_progress` (SPA's progress estimator fitted to a
diagnosis's episodes) and of SPA's row in the diagnosis."""

import numpy as np
import pytest

from stepcredit import advantages as adv
from stepcredit.advantages.inputs import CreditInputs
from stepcredit.diagnose.config import DiagnoseConfig
from stepcredit.diagnose.episodes import stack
from stepcredit.diagnose.progress import fit_progress
from stepcredit.diagnose.run import diagnose
from tests.diagnose.test_prm import MAX_STEPS, episodes  # noqa: F401  (the fixture)


def test_untrained_contributions_are_zero(episodes):  # noqa: F811
    out = fit_progress(episodes, env_name="alfworld", steps=0, env_kwargs={"difficulty": 0},
                       trajectories_per_step=None)
    mask = stack(episodes).mask
    assert out.progress.shape == mask.shape == out.grounding.shape
    assert not out.progress.any() and (out.grounding == mask).all()
    assert out.losses == () and out.description.startswith("progress estimator (SPA): small")


def test_training_fits_the_outcomes_and_feeds_spa(episodes):  # noqa: F811
    out = fit_progress(episodes, env_name="alfworld", steps=40, learning_rate=1e-3,
                       env_kwargs={"difficulty": 0}, trajectories_per_step=8)
    stacked = stack(episodes)
    scores = np.array([e.score for e in episodes], np.float32)
    loss = float(adv.progress_loss(out.progress, stacked.mask, scores))
    assert loss < 0.2 * float(np.mean(scores ** 2))  # the untrained loss: every c_t = 0
    assert out.losses[-1] < out.losses[0]
    totals = np.where(stacked.mask, out.progress, 0.0).sum(1)  # won: score 1, lost: 0
    assert totals[stacked.won].mean() > totals[~stacked.won].mean() + 0.5
    step_index = np.where(stacked.mask, np.arange(MAX_STEPS)[None, :stacked.mask.shape[1]], -1)
    inputs = CreditInputs(mask=stacked.mask, step_index=step_index.astype(np.int32),
                          token_values=np.zeros(step_index.shape, np.float32),
                          progress=out.progress, grounding=out.grounding)
    advantages = np.asarray(adv.apply("spa", inputs).advantages)
    assert np.isfinite(advantages).all() and advantages[stacked.mask].std() > 0


def test_spa_gets_a_finite_row_in_the_diagnosis():
    diagnosis = diagnose(DiagnoseConfig(envs=("hotpotqa",), estimators=("spa",), tasks=2,
                                        group_size=4, seeds=(0,), continuations=0, bootstrap=5,
                                        prm_steps=1), progress=False)
    assert "spa" in diagnosis.estimators
    assert any(note.startswith("hotpotqa: progress estimator (SPA)") for note in diagnosis.notes)
    auc = diagnosis.score("hotpotqa", "spa", "auc")
    assert auc.n > 0 and np.isfinite(auc.estimate)


def test_errors(episodes):  # noqa: F811
    with pytest.raises(ValueError, match="fit_progress: episodes is empty"):
        fit_progress([], env_name="alfworld")
    with pytest.raises(ValueError, match="fit_progress: learning_rate=0"):
        fit_progress(episodes[:2], env_name="alfworld", learning_rate=0)
