"""The token <-> step bridge and masked whitening."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from stepcredit.advantages import (broadcast_to_tokens, masked_mean, masked_whiten, step_gae,
                                   step_rewards_from_tokens, step_values_from_tokens, token_gae)
from stepcredit.advantages.tokens import token_rewards_from_steps
from tests.reference import gae as ref

B, N, T = 8, 24, 5


def random_token_view(seed):
    """Step index runs of 1-4 action tokens separated by observation tokens (-1)."""
    rng = np.random.default_rng(seed)
    step_index = np.full((B, N), -1, np.int32)
    for b in range(B):
        position, steps = 0, rng.integers(1, T + 1)
        for t in range(steps):
            position += rng.integers(0, 3)
            width = rng.integers(1, 4)
            if position + width > N:
                break
            step_index[b, position:position + width] = t
            position += width
    values = rng.normal(size=(B, N)).astype(np.float32)
    values[step_index < 0] = np.nan
    return values, step_index


def test_examples_from_docstrings():
    np.testing.assert_allclose(step_rewards_from_tokens(jnp.array([[0.0, 0, 1, 0, 2]]),
                                                        jnp.array([[0, 0, 0, -1, 1]]), 2), [[1, 2]])
    np.testing.assert_allclose(step_values_from_tokens(jnp.array([[9.0, 0.5, 0.4, 9, 0.6]]),
                                                       jnp.array([[-1, 0, 0, -1, 1]]), 2), [[0.5, 0.6]])
    np.testing.assert_allclose(broadcast_to_tokens(jnp.array([[1.0, 2.0]]),
                                                   jnp.array([[-1, 0, 0, -1, 1]])), [[0, 1, 1, 0, 2]])
    np.testing.assert_allclose(masked_whiten(jnp.array([[1.0, 2, 3, jnp.nan]]),
                                             jnp.array([[True, True, True, False]])),
                               [[-1, 0, 1, 0]], atol=1e-6)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_bridge_matches_loops(seed):
    values, step_index = random_token_view(seed)
    np.testing.assert_allclose(step_rewards_from_tokens(values, step_index, T),
                               ref.step_sums(values, step_index, T), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(step_values_from_tokens(values, step_index, T),
                               ref.first_token_values(values, step_index, T), rtol=1e-6)
    step_values = np.random.default_rng(seed).normal(size=(B, T)).astype(np.float32)
    expected = np.where(step_index >= 0, step_values[np.arange(B)[:, None], np.maximum(step_index, 0)], 0)
    np.testing.assert_array_equal(broadcast_to_tokens(step_values, step_index), expected)


def test_step_gae_through_the_bridge_equals_token_gae_on_single_token_steps():
    # A step with one action token whose reward is the step reward: both views agree.
    values, step_index = random_token_view(3)
    first_of_step = np.zeros_like(step_index, bool)
    for b in range(B):
        seen = set()
        for n, t in enumerate(step_index[b]):
            if t >= 0 and t not in seen:
                first_of_step[b, n] = True
                seen.add(t)
    single = np.where(first_of_step, step_index, -1)
    rewards = np.where(first_of_step, np.random.default_rng(3).normal(size=(B, N)), 0).astype(np.float32)
    tokens = token_gae(rewards, values, single >= 0, gamma=0.99, lam=0.95)
    step_mask = np.asarray(step_values_from_tokens(np.ones((B, N), np.float32), single, T)) > 0
    steps = step_gae(step_rewards_from_tokens(rewards, single, T),
                     step_values_from_tokens(values, single, T), step_mask, gamma=0.99, lam=0.95)
    np.testing.assert_allclose(broadcast_to_tokens(steps.advantages, single), tokens.advantages,
                               atol=1e-5)


@pytest.mark.parametrize("unbiased", [True, False])
def test_masked_whiten_matches_numpy(unbiased):
    values, step_index = random_token_view(4)
    mask = step_index >= 0
    np.testing.assert_allclose(masked_whiten(values, mask, unbiased=unbiased),
                               ref.whiten(values, mask, unbiased), atol=1e-5)
    shifted = np.asarray(masked_whiten(values, mask, unbiased=unbiased, shift_mean=False))
    mean = np.nanmean(np.where(mask, values, np.nan))
    np.testing.assert_allclose(shifted[mask], ref.whiten(values, mask, unbiased)[mask] + mean, atol=1e-5)


def test_masked_whiten_with_one_or_no_valid_entry_is_finite():
    x = jnp.array([[3.0, jnp.nan]])
    np.testing.assert_array_equal(masked_whiten(x, jnp.array([[True, False]])), [[0.0, 0.0]])
    np.testing.assert_array_equal(masked_whiten(x, jnp.array([[False, False]])), [[0.0, 0.0]])


def test_masked_mean_is_the_mean_of_the_valid_entries_and_checks_them():
    x = jnp.array([[1.0, 2.0, jnp.nan], [4.0, 8.0, 16.0]])
    mask = jnp.array([[True, True, False], [True, False, False]])
    np.testing.assert_allclose(masked_mean(x, mask), 7.0 / 3.0, rtol=1e-6)
    assert masked_mean(x, jnp.zeros_like(mask)) == 0.0
    # A [B, 1] mask would broadcast over the columns and count each row three times.
    with pytest.raises(ValueError, match="masked_mean: x has shape .2, 3. but mask has shape "
                                         ".2, 1."):
        masked_mean(x, mask[:, :1])
    with pytest.raises(ValueError, match=r"masked_mean: x is not finite at index \(0, 2\)"):
        masked_mean(x, mask.at[0, 2].set(True))
    with pytest.raises(ValueError, match="masked_whiten: eps=-1.0; it must be finite and >= 0"):
        masked_whiten(x, mask, eps=-1.0)


def test_bridge_under_jit_and_sharding(mesh4):
    values, step_index = random_token_view(5)
    eager = step_values_from_tokens(values, step_index, T)
    jitted = jax.jit(step_values_from_tokens, static_argnums=2)(values, step_index, T)
    sharded = jax.jit(jax.shard_map(lambda v, s: step_values_from_tokens(v, s, T), mesh=mesh4,
                                    in_specs=P("data"), out_specs=P("data")))(values, step_index)
    np.testing.assert_array_equal(jitted, eager)
    np.testing.assert_array_equal(sharded, eager)


def test_bad_input_errors():
    values, step_index = random_token_view(6)
    with pytest.raises(ValueError, match=r"step_index holds \d but num_steps=2"):
        step_rewards_from_tokens(values, step_index, 2)
    with pytest.raises(ValueError, match=r"token_rewards has shape \(8, 24\) but step_index has shape \(8, 23\)"):
        step_rewards_from_tokens(values, step_index[:, 1:], T)
    with pytest.raises(TypeError, match="step_index has dtype float32"):
        step_values_from_tokens(values, step_index.astype(np.float32), T)
    with pytest.raises(ValueError, match="num_steps=0"):
        step_values_from_tokens(values, step_index, 0)
    with pytest.raises(ValueError, match=r"broadcast_to_tokens: step_values has shape \(3, 5\)"):
        broadcast_to_tokens(np.zeros((3, T), np.float32), step_index)
    # Token-level estimators derive their token rewards from step_rewards: named so.
    with pytest.raises(ValueError, match=r"token_rewards_from_steps: step_rewards has shape "
                                         r"\(3, 5\)"):
        token_rewards_from_steps(np.zeros((3, T), np.float32), step_index)
    with pytest.raises(ValueError, match=r"masked_whiten: x is not finite at index \(0, 1\)"):
        masked_whiten(np.array([[1.0, np.nan]]), np.array([[True, True]]))
