"""GRPO, Dr. GRPO, RLOO, REINFORCE++ and the group statistics, against NumPy loop references."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

import stepcredit
from stepcredit.advantages import group, registry
from tests.reference import group as ref

B = 16  # one batch size for the whole module: every new shape recompiles

_grpo = jax.jit(group.grpo, static_argnames=("num_groups", "std", "singleton", "axis_name"))
_rloo = jax.jit(group.rloo, static_argnames=("num_groups", "singleton", "axis_name"))
_rpp_baseline = jax.jit(group.reinforce_pp_baseline,
                        static_argnames=("num_groups", "singleton", "axis_name"))
_rpp = jax.jit(group.reinforce_pp, static_argnames=("masked", "method"))


def _close(actual, expected, tol=1e-5):
    expected = np.asarray(expected, np.float64)
    scale = max(1.0, float(np.abs(expected).max(initial=0.0)))
    np.testing.assert_allclose(np.asarray(actual, np.float64), expected, rtol=tol, atol=tol * scale)


def _batch(seed):
    """Scores and non-contiguous ids with a singleton group and an all-equal group."""
    rng = np.random.default_rng(seed)
    ids = rng.choice(np.array([7, 1000, -3, 42, 5], np.int32), size=B)
    ids[-1] = 123456                       # singleton
    ids[:3] = -77                          # all-equal group
    scores = rng.normal(size=B).astype(np.float32) * 3.0
    scores[:3] = 0.5
    return scores, ids


# --- group statistics -------------------------------------------------------------------------

def test_group_stats_docstring_example():
    stats = group.group_stats(jnp.array([1.0, 2.0, 3.0, 5.0]), jnp.array([0, 0, 0, 1]), num_groups=2)
    _close(stats.mean, [2, 2, 2, 5])
    _close(stats.std_unbiased, [1, 1, 1, 0])
    _close(stats.std_biased, [np.sqrt(2 / 3)] * 3 + [0])
    _close(stats.count, [3, 3, 3, 1])


def test_group_stats_matches_numpy_over_steps_with_mask():
    rng = np.random.default_rng(0)
    values = rng.normal(size=(B, 5)).astype(np.float32) + 100.0
    valid = rng.random((B, 5)) < 0.6
    values[~valid] = np.nan
    ids = rng.integers(0, 4, size=B)
    stats = jax.jit(group.group_stats, static_argnames="num_groups")(values, ids, valid, num_groups=4)
    for name in ("mean", "std_unbiased", "std_biased", "count"):
        assert np.isfinite(np.asarray(getattr(stats, name))).all()
    for g in range(4):
        members = values[ids == g][valid[ids == g]].astype(np.float64)
        where = np.broadcast_to((ids == g)[:, None], values.shape)
        count = len(members)
        _close(np.asarray(stats.count)[where], count)
        _close(np.asarray(stats.mean)[where], members.mean() if count else 0.0)
        _close(np.asarray(stats.std_biased)[where], members.std() if count else 0.0, 1e-4)
        _close(np.asarray(stats.std_unbiased)[where], members.std(ddof=1) if count > 1 else 0.0,
               1e-4)


def test_group_stats_rejects_bad_ids_and_num_groups():
    with pytest.raises(ValueError, match=r"group_stats: group_ids holds 2 but num_groups=2"):
        group.group_stats(jnp.ones(3), jnp.array([0, 1, 2]), num_groups=2)
    with pytest.raises(ValueError, match="num_groups=0"):
        group.group_stats(jnp.ones(3), jnp.array([0, 0, 0]), num_groups=0)
    with pytest.raises(ValueError, match=r"group_ids has shape \(2,\) but values has shape \(3,\)"):
        group.group_stats(jnp.ones(3), jnp.array([0, 0]), num_groups=1)


def test_dense_group_ids_example_and_order_independence():
    dense = group.dense_group_ids(jnp.array([7, 1000, -3, 7]))
    np.testing.assert_array_equal(dense.ids, [1, 2, 0, 1])
    assert dense.num_groups == 4
    permuted = group.dense_group_ids(jnp.array([-3, 7, 7, 1000]))
    np.testing.assert_array_equal(permuted.ids, [0, 1, 1, 2])
    kept = group.dense_group_ids(jnp.array([2, 0, 1]), num_groups=3)
    np.testing.assert_array_equal(kept.ids, [2, 0, 1])
    assert kept.num_groups == 3


# --- estimators against their references --------------------------------------------------------

@pytest.mark.parametrize("std", ["unbiased", "biased", "none"])
@pytest.mark.parametrize("singleton", ["zero", "raw"])
def test_grpo_matches_reference(std, singleton):
    for seed in range(3):
        scores, ids = _batch(seed)
        expected = ref.grpo(scores, ids, std=std, singleton=singleton)
        if seed == 0:  # the eager path once; its value checks run only there
            _close(group.grpo(scores, ids, std=std, singleton=singleton), expected)
        _close(_grpo(scores, ids, std=std, singleton=singleton), expected)


@pytest.mark.parametrize("singleton", ["zero", "raw"])
def test_rloo_and_reinforce_pp_baseline_match_references(singleton):
    for seed in range(3):
        scores, ids = _batch(seed)
        _close(_rloo(scores, ids, singleton=singleton), ref.rloo(scores, ids, singleton))
        _close(_rpp_baseline(scores, ids, singleton=singleton),
               ref.reinforce_pp_baseline(scores, ids, singleton))


@pytest.mark.parametrize("method", ["sequential", "associative"])
def test_reinforce_pp_matches_reference(method):
    rng = np.random.default_rng(1)
    rewards = rng.normal(size=(B, 12)).astype(np.float32)
    mask = rng.random((B, 12)) < 0.7
    mask[0] = False                        # an empty row
    rewards[~mask] = np.nan
    for masked in ("carry", "reset"):
        expected = ref.reinforce_pp(rewards, mask, 0.97, masked)
        _close(_rpp(rewards, mask, gamma=0.97, masked=masked, method=method), expected)
    assert not np.asarray(_rpp(rewards, mask, gamma=0.97, method=method))[0].any()


def test_docstring_examples():
    scores, ids = jnp.array([1.0, 0.0, 1.0, 0.0, 3.0]), jnp.array([7, 7, 1000, 1000, -3])
    _close(_grpo(scores, ids), [0.7071, -0.7071, 0.7071, -0.7071, 0.0], 1e-4)
    _close(_grpo(scores, ids, singleton="raw")[-1], 3.0 / (1.0 + 1e-6))
    _close(_grpo(scores, ids, std="none"), [0.5, -0.5, 0.5, -0.5, 0.0])
    scores, ids = jnp.array([1.0, 0.0, 0.0, 3.0]), jnp.array([7, 7, 7, -3])
    _close(_rloo(scores, ids), [1.0, -0.5, -0.5, 0.0])
    _close(_rpp_baseline(scores, ids), [2 / 3, -1 / 3, -1 / 3, 0.0])
    _close(_rpp(jnp.array([[0.0, 0.0, 1.0, jnp.nan, 0.0, 2.0]]),
                              jnp.array([[1, 1, 1, 0, 1, 1]], bool), gamma=0.5),
           [[0.375, 0.75, 1.5, 0.0, 1.0, 2.0]])


def _verl_grpo(scores, index, epsilon=1e-6):
    """A line-by-line port of verl's `compute_grpo_outcome_advantage` (norm_adv_by_std_in_grpo)."""
    scores = np.asarray(scores, np.float64).copy()
    id2score, id2mean, id2std = {}, {}, {}
    for i in range(len(scores)):
        id2score.setdefault(index[i], []).append(scores[i])
    for idx, values in id2score.items():
        if len(values) == 1:
            id2mean[idx], id2std[idx] = 0.0, 1.0
        else:
            id2mean[idx], id2std[idx] = np.mean(values), np.std(values, ddof=1)
    for i in range(len(scores)):
        scores[i] = (scores[i] - id2mean[index[i]]) / (id2std[index[i]] + epsilon)
    return scores


def test_verl_conventions_under_their_options():
    scores, ids = _batch(3)
    _close(_grpo(scores, ids, std="unbiased", singleton="raw", eps=1e-6), _verl_grpo(scores, ids))
    # eps is added to the std, not to the variance: a two-member group {0, 2e-6} has std
    # 1.414e-6, so the advantage is 1e-6 / (1.414e-6 + 1e-6) = 0.4142, not 0.7071.
    _close(_grpo(jnp.array([0.0, 2e-6]), jnp.array([0, 0])), [-0.41421, 0.41421], 1e-4)


# --- properties ------------------------------------------------------------------------------

@settings(max_examples=10)
@given(seed=st.integers(0, 2**31 - 1), shift=st.floats(-50, 50), scale=st.floats(0.1, 10.0))
def test_properties_permutation_shift_and_zero_sum(seed, shift, scale):
    scores, ids = _batch(seed)
    perm = np.random.default_rng(seed).permutation(B)
    for fn in (_grpo, _rloo, _rpp_baseline):
        out = np.asarray(fn(scores, ids))
        _close(np.asarray(fn(scores[perm], ids[perm])), out[perm])
        _close(np.asarray(fn(scores + np.float32(shift), ids)), out, 1e-4)
        for g in np.unique(ids):
            assert abs(out[ids == g].sum()) < 1e-4
    # GRPO is scale invariant (up to eps); Dr. GRPO and RLOO scale with the scores.
    _close(_grpo(scores * np.float32(scale), ids), _grpo(scores, ids), 1e-4)
    _close(_grpo(scores * np.float32(scale), ids, std="none"),
           np.asarray(_grpo(scores, ids, std="none")) * scale, 1e-4)


def test_singleton_and_all_equal_groups_give_zero_and_never_nan():
    scores, ids = _batch(4)
    for fn in (_grpo, _rloo, _rpp_baseline):
        out = np.asarray(fn(scores, ids))
        assert np.isfinite(out).all()
        assert out[-1] == 0.0 and not out[:3].any()
    assert not np.asarray(_grpo(jnp.full(4, 0.1), jnp.zeros(4, jnp.int32), eps=0.0)).any()


def test_non_contiguous_ids_equal_dense_ids():
    scores, ids = _batch(5)
    _, dense = np.unique(ids, return_inverse=True)
    num = int(dense.max()) + 1
    for fn in (_grpo, _rloo, _rpp_baseline):
        _close(fn(scores, ids), fn(scores, dense.astype(np.int32), num_groups=num))


# --- jit, vmap, shard_map --------------------------------------------------------------------

def test_vmap_over_batches_equals_loop():
    batches = [_batch(seed) for seed in range(3)]
    scores = np.stack([s for s, _ in batches])
    ids = np.stack([i for _, i in batches])
    for fn in (group.grpo, group.rloo, group.reinforce_pp_baseline):
        out = jax.jit(jax.vmap(fn))(scores, ids)
        for k in range(3):
            _close(out[k], fn(scores[k], ids[k]))


@pytest.mark.parametrize("num_groups", [None, 8])
def test_shard_map_with_groups_spanning_devices(mesh4, num_groups):
    scores, _ = _batch(6)
    ids = np.arange(B, dtype=np.int32) % 5  # every group spans devices
    if num_groups is None:
        ids = ids * 1000 - 3
    for fn in (group.grpo, group.rloo, group.reinforce_pp_baseline):
        sharded = jax.jit(jax.shard_map(
            lambda s, g, fn=fn: fn(s, g, num_groups=num_groups, axis_name="data"),
            mesh=mesh4, in_specs=P("data"), out_specs=P("data")))
        _close(sharded(scores, ids), fn(scores, ids, num_groups=num_groups))


# --- bad input -------------------------------------------------------------------------------

def test_bad_input_gives_clear_errors():
    scores = jnp.ones(4)
    with pytest.raises(ValueError, match=r"grpo: group_ids holds 9 but num_groups=3"):
        group.grpo(scores, jnp.array([0, 1, 2, 9]), num_groups=3)
    with pytest.raises(ValueError, match=r"rloo: group_ids holds -1 but num_groups=3"):
        group.rloo(scores, jnp.array([0, 1, 2, -1]), num_groups=3)
    with pytest.raises(ValueError, match=r"grpo: group_ids has shape \(3,\); it must be \[B\] = \(4,\)"):
        group.grpo(scores, jnp.array([0, 1, 2]))
    with pytest.raises(ValueError, match=r"grpo: scores is not finite at index \(2,\)"):
        group.grpo(jnp.array([0.0, 1.0, jnp.nan, 2.0]), jnp.array([0, 0, 1, 1]))
    with pytest.raises(ValueError, match="grpo: std='mad'"):
        group.grpo(scores, jnp.zeros(4, jnp.int32), std="mad")
    with pytest.raises(ValueError, match="reinforce_pp_baseline: singleton='keep'"):
        group.reinforce_pp_baseline(scores, jnp.zeros(4, jnp.int32), singleton="keep")
    with pytest.raises(TypeError, match="grpo: group_ids has dtype float32"):
        group.grpo(scores, jnp.zeros(4))
    with pytest.raises(ValueError, match=r"grpo: eps=-1.0"):
        group.grpo(scores, jnp.zeros(4, jnp.int32), eps=-1.0)
    with pytest.raises(ValueError, match=r"reinforce_pp: token_rewards has shape \(2, 3\) but mask"):
        group.reinforce_pp(jnp.ones((2, 3)), jnp.ones((2, 4), bool))
    with pytest.raises(ValueError, match="reinforce_pp: gamma=1.5"):
        group.reinforce_pp(jnp.ones((2, 3)), jnp.ones((2, 3), bool), gamma=1.5)


def test_nan_under_jit_stays_in_its_group_and_empty_mask_gives_zeros():
    scores = jnp.array([0.0, 1.0, jnp.nan, 2.0])
    out = np.asarray(jax.jit(group.grpo)(scores, jnp.array([0, 0, 1, 1])))
    _close(out[:2], [-0.7071, 0.7071], 1e-4)
    assert np.isnan(out[2:]).all()
    assert not np.asarray(group.reinforce_pp(jnp.full((2, 3), jnp.nan),
                                             jnp.zeros((2, 3), bool))).any()


# --- registry and exports --------------------------------------------------------------------

def test_registry_entries_and_exports():
    expected = {
        "grpo": ({"std": "unbiased", "eps": 1e-6, "singleton": "zero"}, "none"),
        "drgrpo": ({"std": "none", "singleton": "zero"}, "none"),
        "rloo": ({"singleton": "zero"}, "none"),
        "reinforce_pp": ({"gamma": 1.0, "masked": "carry"}, "tokens"),
        "reinforce_pp_baseline": ({"singleton": "zero"}, "tokens"),
    }
    for name, (defaults, whiten) in expected.items():
        entry = registry.get(name)
        assert dict(entry.defaults) == defaults and entry.whiten == whiten
        assert "arXiv" in entry.paper
    scores, ids = _batch(7)
    _close(registry.get("drgrpo").fn(scores, ids, **registry.get("drgrpo").defaults),
           ref.grpo(scores, ids, std="none"))
    for name in ("grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "group_stats",
                 "dense_group_ids", "GroupStats"):
        assert getattr(stepcredit, name) is getattr(stepcredit.advantages, name)


def test_reinforce_pp_sharded_and_vmapped_equal_eager(mesh4):
    rng = np.random.default_rng(8)
    rewards = rng.normal(size=(B, 12)).astype(np.float32)
    mask = rng.random((B, 12)) < 0.7
    eager = group.reinforce_pp(rewards, mask, gamma=0.9)
    sharded = jax.jit(jax.shard_map(lambda r, m: group.reinforce_pp(r, m, gamma=0.9), mesh=mesh4,
                                    in_specs=P("data"), out_specs=P("data")))
    _close(sharded(rewards, mask), eager)
    vmapped = jax.jit(jax.vmap(lambda r, m: group.reinforce_pp(r[None], m[None], gamma=0.9)[0]))
    _close(vmapped(rewards, mask), eager)


def test_huge_but_finite_scores_normalise_like_rescaled_ones():
    # float32 squares of 1e20 overflow; group statistics scale each group by a power of two.
    scores = np.array([1e20, 2e20, 0.0, 3e20, 1e38, -1e38], np.float32)
    ids = np.array([0, 0, 0, 1, 2, 2])
    huge = np.asarray(group.grpo(scores, ids))
    _close(huge[:4], group.grpo(scores[:4] / 1e20, ids[:4]))
    np.testing.assert_allclose(huge[4:], [0.70710677, -0.70710677], rtol=1e-6)
    stats = group.group_stats(scores, ids, num_groups=3)
    assert np.all(np.isfinite(stats.std_unbiased)) and np.isclose(stats.std_unbiased[4], 1.41421e38,
                                                                  rtol=1e-4)
    # Power-of-two scaling is exact: ordinary magnitudes give the unscaled result bit for bit.
    values = np.array([0.1, 0.7, 1.9, 5.0], np.float32)
    plain = np.sqrt(np.sum((values[:3] - values[:3].mean(dtype=np.float32)) ** 2) / 2)
    assert float(group.group_stats(values, np.array([0, 0, 0, 1]), num_groups=2).std_unbiased[0]) \
        == pytest.approx(float(plain), rel=1e-6)


def test_reinforce_pp_carries_its_return_across_masked_spans_or_resets_there():
    rewards = np.array([[0, 0, 1, np.nan, 0, 2]], np.float32)
    mask = np.array([[True, True, True, False, True, True]])
    _close(group.reinforce_pp(rewards, mask, gamma=0.5), [[0.375, 0.75, 1.5, 0, 1, 2]])
    _close(group.reinforce_pp(rewards, mask, gamma=0.5, masked="reset"), [[0.25, 0.5, 1, 0, 1, 2]])
    with pytest.raises(ValueError, match="reinforce_pp: masked='skip'"):
        group.reinforce_pp(rewards, mask, masked="skip")


def test_host_ids_beyond_int32_are_named_not_wrapped():
    """JAX converts int64 to int32 by dropping the high bits: 7 and 7 + 2^32 would be one
    group. Ids of 64 bits that fit are taken as they are."""
    scores = np.array([1.0, 0.0, 1.0, 0.0], np.float32)
    with pytest.raises(ValueError, match=re.escape("grpo: group_ids holds 4294967303 at index "
                                                   "(1,), outside int32")):
        group.grpo(scores, np.array([7, 7 + 2**32, 7, 7 + 2**32]))
    np.testing.assert_array_equal(group.grpo(scores, np.array([7, 8, 7, 8], np.int64)), 0.0)
