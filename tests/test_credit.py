"""compute_advantages: every registered estimator on one collated batch."""

import jax
import numpy as np
import pytest

from stepcredit import StepRecord, Trajectory, advantages as adv, collate
from stepcredit import credit as credit_module
from stepcredit.credit import (compiled_compute_advantages, compute_advantages, last_action_tokens,
                               token_rewards_from_steps)


def random_batch(seed=0, *, num_groups=3, group_size=4):
    rng = np.random.default_rng(seed)
    trajectories = []
    for g in range(num_groups):
        for _ in range(group_size):
            length = int(rng.integers(1, 5))
            steps = [StepRecord(observation_ids=[1], action_ids=list(range(int(rng.integers(1, 4)))),
                                action_logp=[], reward=float(rng.integers(0, 2)) if t == length - 1 else 0.0,
                                value=float(rng.normal()), anchor=int(rng.integers(0, 3)),
                                done=t == length - 1)
                     for t in range(length)]
            steps = [StepRecord(s.observation_ids, s.action_ids, (-rng.uniform(0, 2, len(s.action_ids))).tolist(),
                                s.reward, done=s.done, value=s.value, anchor=s.anchor,
                                action_entropy=rng.uniform(0, 2, len(s.action_ids)).tolist())
                     for s in steps]
            trajectories.append(Trajectory(steps=steps, group_id=10 * g + 7))
    steps, tokens, _ = collate(trajectories, with_observations=False)
    extra = {"token_values": rng.normal(size=tokens.tokens.shape).astype(np.float32),
             "prm_logp": (tokens.logp + rng.normal(size=tokens.logp.shape) * 0.1).astype(np.float32),
             "ref_logp": tokens.logp, "base_advantages": rng.normal(size=len(trajectories)).astype(np.float32),
             "mc_values": rng.normal(size=steps.reward.shape).astype(np.float32),
             "answer_logp": np.log(rng.uniform(0.05, 1.0, size=steps.reward.shape)).astype(np.float32),
             "progress": rng.normal(size=steps.reward.shape).astype(np.float32),
             "grounding": rng.random(steps.reward.shape) < 0.8}
    return steps, tokens, extra


@pytest.mark.parametrize("name", adv.names())
def test_every_registered_estimator_gives_finite_token_credit(name):
    steps, tokens, extra = random_batch()
    credit = compute_advantages(steps, tokens, name, **extra)
    out = np.asarray(credit.token_advantages)
    assert out.shape == tokens.tokens.shape
    assert np.all(np.isfinite(out)) and np.all(out[~tokens.action_mask] == 0)
    assert np.any(out != 0)


def test_group_estimators_broadcast_one_score_per_trajectory():
    steps, tokens, _ = random_batch(1)
    credit = compute_advantages(steps, tokens, "grpo")
    expected = np.asarray(adv.grpo(steps.score, steps.group_id))
    per_token = np.asarray(credit.token_advantages)
    for b in range(len(expected)):
        np.testing.assert_allclose(per_token[b, tokens.action_mask[b]], expected[b], atol=1e-6)


@pytest.mark.parametrize("call", [compute_advantages, compiled_compute_advantages])
def test_whiten_is_a_bool_or_none_not_a_word(call):
    steps, tokens, _ = random_batch(1)
    # "none" is a true string: it would turn whitening on.
    with pytest.raises(ValueError, match=f"{call.__name__}: whiten='none'; it must be True, "
                                         "False or None"):
        call(steps, tokens, "grpo", whiten="none")
    raw = compute_advantages(steps, tokens, "step_gae", lam=0.9, whiten=False).step_advantages
    whitened = call(steps, tokens, "step_gae", lam=0.9, whiten=True).step_advantages
    np.testing.assert_allclose(whitened, adv.masked_whiten(raw, steps.mask), atol=1e-5)
    assert np.abs(np.asarray(raw) - np.asarray(whitened)).max() > 1e-2


def test_the_compiled_credit_is_compiled_once_per_estimator_and_settings():
    steps, tokens, _ = random_batch(1)
    compiled_compute_advantages(steps, tokens, "grpo")
    hits = credit_module._compiled.cache_info().hits
    compiled_compute_advantages(steps, tokens, "grpo")
    assert credit_module._compiled.cache_info().hits == hits + 1


def test_step_gae_is_whitened_over_valid_steps_and_broadcast():
    steps, tokens, _ = random_batch(2)
    credit = compute_advantages(steps, tokens, "step_gae", lam=0.9)
    raw = adv.step_gae(steps.reward, steps.value, steps.mask, lam=0.9)
    np.testing.assert_allclose(credit.step_advantages, adv.masked_whiten(raw.advantages, steps.mask),
                               atol=1e-6)
    np.testing.assert_allclose(credit.token_advantages,
                               adv.broadcast_to_tokens(credit.step_advantages, tokens.step_index), atol=1e-6)
    np.testing.assert_allclose(credit.returns, raw.returns, atol=1e-6)
    unwhitened = compute_advantages(steps, tokens, "step_gae", lam=0.9, whiten=False)
    np.testing.assert_allclose(unwhitened.step_advantages, raw.advantages, atol=1e-6)


def test_token_rewards_sit_on_each_steps_last_action_token():
    step_index = np.array([[0, 0, 1, 2, 2, -1]])
    np.testing.assert_array_equal(last_action_tokens(step_index), [[False, True, True, False, True, False]])
    np.testing.assert_allclose(token_rewards_from_steps(np.array([[1.0, 2.0, 3.0]]), step_index),
                               [[0, 1, 2, 0, 3, 0]])


def test_compute_advantages_runs_under_jit():
    steps, tokens, extra = random_batch(3)
    fn = jax.jit(lambda s, t, v: compute_advantages(s, t, "token_gae", token_values=v).token_advantages)
    np.testing.assert_allclose(fn(steps, tokens, extra["token_values"]),
                               compute_advantages(steps, tokens, "token_gae",
                                                  token_values=extra["token_values"]).token_advantages,
                               atol=1e-5)


def test_missing_inputs_and_unknown_hyperparameters_are_named():
    steps, tokens, _ = random_batch()
    with pytest.raises(ValueError, match="'token_gae' needs token_values"):
        compute_advantages(steps, tokens, "token_gae")
    with pytest.raises(ValueError, match="'istar' needs prm_logp, ref_logp"):
        compute_advantages(steps, tokens, "istar")
    with pytest.raises(ValueError, match="'grpo' has no hyperparameter 'gamma'; it takes eps, num_groups, singleton, std"):
        compute_advantages(steps, tokens, "grpo", gamma=0.9)


@pytest.mark.parametrize("name", ["step_gae", "gigpo", "grpo+empg", "rloo+istar"])
def test_compiled_path_equals_eager(name):
    steps, tokens, extra = random_batch(4)
    extra.pop("base_advantages")
    eager = compute_advantages(steps, tokens, name, **extra)
    compiled = compiled_compute_advantages(steps, tokens, name, **extra)
    np.testing.assert_allclose(compiled.token_advantages, eager.token_advantages, atol=1e-5)
