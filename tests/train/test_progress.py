"""SPA's progress estimator in the trainer: its contributions are the value head at each step's
last action token, its optimizer steps lower the sum-to-outcome loss, and the grounding signal
is the environment's validity flag. (That it trains and is checkpointed with the run is checked
by the trainer's smoke test, `tests/train/test_trainer.py`.)"""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from stepcredit import advantages as adv
from stepcredit.batch import StepRecord, Trajectory, collate
from stepcredit.models.transformer import TransformerConfig, TransformerPolicy, forward
from stepcredit.train import progress
from stepcredit.train.build import progress_optimizer
from stepcredit.train.config import TrainConfig
from stepcredit.train.rows import build_rows

PAD = 0


def _trajectories():
    """Three trajectories of 1-3 steps, prompts of 3-5 ids, actions of 1-2 ids; one invalid step."""
    rng = np.random.default_rng(0)
    out = []
    for b, (length, score) in enumerate([(3, 1.0), (1, 0.0), (2, 0.5)]):
        steps = []
        for t in range(length):
            action = rng.integers(1, 30, size=int(rng.integers(1, 3))).tolist()
            steps.append(StepRecord(observation_ids=(), action_ids=action,
                                    action_logp=[0.0] * len(action), reward=0.0,
                                    info={"valid": not (b == 0 and t == 1)},
                                    prompt_ids=rng.integers(1, 30, size=int(rng.integers(3, 6)))
                                    .tolist()))
        out.append(Trajectory(steps, group_id=0, score=score))
    return out


def _batch(trajectories):
    steps, tokens, _ = collate(trajectories, max_steps=3, max_tokens=6, with_observations=False)
    rows, index = build_rows(trajectories, num_steps=3, row_length=32, pad_id=PAD, multiple=8)
    batch = progress.ProgressBatch(
        tokens=jnp.asarray(rows.tokens), mask=jnp.asarray(rows.mask),
        action_mask=jnp.asarray(rows.action_mask), index_b=jnp.asarray(index.b),
        index_n=jnp.asarray(index.n), step_index=jnp.asarray(tokens.step_index),
        step_mask=jnp.asarray(steps.mask), outcomes=jnp.asarray(steps.score))
    return batch, rows


def test_contributions_are_the_value_head_after_each_action_and_training_fits_the_outcomes():
    trajectories = _trajectories()
    batch, rows = _batch(trajectories)
    graphdef, params = nnx.split(TransformerPolicy(TransformerConfig(vocab_size=32, d_model=32,
                                                                     num_layers=1, num_heads=2,
                                                                     mlp_dim=64),
                                                   rngs=nnx.Rngs(0)))
    # A non-zero value head (it starts at zero), so that the contributions differ.
    params = jax.tree_util.tree_map_with_path(
        lambda path, x: (jax.random.normal(jax.random.key(1), x.shape) * 0.5
                         if "value_head" in jax.tree_util.keystr(path) else x), params)
    got = np.asarray(progress.contributions(params, batch, graphdef=graphdef))
    _, values = forward(graphdef, params, batch.tokens, batch.mask)
    expected = np.zeros((3, 3))
    for r in np.flatnonzero(rows.valid):
        expected[rows.trajectory[r], rows.step[r]] = values[r, rows.mask[r].sum() - 1]
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    assert got[1, 1:].tolist() == [0.0, 0.0]  # padding steps contribute nothing

    config = TrainConfig(progress_learning_rate=3e-3)
    tx = progress_optimizer(config)
    opt_state, losses = tx.init(params), []
    for _ in range(8):
        params, opt_state, loss = progress.progress_step(params, opt_state, batch,
                                                         graphdef=graphdef, tx=tx)
        losses.append(float(loss))
    final = float(adv.progress_loss(progress.contributions(params, batch, graphdef=graphdef),
                                    batch.step_mask, batch.outcomes))
    assert final < 0.5 * losses[0], (losses, final)
    assert progress.grounding_signal(trajectories, 3).tolist() == [
        [True, False, True], [True, False, False], [True, True, False]]
