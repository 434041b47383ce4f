"""token_gae, step_gae, lambda_returns and discounted_returns against NumPy loops and rlax."""

import functools

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import rlax
from hypothesis import given
from jax.experimental import checkify
from jax.sharding import PartitionSpec as P

from stepcredit.advantages import (discounted_returns, lambda_returns, reinforce_pp,
                                   reverse_linear_recurrence, step_gae, token_gae)
from tests.reference import gae as ref

B, T = 8, 12
GAMMA, LAM = 0.99, 0.95


def random_batch(seed, *, batch=B, length=T, holes=True):
    """Rewards, values, mask and bootstrap values with padding, dones and truncations.

    Masked positions hold NaN, so any leak of padding into the math shows up.
    """
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, length + 1, size=batch)
    mask = np.arange(length)[None] < lengths[:, None]
    if holes:  # interior masked positions, as observation tokens between actions
        mask &= rng.random((batch, length)) > 0.25
        mask[np.arange(batch), 0] = True
    rewards = np.where(mask, rng.normal(size=(batch, length)), np.nan).astype(np.float32)
    values = np.where(mask, rng.normal(size=(batch, length)), np.nan).astype(np.float32)
    truncated = rng.random(batch) < 0.5
    bootstrap = np.where(truncated, rng.normal(size=batch), 0.0).astype(np.float32)
    return rewards, values, mask, bootstrap


def assert_close(actual, expected, scale_tol=1e-5):
    expected = np.asarray(expected, np.float64)
    tol = scale_tol * max(1.0, float(np.max(np.abs(expected))))
    np.testing.assert_allclose(np.asarray(actual, np.float64), expected, rtol=0, atol=tol)


@pytest.mark.parametrize("method", ["sequential", "associative"])
@pytest.mark.parametrize("fn", [step_gae, token_gae])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gae_matches_numpy_loop(fn, method, seed):
    rewards, values, mask, bootstrap = random_batch(seed)
    out = fn(rewards, values, mask, gamma=GAMMA, lam=LAM, bootstrap_value=bootstrap, method=method)
    expected_adv, expected_ret = ref.gae(rewards, values, mask, GAMMA, LAM, bootstrap)
    assert_close(out.advantages, expected_adv)
    assert_close(out.returns, expected_ret)
    assert np.all(np.asarray(out.advantages)[~mask] == 0)


@pytest.mark.parametrize("gamma, lam", [(1.0, 1.0), (0.9, 0.0), (0.5, 0.7)])
def test_gae_matches_numpy_loop_across_hyperparameters(gamma, lam):
    rewards, values, mask, bootstrap = random_batch(7)
    out = step_gae(rewards, values, mask, gamma=gamma, lam=lam, bootstrap_value=bootstrap)
    expected_adv, _ = ref.gae(rewards, values, mask, gamma, lam, bootstrap)
    assert_close(out.advantages, expected_adv, 1e-4 if gamma == lam == 1 else 1e-5)


def test_step_gae_matches_rlax_on_rows_with_padding_removed():
    rng = np.random.default_rng(3)
    valid_per_row = 9
    mask = np.zeros((B, T), bool)
    for row in mask:  # every row has the same number of valid steps, at random positions
        row[np.sort(rng.choice(T, valid_per_row, replace=False))] = True
    rewards = np.where(mask, rng.normal(size=(B, T)), np.nan).astype(np.float32)
    values = np.where(mask, rng.normal(size=(B, T)), np.nan).astype(np.float32)
    bootstrap = rng.normal(size=B).astype(np.float32)
    out = step_gae(rewards, values, mask, gamma=GAMMA, lam=LAM, bootstrap_value=bootstrap)

    compact = lambda x: x[mask].reshape(B, valid_per_row)  # noqa: E731
    values_tp1 = np.concatenate([compact(values), bootstrap[:, None]], axis=1)
    rlax_gae = jax.vmap(rlax.truncated_generalized_advantage_estimation, in_axes=(0, 0, None, 0))
    expected = rlax_gae(compact(rewards), np.full((B, valid_per_row), GAMMA, np.float32), LAM,
                        values_tp1)
    assert_close(compact(np.asarray(out.advantages)), expected)


def test_hand_computed_three_step_example():
    out = step_gae(jnp.array([[0.0, 0.0, 1.0]]), jnp.array([[0.5, 0.6, 0.8]]),
                   jnp.array([[True, True, True]]), gamma=0.9, lam=0.5)
    np.testing.assert_allclose(out.advantages, [[0.1345, 0.21, 0.2]], atol=1e-6)
    np.testing.assert_allclose(out.returns, [[0.6345, 0.81, 1.0]], atol=1e-6)
    interleaved = token_gae(jnp.array([[0.0, 5.0, 0.0, 5.0, 5.0, 1.0]]),
                            jnp.array([[0.5, jnp.nan, 0.6, 3.0, 3.0, 0.8]]),
                            jnp.array([[True, False, True, False, False, True]]), gamma=0.9, lam=0.5)
    np.testing.assert_allclose(interleaved.advantages, [[0.1345, 0, 0.21, 0, 0, 0.2]], atol=1e-6)
    np.testing.assert_allclose(discounted_returns(jnp.array([[0.0, 0.0, 1.0]]),
                                                  jnp.ones((1, 3), bool), gamma=0.9),
                               [[0.81, 0.9, 1.0]], atol=1e-6)


def test_recurrence_example_and_methods_agree():
    x, c = jnp.ones((1, 3)), jnp.full((1, 3), 0.5)
    for method in ("sequential", "associative"):
        np.testing.assert_allclose(reverse_linear_recurrence(x, c, jnp.zeros(1), method=method),
                                   [[1.75, 1.5, 1.0]])
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(B, 64)), jnp.float32)
    c = jnp.asarray(rng.uniform(size=(B, 64)), jnp.float32)
    y0 = jnp.asarray(rng.normal(size=B), jnp.float32)
    assert_close(reverse_linear_recurrence(x, c, y0, method="associative"),
                 reverse_linear_recurrence(x, c, y0, method="sequential"))
    with pytest.raises(ValueError, match="method='parallel'"):
        reverse_linear_recurrence(x, c, y0, method="parallel")


seeds = st.integers(0, 2**16)
unit = st.floats(0.0, 1.0)


@given(seed=seeds, gamma=unit)
def test_lam_one_gives_discounted_returns_minus_values(seed, gamma):
    rewards, values, mask, bootstrap = random_batch(seed)
    out = step_gae(rewards, values, mask, gamma=gamma, lam=1.0, bootstrap_value=bootstrap)
    returns = discounted_returns(rewards, mask, gamma=gamma, bootstrap_value=bootstrap)
    assert_close(out.advantages, np.where(mask, returns - np.nan_to_num(values), 0.0), 1e-4)


@given(seed=seeds, gamma=unit)
def test_lam_zero_gives_one_step_td_errors(seed, gamma):
    rewards, values, _, bootstrap = random_batch(seed, holes=False)
    mask = np.ones_like(rewards, bool)
    rewards, values = np.nan_to_num(rewards), np.nan_to_num(values)
    out = step_gae(rewards, values, mask, gamma=gamma, lam=0.0, bootstrap_value=bootstrap)
    next_values = np.concatenate([values[:, 1:], bootstrap[:, None]], axis=1)
    assert_close(out.advantages, rewards + gamma * next_values - values)


@given(seed=seeds, gamma=unit, lam=unit)
def test_lambda_returns_equal_gae_returns(seed, gamma, lam):
    rewards, values, mask, bootstrap = random_batch(seed)
    out = step_gae(rewards, values, mask, gamma=gamma, lam=lam, bootstrap_value=bootstrap)
    assert_close(lambda_returns(rewards, values, mask, gamma=gamma, lam=lam,
                                bootstrap_value=bootstrap), out.returns)


@given(seed=seeds, fill=st.sampled_from([np.nan, np.inf, -7.0, 1e6]))
def test_masked_entries_do_not_change_the_output(seed, fill):
    rewards, values, mask, bootstrap = random_batch(seed)
    base = token_gae(rewards, values, mask, gamma=GAMMA, lam=LAM, bootstrap_value=bootstrap)
    filled = token_gae(np.where(mask, rewards, fill).astype(np.float32),
                       np.where(mask, values, fill).astype(np.float32), mask,
                       gamma=GAMMA, lam=LAM, bootstrap_value=bootstrap)
    np.testing.assert_array_equal(base.advantages, filled.advantages)
    np.testing.assert_array_equal(base.returns, filled.returns)


@given(seed=seeds, extra=st.sampled_from([1, 4]))
def test_trailing_padding_does_not_change_the_output(seed, extra):
    rewards, values, mask, bootstrap = random_batch(seed)
    pad = lambda x, v: np.pad(x, ((0, 0), (0, extra)), constant_values=v)  # noqa: E731
    base = step_gae(rewards, values, mask, gamma=GAMMA, lam=LAM, bootstrap_value=bootstrap)
    padded = step_gae(pad(rewards, np.nan), pad(values, np.nan), pad(mask, False),
                      gamma=GAMMA, lam=LAM, bootstrap_value=bootstrap)
    assert_close(np.asarray(padded.advantages)[:, :T], base.advantages)
    assert np.all(np.asarray(padded.advantages)[:, T:] == 0)


@given(seed=seeds, cut=st.integers(1, T - 1))
def test_splitting_at_a_truncation_with_its_bootstrap_equals_the_whole(seed, cut):
    rewards, values, _, bootstrap = random_batch(seed, holes=False)
    rewards, values = np.nan_to_num(rewards), np.nan_to_num(values)
    mask = np.ones_like(rewards, bool)
    whole = step_gae(rewards, values, mask, gamma=GAMMA, lam=1.0, bootstrap_value=bootstrap)
    tail = step_gae(rewards[:, cut:], values[:, cut:], mask[:, cut:], gamma=GAMMA, lam=1.0,
                    bootstrap_value=bootstrap)
    # lam = 1: the head's bootstrap is the tail's first return, the value after the cut.
    head = step_gae(rewards[:, :cut], values[:, :cut], mask[:, :cut], gamma=GAMMA, lam=1.0,
                    bootstrap_value=np.asarray(tail.returns)[:, 0])
    assert_close(np.concatenate([head.advantages, tail.advantages], axis=1), whole.advantages)
    # Any lam: truncating at `cut` and bootstrapping from V(s_cut) is GAE on the head alone.
    head_td = step_gae(rewards[:, :cut], values[:, :cut], mask[:, :cut], gamma=GAMMA, lam=LAM,
                       bootstrap_value=values[:, cut])
    expected, _ = ref.gae(rewards[:, :cut], values[:, :cut], mask[:, :cut], GAMMA, LAM, values[:, cut])
    assert_close(head_td.advantages, expected)


@given(seed=seeds)
def test_token_gae_with_one_action_token_per_step_equals_step_gae(seed):
    rng = np.random.default_rng(seed)
    rewards, values, mask, bootstrap = random_batch(seed, holes=False)
    steps = step_gae(rewards, values, mask, gamma=GAMMA, lam=LAM, bootstrap_value=bootstrap)
    # Interleave 0-2 observation tokens (mask False) before every action token.
    n_obs = rng.integers(0, 3, size=T)
    positions = np.cumsum(n_obs + 1) - 1
    length = positions[-1] + 1
    spread = lambda x, fill: np.full((B, length), fill, x.dtype)  # noqa: E731
    token_rewards, token_values, token_mask = spread(rewards, 9.0), spread(values, 9.0), spread(mask, False)
    token_rewards[:, positions], token_values[:, positions], token_mask[:, positions] = rewards, values, mask
    tokens = token_gae(token_rewards, token_values, token_mask, gamma=GAMMA, lam=LAM,
                       bootstrap_value=bootstrap)
    assert_close(np.asarray(tokens.advantages)[:, positions], steps.advantages)
    assert_close(np.asarray(tokens.returns)[:, positions], steps.returns)


_jit_step_gae = jax.jit(functools.partial(step_gae, gamma=GAMMA, lam=LAM))


@pytest.mark.parametrize("method", ["sequential", "associative"])
def test_jit_vmap_and_sharding_agree_with_eager(mesh4, method):
    rewards, values, mask, bootstrap = random_batch(11)
    fn = functools.partial(step_gae, gamma=GAMMA, lam=LAM, method=method)
    eager = fn(rewards, values, mask, bootstrap_value=bootstrap)
    jitted = jax.jit(fn)(rewards, values, mask, bootstrap_value=bootstrap)
    assert_close(jitted.advantages, eager.advantages, 1e-6)

    stacked = [np.stack([x, x[::-1]]) for x in (rewards, values, mask, bootstrap)]
    vmapped = jax.vmap(lambda r, v, m, b: fn(r, v, m, bootstrap_value=b))(*stacked)
    assert_close(vmapped.advantages[0], eager.advantages, 1e-6)
    assert_close(vmapped.advantages[1], np.asarray(eager.advantages)[::-1], 1e-6)

    sharded = jax.jit(jax.shard_map(lambda r, v, m, b: fn(r, v, m, bootstrap_value=b), mesh=mesh4,
                                    in_specs=P("data"), out_specs=P("data")))
    out = sharded(rewards, values, mask, bootstrap)
    assert_close(out.advantages, eager.advantages, 1e-6)
    assert_close(out.returns, eager.returns, 1e-6)


def test_pmap_agrees_with_eager():
    rewards, values, mask, bootstrap = random_batch(12)
    split = lambda x: x.reshape(4, B // 4, *x.shape[1:])  # noqa: E731
    out = jax.pmap(lambda r, v, m, b: step_gae(r, v, m, gamma=GAMMA, lam=LAM, bootstrap_value=b),
                   devices=jax.devices()[:4])(*(split(x) for x in (rewards, values, mask, bootstrap)))
    eager = step_gae(rewards, values, mask, gamma=GAMMA, lam=LAM, bootstrap_value=bootstrap)
    assert_close(np.asarray(out.advantages).reshape(B, T), eager.advantages, 1e-6)


def test_checkify_catches_nan_under_jit_as_documented():
    rewards, values, mask, _ = random_batch(4)
    rewards[0, 0] = np.nan

    def checked(rewards, values, mask):
        finite = jnp.isfinite(jnp.where(mask, rewards + values, 0.0))
        checkify.check(jnp.all(finite), "step_gae: non-finite rewards or values")
        return step_gae(rewards, values, mask)

    error, _ = jax.jit(checkify.checkify(checked))(rewards, values, mask)
    with pytest.raises(checkify.JaxRuntimeError, match="non-finite"):
        error.throw()
    # Under jit the value check is skipped (no device sync): shapes only.
    _jit_step_gae(rewards, values, mask)


@pytest.mark.parametrize("fn", [step_gae, token_gae])
def test_bad_input_errors_name_the_argument(fn):
    rewards, values, mask, bootstrap = random_batch(5)
    call = functools.partial(fn, gamma=GAMMA, lam=LAM)
    name = fn.__name__
    with pytest.raises(ValueError, match=rf"{name}: rewards has shape \(8, 12\) but values has shape \(8, 11\)"):
        call(rewards, values[:, :-1], mask)
    with pytest.raises(ValueError, match=rf"{name}: values has shape \(96,\) \(rank 1\)"):
        call(rewards, values.reshape(-1), mask)
    with pytest.raises(TypeError, match=rf"{name}: rewards has dtype int32"):
        call(np.nan_to_num(rewards).astype(np.int32), values, mask)
    with pytest.raises(TypeError, match=rf"{name}: mask has dtype float32"):
        call(rewards, values, mask.astype(np.float32))
    with pytest.raises(ValueError, match=rf"{name}: bootstrap_value has shape \(3,\)"):
        call(rewards, values, mask, bootstrap_value=bootstrap[:3])
    bad = rewards.copy()
    bad[2, 0] = np.inf
    with pytest.raises(ValueError, match=rf"{name}: rewards is not finite at index \(2, 0\)"):
        call(bad, values, mask)
    bad = values.copy()
    bad[3, 0] = np.nan
    with pytest.raises(ValueError, match=rf"{name}: values is not finite at index \(3, 0\)"):
        call(rewards, bad, mask)
    with pytest.raises(ValueError, match=rf"{name}: gamma=1.5 is outside \[0, 1\]"):
        fn(rewards, values, mask, gamma=1.5, lam=LAM)
    with pytest.raises(ValueError, match=rf"{name}: lam=-0.1 is outside \[0, 1\]"):
        fn(rewards, values, mask, gamma=GAMMA, lam=-0.1)


def test_integer_masks_are_accepted():
    rewards, values, mask, _ = random_batch(6)
    a = step_gae(rewards, values, mask)
    b = step_gae(rewards, values, mask.astype(np.int32))
    np.testing.assert_array_equal(a.advantages, b.advantages)


def test_an_empty_step_axis_gives_empty_credit():
    """T = 0: empty outputs with or without a bootstrap value (the default read column 0)."""
    rewards, mask = np.zeros((3, 0), np.float32), np.zeros((3, 0), bool)
    for bootstrap in (None, np.ones(3, np.float32)):
        advantages, returns = step_gae(rewards, rewards, mask, bootstrap_value=bootstrap)
        assert advantages.shape == returns.shape == (3, 0)
    assert discounted_returns(rewards, mask, gamma=0.9).shape == (3, 0)
    assert reinforce_pp(rewards, mask).shape == (3, 0)
