"""turn_ppo: Turn-PPO's turn-level GAE is step GAE with a turn-level critic (a turn is a step)."""

import numpy as np

from stepcredit.advantages import registry
from stepcredit.advantages.gae import step_gae
from stepcredit.credit import compute_advantages
from tests.reference import gae as ref_gae
from tests.test_credit import random_batch


def test_registry_entry_is_step_gae_with_the_papers_defaults():
    entry = registry.get("turn_ppo")
    assert entry.fn is step_gae
    assert dict(entry.defaults) == {"gamma": 0.99, "lam": 0.9}
    assert entry.output_level == entry.input_level == "step" and entry.whiten == "steps"
    assert entry.needs_critic and not entry.needs_groups
    assert "2512.17008" in entry.paper and "step GAE" in entry.paper
    assert dict(entry.reads) == dict(registry.get("step_gae").reads)


def test_equals_step_gae_through_compute_advantages():
    for seed in range(3):
        steps, tokens, _ = random_batch(seed)
        turn = compute_advantages(steps, tokens, "turn_ppo")
        step = compute_advantages(steps, tokens, "step_gae", gamma=0.99, lam=0.9)
        np.testing.assert_allclose(turn.step_advantages, step.step_advantages, atol=1e-6)
        np.testing.assert_allclose(turn.token_advantages, step.token_advantages, atol=1e-6)
        # ... and both are the loop reference's GAE, whitened over valid steps.
        expected, _ = ref_gae.gae(steps.reward, steps.value, steps.mask, 0.99, 0.9)
        np.testing.assert_allclose(turn.step_advantages, ref_gae.whiten(expected, steps.mask),
                                   atol=1e-4)


def test_hyperparameters_override_like_step_gae():
    steps, tokens, _ = random_batch(4)
    turn = compute_advantages(steps, tokens, "turn_ppo", gamma=1.0, lam=1.0)
    step = compute_advantages(steps, tokens, "step_gae")
    np.testing.assert_allclose(turn.step_advantages, step.step_advantages, atol=1e-6)
