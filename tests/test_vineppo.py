"""vineppo: VinePPO's one-step TD errors on Monte Carlo values (step GAE with lam 0 on V_MC)."""

import jax
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from stepcredit import advantages as adv
from stepcredit.advantages.gae import step_gae
from stepcredit.credit import compiled_compute_advantages, compute_advantages
from tests.reference import gae as ref_gae
from tests.reference import vineppo as ref
from tests.test_credit import random_batch


def _mc_values(steps, seed):
    """Random V_MC at valid steps, NaN on padding (never read)."""
    values = np.random.default_rng(seed).uniform(-1, 1, steps.reward.shape)
    return np.where(steps.mask, values, np.nan).astype(np.float32)


def test_registry_entry_is_step_gae_with_lam_0_on_monte_carlo_values():
    entry = adv.get("vineppo")
    assert entry.fn is step_gae
    assert dict(entry.defaults) == {"gamma": 1.0, "lam": 0.0}
    assert entry.reads["values"] == "mc_values" and "bootstrap_value" not in entry.reads
    assert entry.needs_mc_values and not entry.needs_critic and not entry.needs_groups
    assert entry.output_level == entry.input_level == "step" and entry.whiten == "steps"
    assert "2410.01679" in entry.paper
    assert not any(adv.get(n).needs_mc_values for n in adv.names() if n != "vineppo")


def test_hand_computed_example():
    # K = 4 continuations from each of three states: returns [1, 0, 1, 0], [0, 0, 1, 0] and
    # [1, 1, 1, 0] give V_MC = 0.5, 0.25, 0.75; the episode ends with reward 1 at step 3.
    values = ref.mc_values([[1, 0, 1, 0], [0, 0, 1, 0], [1, 1, 1, 0]])
    np.testing.assert_allclose(values, [0.5, 0.25, 0.75])
    rewards, mask = np.array([[0.0, 0.0, 1.0]]), np.ones((1, 3), bool)
    out = adv.apply("vineppo", adv.CreditInputs(step_rewards=rewards, mc_values=values[None],
                                                 mask=mask))
    # A = (0 + 0.25 - 0.5, 0 + 0.75 - 0.25, 1 + 0 - 0.75): the last step has no V_MC after it.
    np.testing.assert_allclose(out.advantages, [[-0.25, 0.5, 0.25]], atol=1e-6)
    np.testing.assert_allclose(ref.vineppo(rewards, values[None], mask), [[-0.25, 0.5, 0.25]])


def test_matches_the_reference_with_padding_eager_and_jitted():
    for seed in range(3):
        steps, tokens, _ = random_batch(seed)
        values = _mc_values(steps, seed)
        raw = adv.apply("vineppo", adv.CreditInputs(step_rewards=steps.reward, mc_values=values,
                                                     mask=steps.mask))
        expected = ref.vineppo(steps.reward, values, steps.mask)
        np.testing.assert_allclose(raw.advantages, expected, atol=1e-5)
        eager = compute_advantages(steps, tokens, "vineppo", mc_values=values)
        np.testing.assert_allclose(eager.step_advantages, ref_gae.whiten(expected, steps.mask),
                                   atol=1e-4)
        jitted = compiled_compute_advantages(steps, tokens, "vineppo", mc_values=values)
        np.testing.assert_allclose(jitted.token_advantages, eager.token_advantages, atol=1e-6)


def test_is_step_gae_on_the_monte_carlo_values_and_ignores_the_critic():
    steps, tokens, _ = random_batch(5)
    values = _mc_values(steps, 5)
    vine = compute_advantages(steps, tokens, "vineppo", mc_values=values)
    # The critic's values and bootstrap are not read: after the last step V_MC is 0.
    critic = steps._replace(value=np.where(steps.mask, values, 0.0).astype(np.float32),
                            bootstrap_value=np.zeros_like(steps.bootstrap_value))
    step = compute_advantages(critic, tokens, "step_gae", lam=0.0)
    np.testing.assert_allclose(vine.step_advantages, step.step_advantages, atol=1e-6)
    other = compute_advantages(steps._replace(value=steps.value + 3.0), tokens, "vineppo",
                               mc_values=values)
    np.testing.assert_array_equal(other.token_advantages, vine.token_advantages)


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), gamma=st.sampled_from([1.0, 0.9]))
def test_true_values_give_one_step_td_errors_and_lam_1_gives_returns_minus_values(seed, gamma):
    """With continuations that estimate V exactly, VinePPO's A_t is the one-step TD error of
    the true values; at lam 1 it is the Monte Carlo return minus V_MC(s_t); at gamma 1 and
    lam 0 a trajectory's advantages sum to its return minus V_MC(s_0)."""
    rng = np.random.default_rng(seed)
    mask = np.arange(6)[None, :] < rng.integers(1, 7, (4, 1))
    rewards = np.where(mask, rng.integers(0, 2, (4, 6)), 0).astype(np.float32)
    # K identical continuations (a deterministic policy): V_MC is the true value-to-go.
    true = ref_gae.discounted_returns(rewards, mask, gamma)
    values = ref.mc_values(np.repeat(true.reshape(-1, 1), 3, axis=1)).reshape(true.shape)
    inputs = adv.CreditInputs(step_rewards=rewards, mc_values=values.astype(np.float32),
                              mask=mask)
    td = adv.apply("vineppo", inputs, {"gamma": gamma}).advantages
    np.testing.assert_allclose(td, ref.vineppo(rewards, true, mask, gamma), atol=1e-5)
    np.testing.assert_allclose(td, 0.0, atol=1e-5)  # true values: every TD error is 0
    noisy = np.where(mask, values + rng.normal(size=values.shape), 0.0).astype(np.float32)
    inputs = inputs._replace(mc_values=noisy)
    lam1 = adv.apply("vineppo", inputs, {"gamma": gamma, "lam": 1.0}).advantages
    np.testing.assert_allclose(lam1, np.where(mask, true - noisy, 0.0), atol=1e-5)
    if gamma == 1.0:
        lam0 = np.asarray(adv.apply("vineppo", inputs).advantages)
        np.testing.assert_allclose(lam0.sum(1), rewards.sum(1) - noisy[:, 0], atol=1e-5)


def test_vmapped_over_batches():
    steps, _, _ = random_batch(2)
    values = np.where(steps.mask, _mc_values(steps, 2), 0.0)
    stacked = [np.stack([x, x[::-1]]) for x in (steps.reward, values, steps.mask)]
    out = jax.vmap(lambda r, v, m: step_gae(r, v, m, gamma=1.0, lam=0.0).advantages)(*stacked)
    np.testing.assert_allclose(out[0], ref.vineppo(steps.reward, values, steps.mask), atol=1e-5)
    np.testing.assert_allclose(out[1], ref.vineppo(steps.reward[::-1], values[::-1],
                                                   steps.mask[::-1]), atol=1e-5)
