"""EMPG: against the NumPy reference, the docstring example, properties, jit/vmap/shard_map."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

from stepcredit.advantages import group, registry
from stepcredit.advantages.empg import empg, grpo_empg
from tests.reference import empg as ref

B, T = 8, 6
_empg = jax.jit(empg, static_argnames=("center", "axis_name"))


def _batch(seed, per_step=False):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, T + 1, size=B)
    mask = np.arange(T)[None, :] < lengths[:, None]
    mask[0] = [True, False, True, True, False, True]  # a hole inside a trajectory
    mask[1] = False  # an empty (padding) row
    entropy = np.where(mask, rng.uniform(0.0, 3.0, (B, T)), np.nan).astype(np.float32)
    shape = (B, T) if per_step else (B,)
    advantages = rng.normal(size=shape).astype(np.float32)
    if per_step:
        advantages = np.where(mask, advantages, np.nan).astype(np.float32)
    return advantages, entropy, mask


def _close(actual, expected, rtol=1e-5):
    scale = max(1.0, float(np.max(np.abs(expected))))
    np.testing.assert_allclose(np.asarray(actual), expected, atol=rtol * scale, rtol=0)


@pytest.mark.parametrize("per_step", [False, True])
@pytest.mark.parametrize("center", [True, False])
def test_matches_reference(per_step, center):
    for seed in range(3):
        advantages, entropy, mask = _batch(seed, per_step)
        hyper = dict(k=0.7 + seed, k_future=1.3, zeta=0.05 * (seed + 1))
        out = _empg(advantages, entropy, mask, center=center, **hyper)
        _close(out, ref.empg(advantages, entropy, mask, center=center, **hyper))
        assert np.all(np.asarray(out)[~mask] == 0.0)


def test_docstring_example():
    nan = float("nan")
    out = empg(jnp.array([1.0, -1.0]), jnp.array([[0.0, 1.0], [1.0, nan]]),
                        jnp.array([[True, True], [True, False]]))
    np.testing.assert_allclose(out, [[1.16450, 0.05358], [-1.21807, 0.0]], atol=1e-5)


def test_scale_has_unit_mean_and_favours_confident_steps():
    # With zeta = 0, no centring and A = 1, the output is g itself.
    _, entropy, mask = _batch(4)
    g = np.asarray(_empg(np.ones(B, np.float32), entropy, mask, zeta=0.0, center=False))
    np.testing.assert_allclose(g[mask].mean(), 1.0, rtol=1e-6)
    order = np.argsort(entropy[mask])
    assert np.all(np.diff(g[mask][order]) <= 1e-6)  # higher entropy, smaller scale


@settings(max_examples=10)
@given(seed=st.integers(0, 2**16), per_step=st.booleans())
def test_zero_temperatures_return_centred_input(seed, per_step):
    advantages, entropy, mask = _batch(seed, per_step)
    out = _empg(advantages, entropy, mask, k=0.0, k_future=0.0, zeta=0.0)
    full = np.broadcast_to(advantages[:, None], (B, T)) if not per_step else advantages
    expected = np.where(mask, full - full[mask].mean(), 0.0)
    _close(out, expected)


@settings(max_examples=10)
@given(seed=st.integers(0, 2**16))
def test_permuting_trajectories_permutes_outputs(seed):
    advantages, entropy, mask = _batch(seed, per_step=True)
    perm = np.random.default_rng(seed).permutation(B)
    out = np.asarray(_empg(advantages, entropy, mask))
    permuted = np.asarray(_empg(advantages[perm], entropy[perm], mask[perm]))
    np.testing.assert_allclose(permuted, out[perm], atol=1e-6)


def test_jit_matches_eager_and_vmap_runs_independent_batches():
    batches = [_batch(seed, per_step=True) for seed in range(3)]
    eager = [np.asarray(empg(*b)) for b in batches]
    np.testing.assert_allclose(_empg(*batches[0]), eager[0], atol=1e-6)
    stacked = [np.stack(parts) for parts in zip(*batches)]
    vmapped = jax.vmap(empg)(*stacked)
    np.testing.assert_allclose(vmapped, np.stack(eager), atol=1e-6)


@pytest.mark.parametrize("center", [True, False])
def test_shard_map_matches_single_device(mesh4, center):
    advantages, entropy, mask = _batch(7)
    sharded = jax.jit(jax.shard_map(
        functools.partial(empg, center=center, axis_name="data"),
        mesh=mesh4, in_specs=P("data"), out_specs=P("data")))
    np.testing.assert_allclose(sharded(advantages, entropy, mask),
                               _empg(advantages, entropy, mask, center=center), atol=1e-6)


def test_all_false_mask_gives_zeros():
    out = empg(np.ones(B, np.float32), np.full((B, T), np.nan, np.float32),
                        np.zeros((B, T), bool))
    np.testing.assert_array_equal(out, np.zeros((B, T)))


def test_equal_entropies_give_unit_scale():
    mask = np.ones((2, 3), bool)
    out = empg(np.array([1.0, -1.0], np.float32), np.full((2, 3), 0.5, np.float32), mask,
                        zeta=0.0)
    np.testing.assert_allclose(out, [[1.0] * 3, [-1.0] * 3], atol=1e-6)


def test_bad_inputs_raise_naming_the_argument():
    advantages, entropy, mask = _batch(0)
    with pytest.raises(ValueError, match=r"empg: advantages has shape \(7,\)"):
        empg(advantages[:7], entropy, mask)
    with pytest.raises(ValueError, match=r"empg: entropy has shape \(8, 6\) but mask"):
        empg(advantages, entropy, mask[:, :5])
    with pytest.raises(ValueError, match="advantages has shape"):
        empg(advantages[:, None, None], entropy, mask)
    bad = entropy.copy()
    bad[0, 0] = np.nan
    with pytest.raises(ValueError, match=r"empg: entropy is not finite at index \(0, 0\)"):
        empg(advantages, bad, mask)
    bad = advantages.copy()
    bad[2] = np.inf
    with pytest.raises(ValueError, match=r"empg: advantages is not finite at index \(2,\)"):
        empg(bad, entropy, mask)
    with pytest.raises(ValueError, match="center"):
        empg(advantages, entropy, mask, center="first_step")
    with pytest.raises(TypeError, match="empg: entropy has dtype int32"):
        empg(advantages, np.zeros((B, T), np.int32), mask)


def test_nan_on_an_empty_row_is_ignored():
    advantages, entropy, mask = _batch(0)
    advantages[1] = np.nan  # row 1 has no valid step
    assert np.all(np.isfinite(empg(advantages, entropy, mask)))


IDS = np.array([4, 4, 4, 9, 9, 9, 9, 2])  # 2 is a singleton


def test_grpo_empg_composes_grpo_and_empg():
    _, entropy, mask = _batch(8)
    scores = np.random.default_rng(8).integers(0, 2, B).astype(np.float32)
    out = jax.jit(grpo_empg)(scores, IDS, entropy, mask)
    _close(out, ref.empg(np.asarray(group.grpo(scores, IDS)), entropy, mask))


def test_grpo_empg_docstring_example():
    mask = np.ones((2, 3), bool)
    out = grpo_empg(np.array([1.0, 0.0], np.float32), np.array([0, 0]),
                    np.random.default_rng(0).random((2, 3)).astype(np.float32), mask,
                    k=0.0, k_future=0.0, zeta=0.0)
    np.testing.assert_allclose(out, [[0.7071] * 3, [-0.7071] * 3], atol=1e-4)


def test_grpo_empg_sharded(mesh4):
    _, entropy, mask = _batch(9)
    scores = np.arange(B, dtype=np.float32) % 3
    sharded = jax.jit(jax.shard_map(functools.partial(grpo_empg, axis_name="data"), mesh=mesh4,
                                    in_specs=P("data"), out_specs=P("data")))
    np.testing.assert_allclose(sharded(scores, IDS, entropy, mask),
                               grpo_empg(scores, IDS, entropy, mask), atol=1e-6)


def test_grpo_empg_mismatched_batch():
    _, entropy, mask = _batch(0)
    with pytest.raises(ValueError, match=r"grpo_empg: scores has shape \(7,\)"):
        grpo_empg(np.zeros(7, np.float32), IDS[:7], entropy, mask)


def test_registry_entries():
    entry = registry.get("empg")
    # Its base advantages, when the caller gives none, are GRPO's, which need groups.
    assert entry.fn is empg and entry.needs_entropy and entry.base == "grpo"
    assert entry.needs_groups and "base_advantages" not in entry.fields
    assert dict(entry.defaults) == {"k": 1.0, "k_future": 1.0, "zeta": 0.05, "eps": 1e-8,
                                    "center": True}
    assert entry.input_level == "step" and entry.output_level == "step" and entry.whiten == "none"
    for name in ("grpo+empg", "dapo+empg"):
        entry = registry.get(name)
        assert entry.fn is grpo_empg and entry.needs_entropy and entry.needs_groups
        assert entry.input_level == "trajectory" and entry.output_level == "step"
    assert registry.get("dapo+empg").recipe == registry.Recipe(clip_high=0.28,
                                                              dynamic_sampling=True)
    dapo = registry.get("dapo+empg").paper
    assert "0.28" in dapo and "token-mean" in dapo
