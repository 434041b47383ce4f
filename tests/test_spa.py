"""SPA-RL against its NumPy loop reference, the docstring examples, and properties tying it to
token GAE (no grounding term: GAE on the contributions) and to the outcome (contributions that
sum to it, uniform contributions), plus the progress estimator's sum-to-outcome loss."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stepcredit import advantages as adv
from stepcredit.advantages.inputs import CreditInputs
from stepcredit.advantages.spa import progress_loss, spa, spa_step_rewards
from tests.reference import spa as ref
from tests.test_gigpo import _close

B, T, N = 4, 5, 16
_spa = jax.jit(spa, static_argnames=("method",))


def _batch(seed):
    """Prefix step masks (one empty row), 1-2 tokens per step with observation gaps, NaN padding."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, T + 1, size=B)
    lengths[2] = 0
    mask = np.arange(T)[None, :] < lengths[:, None]
    step_index = np.full((B, N), -1, np.int32)
    for b in range(B):
        position = 0
        for t in range(lengths[b]):
            position += int(rng.integers(0, 2))  # an observation token or none
            width = int(rng.integers(1, 3))
            step_index[b, position:position + width] = t
            position += width
    progress = np.where(mask, rng.normal(size=(B, T)), np.nan).astype(np.float32)
    grounding = mask & (rng.random((B, T)) < 0.7)
    values = np.where(step_index >= 0, rng.normal(size=(B, N)), np.nan).astype(np.float32)
    bootstrap = rng.normal(size=B).astype(np.float32)
    return progress, grounding, mask, step_index, values, bootstrap


def test_docstring_examples():
    _close(spa_step_rewards(np.array([[0.2, 0.3, 0.5]]), np.array([[1.0, 0.0, 1.0]]),
                            np.ones((1, 3), bool)), [[0.7, 0.3, 1.0]])
    out = spa(np.array([[0.2, 0.3, 0.5]], np.float32), np.array([[True, False, True]]),
              np.ones((1, 3), bool), np.array([[0, 0, 1, 2]]), np.zeros((1, 4), np.float32),
              gamma=1.0, lam=1.0)
    _close(out.advantages, [[2.0, 2.0, 1.3, 1.0]])
    _close(out.returns, [[2.0, 2.0, 1.3, 1.0]])  # V = 0: returns are the advantages
    # gamma 0.5: A_2 = 1.0, A_1 = 0.3 + 0.5 A_2 = 0.8, A_0 = 0.7 + 0.5 A_1 = 1.1 (lam 1, V 0).
    out = spa(np.array([[0.2, 0.3, 0.5]], np.float32), np.array([[True, False, True]]),
              np.ones((1, 3), bool), np.array([[0, 1, 2]]), np.zeros((1, 3), np.float32),
              gamma=0.5, lam=1.0)
    _close(out.advantages, [[1.1, 0.8, 1.0]])
    loss = progress_loss(np.array([[0.2, 0.3], [0.5, 0.0]]), np.array([[1, 1], [1, 0]]),
                         np.array([1.0, 0.0]))
    _close(loss, 0.25)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_the_reference(seed):
    progress, grounding, mask, step_index, values, bootstrap = _batch(seed)
    kwargs = dict(alpha=0.8, beta=0.5, gamma=0.99, lam=0.95)
    out = _spa(progress, grounding, mask, step_index, values, bootstrap, **kwargs)
    advantages, returns = ref.spa(progress, grounding, mask, step_index, values, bootstrap,
                                  **kwargs)
    _close(out.advantages, advantages)
    _close(out.returns, returns)
    eager = spa(progress, grounding.astype(np.float32), mask, step_index, values, bootstrap,
                **kwargs)  # eager, with a float grounding signal
    _close(eager.advantages, advantages)


def test_without_grounding_it_is_token_gae_on_the_contributions():
    progress, grounding, mask, step_index, values, bootstrap = _batch(3)
    out = _spa(progress, grounding, mask, step_index, values, bootstrap, beta=0.0, gamma=0.9,
               lam=0.8)
    inputs = CreditInputs(mask=mask, step_rewards=np.where(mask, progress, 0.0),
                          step_index=step_index, token_values=values, bootstrap_value=bootstrap)
    gae = adv.apply("token_gae", inputs, {"gamma": 0.9, "lam": 0.8})
    _close(out.advantages, gae.advantages)
    _close(out.returns, gae.returns)


@settings(max_examples=15, deadline=None)
@given(outcome=st.floats(-2.0, 2.0), length=st.integers(1, T), seed=st.integers(0, 2**16))
def test_contributions_summing_to_the_outcome(outcome, length, seed):
    """gamma = lam = 1, V = 0, no grounding: step t's credit is the sum of the contributions
    from t on, so the first step gets the outcome; uniform contributions R / T give
    R (T - t) / T."""
    mask = np.zeros((1, T), bool)
    mask[0, :length] = True
    step_index = np.where(np.arange(T) < length, np.arange(T), -1)[None].astype(np.int32)
    zeros = np.zeros((1, T), np.float32)
    rng = np.random.default_rng(seed)
    split = rng.dirichlet(np.ones(length)) * outcome
    progress = np.zeros((1, T), np.float32)
    progress[0, :length] = split
    out = _spa(progress, mask, mask, step_index, zeros, beta=0.0, gamma=1.0, lam=1.0)
    _close(out.advantages[0, 0], outcome, tol=1e-4)
    _close(progress_loss(progress, mask, np.array([outcome], np.float32)), 0.0, tol=1e-4)
    uniform = np.where(mask, outcome / length, 0.0).astype(np.float32)
    out = _spa(uniform, mask, mask, step_index, zeros, beta=0.0, gamma=1.0, lam=1.0)
    expected = np.where(mask[0], outcome * (length - np.arange(T)) / length, 0.0)
    _close(out.advantages[0], expected, tol=1e-4)


def test_the_grounding_term_counts_the_executed_actions_ahead():
    """alpha = 0, gamma = lam = 1, V = 0: the credit of step t is beta times the executed
    actions from t on."""
    _, grounding, mask, step_index, values, _ = _batch(4)
    out = _spa(np.zeros((B, T), np.float32), grounding, mask, step_index, np.zeros_like(values),
               alpha=0.0, beta=0.5, gamma=1.0, lam=1.0)
    ahead = 0.5 * np.cumsum(grounding[:, ::-1], axis=1)[:, ::-1]
    per_token = np.where(step_index >= 0, np.take_along_axis(ahead, np.maximum(step_index, 0), 1),
                         0.0)
    _close(out.advantages, per_token)


def test_the_registry_entry_runs_spa_at_the_papers_defaults():
    progress, grounding, mask, step_index, values, bootstrap = _batch(5)
    entry = adv.get("spa")
    assert entry.needs_progress and entry.needs_critic and entry.whiten == "tokens"
    assert not adv.get("token_gae").needs_progress
    inputs = CreditInputs(mask=mask, step_index=step_index, token_values=values,
                          bootstrap_value=bootstrap, progress=progress, grounding=grounding)
    out = adv.apply("spa", inputs)
    expected = ref.spa(progress, grounding, mask, step_index, values, bootstrap, alpha=1.0,
                       beta=0.5, gamma=0.99, lam=0.95)
    _close(out.advantages, expected[0])
    assert out.level == "token"
    with pytest.raises(ValueError, match="needs grounding, progress"):
        adv.apply("spa", inputs._replace(progress=None, grounding=None))


def test_progress_loss_matches_the_reference_and_its_gradient():
    progress, _, mask, _, _, _ = _batch(6)
    outcomes = np.array([1.0, 0.0, 0.5, -0.2], np.float32)
    _close(progress_loss(progress, mask, outcomes), ref.progress_loss(progress, mask, outcomes))
    grad = np.asarray(jax.grad(progress_loss)(jnp.nan_to_num(jnp.asarray(progress)), mask,
                                              outcomes))
    # dL/dc_t = 2 (sum c - R) / (trajectories with a step), the same on a row's valid steps.
    clean = np.where(mask, progress, 0.0)
    expected = np.where(mask, 2 * (clean.sum(1) - outcomes)[:, None] / 3, 0.0)
    _close(grad, expected)
    empty = np.zeros((2, T), bool)
    assert float(progress_loss(np.ones((2, T), np.float32), empty, np.ones(2))) == 0.0
    assert not np.asarray(jax.grad(progress_loss)(jnp.ones((2, T)), empty, jnp.ones(2))).any()


def test_bad_inputs_name_the_argument():
    progress, grounding, mask, step_index, values, _ = _batch(7)
    with pytest.raises(ValueError, match="progress has shape .* grounding has shape"):
        spa(progress, grounding[:, :-1], mask, step_index, values)
    with pytest.raises(TypeError, match="progress has dtype int32"):
        spa(np.zeros((B, T), np.int32), grounding, mask, step_index, values)
    with pytest.raises(ValueError, match="progress is not finite at index"):
        spa(np.where(mask, np.inf, 0.0).astype(np.float32), grounding, mask, step_index, values)
    with pytest.raises(ValueError, match="outcomes has shape"):
        progress_loss(progress, mask, np.zeros(B + 1, np.float32))
