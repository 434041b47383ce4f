"""MaxRL against its NumPy loop reference and tied to Dr. GRPO."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

import stepcredit
from stepcredit.advantages import group, registry
from stepcredit.advantages.maxrl import maxrl
from tests.reference import maxrl as ref

B = 16

_maxrl = jax.jit(maxrl, static_argnames=("divide_by_group_size", "num_groups", "axis_name"))


def _close(actual, expected, tol=1e-5):
    expected = np.asarray(expected, np.float64)
    scale = max(1.0, float(np.abs(expected).max(initial=0.0)))
    np.testing.assert_allclose(np.asarray(actual, np.float64), expected, rtol=tol, atol=tol * scale)


def _batch(seed, *, binary=True):
    """Scores with a singleton, an all-equal, an all-failed and (non-binary) a negative group."""
    rng = np.random.default_rng(seed)
    ids = rng.choice(np.array([7, 1000, -3, 42], np.int32), size=B)
    ids[-1] = 123456                       # singleton
    ids[:3] = -77                          # all-equal (all successes)
    ids[3:6] = 55                          # all failures: mean 0
    scores = (rng.random(B) < 0.4).astype(np.float32)
    if not binary:
        scores = rng.normal(size=B).astype(np.float32) + 0.3
        ids[6:8] = 66
        scores[6:8] = [-1.0, -2.0]         # negative mean
    scores[:3] = 1.0
    scores[3:6] = 0.0
    return scores, ids


@pytest.mark.parametrize("binary", [True, False])
@pytest.mark.parametrize("eps,by_size", [(0.0, False), (1e-6, True)])
def test_matches_reference(binary, eps, by_size):
    for seed in range(3):
        scores, ids = _batch(seed, binary=binary)
        expected = ref.maxrl(scores, ids, eps, by_size)
        if seed == 0:
            _close(maxrl(scores, ids, eps=eps, divide_by_group_size=by_size), expected)
        out = np.asarray(_maxrl(scores, ids, eps=eps, divide_by_group_size=by_size))
        _close(out, expected)
        assert np.all(np.isfinite(out)) and not out[:6].any() and out[-1] == 0.0


def test_docstring_example():
    scores = jnp.array([1, 0, 0, 0, 1, 1, 0.5, 0.5, 3])
    ids = jnp.array([0, 0, 0, 0, 1, 1, 2, 2, 3])
    _close(_maxrl(scores, ids), [3, -1, -1, -1, 0, 0, 0, 0, 0])
    _close(_maxrl(jnp.zeros(2), jnp.zeros(2, jnp.int32)), [0, 0])
    # the authors' code: eps 1e-6 and a division by the group size
    _close(_maxrl(scores[:4], ids[:4], eps=1e-6, divide_by_group_size=True),
           np.array([0.75, -0.25, -0.25, -0.25]) / (0.25 + 1e-6) * 0.25)


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), binary=st.booleans())
def test_maxrl_is_drgrpo_divided_by_the_group_mean(seed, binary):
    """MaxRL = Dr. GRPO / mean_g where the mean is positive, 0 elsewhere; zero-sum in groups."""
    scores, ids = _batch(seed, binary=binary)
    drgrpo = np.asarray(group.grpo(scores, ids, std="none"))
    means = np.array([scores[ids == g].mean() for g in ids], np.float64)
    expected = np.where(means > 0, drgrpo / np.where(means > 0, means, 1.0), 0.0)
    out = np.asarray(_maxrl(scores, ids))
    _close(out, expected, 1e-4)
    for g in np.unique(ids):
        assert abs(out[ids == g].sum()) < 1e-4


def test_binary_groups_give_success_and_failure_weights_and_grpo_signs():
    """Binary scores, success rate p: successes (1 - p) / p, failures -1; signs as GRPO's."""
    scores = jnp.array([1.0, 0, 0, 0, 0, 1.0, 1.0, 0])
    ids = jnp.array([0, 0, 0, 0, 1, 1, 1, 1])
    out = np.asarray(_maxrl(scores, ids))
    _close(out, [3, -1, -1, -1, -1, 1, 1, -1])
    np.testing.assert_array_equal(np.sign(out), np.sign(np.asarray(group.grpo(scores, ids))))
    # Scale invariant: scores times c give the same advantages.
    _close(_maxrl(scores * 7.0, ids), out)


def test_vmap_and_shard_map_equal_eager(mesh4):
    batches = [_batch(seed) for seed in range(3)]
    scores = np.stack([s for s, _ in batches])
    ids = np.stack([i for _, i in batches])
    out = jax.jit(jax.vmap(maxrl))(scores, ids)
    for k in range(3):
        _close(out[k], maxrl(scores[k], ids[k]))
    flat = scores[0]
    spread = np.arange(B, dtype=np.int32) % 5  # every group spans devices
    sharded = jax.jit(jax.shard_map(lambda s, g: maxrl(s, g, num_groups=5, axis_name="data"),
                                    mesh=mesh4, in_specs=P("data"), out_specs=P("data")))
    _close(sharded(flat, spread), ref.maxrl(flat, spread))


def test_bad_input_gives_clear_errors():
    scores = jnp.ones(4)
    with pytest.raises(ValueError, match=r"maxrl: group_ids has shape \(3,\); it must be \[B\]"):
        maxrl(scores, jnp.array([0, 1, 2]))
    with pytest.raises(ValueError, match=r"maxrl: scores is not finite at index \(2,\)"):
        maxrl(jnp.array([0.0, 1.0, jnp.nan, 2.0]), jnp.array([0, 0, 1, 1]))
    with pytest.raises(TypeError, match="maxrl: group_ids has dtype float32"):
        maxrl(scores, jnp.zeros(4))
    with pytest.raises(ValueError, match=r"maxrl: eps=-1.0"):
        maxrl(scores, jnp.zeros(4, jnp.int32), eps=-1.0)
    with pytest.raises(ValueError, match=r"maxrl: group_ids holds 9 but num_groups=3"):
        maxrl(scores, jnp.array([0, 1, 2, 9]), num_groups=3)
    with pytest.raises(ValueError, match=r"maxrl: scores has shape \(2, 2\) \(rank 2\)") as raised:
        maxrl(jnp.ones((2, 2)), jnp.zeros(2, jnp.int32))
    assert "\n" not in str(raised.value)


def test_registry_entry_and_export():
    entry = registry.get("maxrl")
    assert entry.output_level == "trajectory" and entry.whiten == "none"
    assert dict(entry.defaults) == {"eps": 0.0, "divide_by_group_size": False}
    assert "arXiv 2602.02710" in entry.paper
    scores, ids = _batch(9)
    inputs = registry.CreditInputs(scores=scores, group_ids=ids)
    _close(registry.apply("maxrl", inputs).advantages, ref.maxrl(scores, ids))
    assert stepcredit.advantages.maxrl is maxrl
