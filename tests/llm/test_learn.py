"""Step rows of chat-model trajectories: each step's advantage on its own action tokens."""

import numpy as np
import pytest

pytest.importorskip("tunix", reason="the llm tests need the tunix extra")

from stepcredit.batch import StepRecord, Trajectory  # noqa: E402
from stepcredit.llm import learn  # noqa: E402


def test_step_rows_put_each_step_advantage_on_its_action_tokens():
    trajectory = Trajectory(steps=(
        StepRecord(observation_ids=[], action_ids=[7, 8], action_logp=[-1.0, -2.0], reward=0.0,
                   prompt_ids=[1, 2, 3]),
        StepRecord(observation_ids=[], action_ids=[9], action_logp=[-0.5], reward=1.0, prompt_ids=[1, 4])))
    rows = learn.step_rows([trajectory], np.array([[0.25, -1.5]], np.float32))
    pad = [0, 0, 0]  # rows are padded to a power of two (8): one compiled update per bucket
    np.testing.assert_array_equal(rows["tokens"], [[1, 2, 3, 7, 8] + pad, [1, 4, 9, 0, 0] + pad])
    np.testing.assert_array_equal(rows["action_mask"], [[0, 0, 0, 1, 1] + pad, [0, 0, 1, 0, 0] + pad])
    np.testing.assert_array_equal(rows["advantages"], [[0, 0, 0, 0.25, 0.25] + pad, [0, 0, -1.5, 0, 0] + pad])
    np.testing.assert_array_equal(rows["old_logp"], [[0, 0, 0, -1, -2] + pad, [0, 0, -0.5, 0, 0] + pad])
    with pytest.raises(ValueError, match="step_rows: trajectories hold no steps"):
        learn.step_rows([Trajectory(steps=())], np.zeros((1, 0), np.float32))
    with pytest.raises(ValueError, match=r"step_advantages has shape \(2,\); it must be \[B, T\]"):
        learn.step_rows([trajectory], np.zeros(2, np.float32))


def test_with_entropies_puts_each_row_entropy_on_its_step():
    steps = (StepRecord(observation_ids=[], action_ids=[7, 8], action_logp=[-1.0, -2.0], reward=0.0,
                        prompt_ids=[1, 2, 3]),
             StepRecord(observation_ids=[], action_ids=[], action_logp=[], reward=1.0, prompt_ids=[1, 4]))
    trajectories = [Trajectory(steps=steps), Trajectory(steps=steps[:1])]
    rows = learn.step_rows(trajectories, np.zeros((2, 2), np.float32))
    entropy = np.arange(rows["tokens"].size, dtype=np.float32).reshape(rows["tokens"].shape)
    out = learn.with_entropies(trajectories, rows, entropy)
    width = rows["tokens"].shape[1]
    assert out[0].steps[0].action_entropy == [3.0, 4.0]  # row 0, positions 3 and 4
    assert out[0].steps[1].action_entropy is None  # no token sampled: no entropy (not NaN)
    assert out[1].steps[0].action_entropy == [2 * width + 3.0, 2 * width + 4.0]
