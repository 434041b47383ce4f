"""Two training iterations of a tiny random Qwen2 / Qwen3 on HotpotQA with stepcredit estimators."""

import jax
import numpy as np
import pytest

pytest.importorskip("tunix", reason="the llm tests need the tunix extra")

from flax import nnx  # noqa: E402

from stepcredit.envs.base import Observation, StepResult  # noqa: E402
from stepcredit.llm import checkpoint, learn  # noqa: E402
from tests.llm.checkpoints import write  # noqa: E402


class DigitEnv:
    """Two steps; a step earns 1 when the answer holds a digit (a random model does, sometimes)."""

    name, max_steps = "digits", 2

    def reset(self, task):
        self.t = 0
        return Observation("write a digit", None, anchor=0, task=f"task {task}: digits")

    def step(self, action):
        self.t += 1
        reward = float(any(c.isdigit() for c in action))
        return StepResult(Observation("again", None, anchor=self.t, task="digits"), reward,
                          done=self.t == self.max_steps, truncated=False,
                          info={"valid": True, "won": reward > 0, "score": reward, "error": ""})

    def close(self):
        pass


@pytest.mark.parametrize("family, estimator", [("qwen2", "grpo"), ("qwen3", "gigpo")])
def test_two_iterations_update_the_model(tmp_path, family, estimator):
    write(tmp_path, family, seed=11)
    qwen = checkpoint.load(tmp_path)
    before = jax.tree.map(np.array, nnx.state(qwen.model, nnx.Param))
    config = learn.LearnConfig(estimator=estimator, iterations=2, tasks_per_iteration=1, group_size=4,
                               max_new_tokens=6, window=0, learning_rate=1e-3)
    history = learn.train(qwen, DigitEnv, [0, 1], config)
    assert len(history) == 2 and all(np.isfinite(h["loss"]) for h in history)
    assert all(h["steps"] == 8 for h in history)  # 4 episodes x 2 steps
    assert 0 < np.mean([h["reward"] for h in history]) < 2  # rewards differ: advantages are not 0
    after = jax.tree.map(np.array, nnx.state(qwen.model, nnx.Param))
    moved = [float(np.abs(a - b).max()) for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after))]
    assert max(moved) > 0


def test_step_rows_put_each_step_advantage_on_its_action_tokens():
    from stepcredit.batch import StepRecord, Trajectory

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
