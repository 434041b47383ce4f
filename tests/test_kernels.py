"""Every recurrence method, alone and inside step/token GAE, against the NumPy loops.

Shapes are odd on purpose: lengths that are not a multiple of the chunked
method's block (`_BLOCK`), length 1, all-masked rows, interleaved masks and NaN
at masked positions; each check also runs under jit, vmap and shard_map.
"""

import functools

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from stepcredit.advantages import reverse_linear_recurrence, step_gae, token_gae
from stepcredit.advantages.gae import GAE_METHODS
from stepcredit.advantages.recurrence import _BLOCK, METHODS
from tests.reference import gae as ref

GAMMA, LAM = 0.99, 0.95
B = 8
# 1, 3 (inside one block), a block + 1, 75 (ragged at each level), 200 (three levels).
LENGTHS = (1, 3, _BLOCK + 1, 75, 200)


def odd_batch(seed, length):
    """GAE inputs with NaN at masked positions, an all-masked row, an interleaved
    mask (every other position), a row valid only at its last position, and
    random holes elsewhere."""
    rng = np.random.default_rng(seed)
    mask = rng.random((B, length)) > 0.3
    mask[0] = False
    mask[1] = np.arange(length) % 2 == 0
    mask[2] = np.arange(length) == length - 1
    mask[3] = True
    rewards = np.where(mask, rng.normal(size=(B, length)), np.nan).astype(np.float32)
    values = np.where(mask, rng.normal(size=(B, length)), np.nan).astype(np.float32)
    bootstrap = np.where(rng.random(B) < 0.5, rng.normal(size=B), 0.0).astype(np.float32)
    return rewards, values, mask, bootstrap


def reference_recurrence(x, c, y_init):
    x, c = np.asarray(x, np.float64), np.asarray(c, np.float64)
    y, out = np.asarray(y_init, np.float64), np.zeros_like(x)
    for t in reversed(range(x.shape[1])):
        y = x[:, t] + c[:, t] * y
        out[:, t] = y
    return out


def assert_close(actual, expected, scale_tol=1e-5):
    expected = np.asarray(expected, np.float64)
    tol = scale_tol * max(1.0, float(np.max(np.abs(expected), initial=0.0)))
    np.testing.assert_allclose(np.asarray(actual, np.float64), expected, rtol=0, atol=tol)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("length", LENGTHS)
def test_recurrence_matches_loop_with_resets_and_carries(method, length):
    rng = np.random.default_rng(length)
    x = rng.normal(size=(B, length)).astype(np.float32)
    # Mix ordinary coefficients with exact resets (0) and exact carries (1).
    c = rng.choice(np.array([0.0, 1.0, 0.9, 0.3], np.float32), size=(B, length))
    c[0] = 1.0  # a pure running sum from the boundary value
    y_init = rng.normal(size=B).astype(np.float32)
    out = jax.jit(reverse_linear_recurrence, static_argnames="method")(x, c, y_init, method=method)
    assert_close(out, reference_recurrence(x, c, y_init))


@pytest.mark.parametrize("method", METHODS)
def test_long_products_underflow_without_nan(method):
    # c = 1e-3 over 300 steps: products reach 1e-900, far below float32's range.
    x = np.ones((2, 300), np.float32)
    c = np.full((2, 300), 1e-3, np.float32)
    out = np.asarray(reverse_linear_recurrence(x, c, np.array([1e30, 0.0], np.float32), method=method))
    assert np.all(np.isfinite(out))
    assert_close(out, reference_recurrence(x, c, np.array([1e30, 0.0])), 1e-6)


@pytest.mark.parametrize("method", GAE_METHODS)
@pytest.mark.parametrize("length", LENGTHS)
def test_gae_methods_match_numpy_loop_on_odd_shapes(length, method):
    # step_gae and token_gae share the kernel: one of them per shape keeps compiles few.
    fn = token_gae if length % 2 else step_gae
    rewards, values, mask, bootstrap = odd_batch(length, length)
    out = jax.jit(functools.partial(fn, gamma=GAMMA, lam=LAM, method=method))(
        rewards, values, mask, bootstrap_value=bootstrap)
    expected_adv, expected_ret = ref.gae(rewards, values, mask, GAMMA, LAM, bootstrap)
    assert_close(out.advantages, expected_adv)
    assert_close(out.returns, expected_ret)
    assert np.all(np.asarray(out.advantages)[~mask] == 0)
    assert np.all(np.asarray(out.advantages)[0] == 0)  # the all-masked row


@pytest.mark.parametrize("method", GAE_METHODS)
@pytest.mark.parametrize("gamma, lam", [(1.0, 1.0), (0.9, 0.0), (0.0, 0.5)])
def test_gae_methods_at_extreme_hyperparameters(method, gamma, lam):
    rewards, values, mask, bootstrap = odd_batch(9, 75)
    out = step_gae(rewards, values, mask, gamma=gamma, lam=lam, bootstrap_value=bootstrap,
                   method=method)
    expected_adv, _ = ref.gae(rewards, values, mask, gamma, lam, bootstrap)
    assert_close(out.advantages, expected_adv, 1e-4 if gamma == lam == 1 else 1e-5)


@pytest.mark.parametrize("method", GAE_METHODS)
def test_gae_methods_under_vmap_and_shard_map(mesh4, method):
    rewards, values, mask, bootstrap = odd_batch(3, 75)
    fn = functools.partial(step_gae, gamma=GAMMA, lam=LAM, method=method)
    expected_adv, _ = ref.gae(rewards, values, mask, GAMMA, LAM, bootstrap)

    stacked = [np.stack([x, x[::-1]]) for x in (rewards, values, mask, bootstrap)]
    vmapped = jax.jit(jax.vmap(lambda r, v, m, b: fn(r, v, m, bootstrap_value=b)))(*stacked)
    assert_close(vmapped.advantages[0], expected_adv)
    assert_close(vmapped.advantages[1], expected_adv[::-1])

    sharded = jax.jit(jax.shard_map(lambda r, v, m, b: fn(r, v, m, bootstrap_value=b), mesh=mesh4,
                                    in_specs=P("data"), out_specs=P("data")))
    assert_close(sharded(rewards, values, mask, bootstrap).advantages, expected_adv)


def test_methods_agree_with_each_other_to_float32_rounding():
    rewards, values, mask, bootstrap = odd_batch(5, 200)
    outs = [token_gae(rewards, values, mask, gamma=GAMMA, lam=LAM, bootstrap_value=bootstrap,
                      method=method).advantages for method in GAE_METHODS]
    for out in outs[1:]:
        assert_close(out, outs[0], 1e-6)
