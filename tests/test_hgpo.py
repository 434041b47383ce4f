"""HGPO against its NumPy loop reference, the docstring example, and properties tying it to
GiGPO (max_depth 1, single-step rows, all weight on depth 1) and to GRPO (no repeated state)."""

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stepcredit import advantages as adv
from stepcredit.advantages import registry
from stepcredit.advantages.gigpo import gigpo
from stepcredit.advantages.group import grpo
from stepcredit.advantages.hgpo import history_keys, hgpo
from tests.reference import hgpo as ref
from tests.test_gigpo import _close

B, T = 8, 6

_STATIC = ("std", "singleton", "num_groups", "method", "max_depth", "min_depth")
_hgpo = jax.jit(hgpo, static_argnames=_STATIC)
_gigpo = jax.jit(gigpo, static_argnames=("std", "singleton"))
_grpo = jax.jit(grpo, static_argnames=("std",))


def _batch(seed, num_states=2, equal=False):
    """Few states (so states and histories repeat), prefix masks, one empty row, singletons."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, T + 1, size=B)
    lengths[3] = 0
    mask = np.arange(T)[None, :] < lengths[:, None]
    values = np.full((B, T), 0.5) if equal else rng.normal(size=(B, T))
    rewards = np.where(mask, values, np.nan).astype(np.float32)
    anchors = np.where(mask, rng.integers(0, num_states, size=(B, T)), -1).astype(np.int32)
    group_ids = np.array([7, 7, 7, 7, 1000, 1000, -3, 42], np.int32)
    return rewards, anchors, group_ids, mask


def test_docstring_example():
    rewards = np.array([[0.0, 1.0], [0.0, 0.0]], np.float32)
    groups, mask = np.array([0, 0], np.int32), np.ones((2, 2), bool)
    anchors = np.array([[0, 2], [1, 2]], np.int32)
    _close(hgpo(rewards, anchors, groups, mask, gamma=1.0, std="none", max_depth=2),
           [[0.5, 1.0], [-0.5, -1.0]])
    # Both rows start in state 0: every depth holds both steps, A^S = A_1 = A_2 = +-0.5.
    same = np.array([[0, 2], [0, 2]], np.int32)
    _close(hgpo(rewards, same, groups, mask, gamma=1.0, std="none", max_depth=2),
           [[1.0, 1.0], [-1.0, -1.0]])
    # min_depth 0 adds the group's four steps (returns 1, 1, 0, 0: A_0 = +-0.5) at weight 1,
    # depth 1 at weight 2 (first column: singletons) and depth 2 at weight 3 (singletons).
    _close(hgpo(rewards, anchors, groups, mask, gamma=1.0, std="none", max_depth=2, min_depth=0),
           [[1.0, 1.0], [-1.0, -1.0]])


def test_history_keys_are_nested_and_exact():
    _, anchors, group_ids, mask = _batch(1)
    dense = np.unique(group_ids, return_inverse=True)[1].astype(np.int32)
    previous = None
    for depth in range(4):
        keys = np.asarray(history_keys(dense, anchors, depth))
        for b1 in range(B):
            for t1 in range(T):
                for b2 in range(B):
                    for t2 in range(T):
                        same = dense[b1] == dense[b2] and all(
                            (anchors[b1, t1 - l] if t1 >= l else None)
                            == (anchors[b2, t2 - l] if t2 >= l else None) for l in range(depth))
                        assert (keys[b1, t1] == keys[b2, t2]) == same
        if previous is not None:  # nested: equal keys at depth d are equal at depth d - 1
            for key in np.unique(keys):
                assert len(np.unique(previous[keys == key])) == 1
        previous = keys


@pytest.mark.parametrize("std", ["unbiased", "biased", "none"])
@pytest.mark.parametrize("depths", [(1, 1), (1, 3), (0, 2)])
def test_matches_reference(std, depths):
    min_depth, max_depth = depths
    for seed in range(3):
        rewards, anchors, group_ids, mask = _batch(seed, equal=seed == 2)
        options = dict(gamma=0.9, omega=0.7, std=std, max_depth=max_depth, min_depth=min_depth,
                       alpha=1.5, singleton="raw" if seed == 1 else "zero")
        _close(_hgpo(rewards, anchors, group_ids, mask, **options),
               ref.hgpo(rewards, anchors, group_ids, mask, **options), 1e-4)


def test_episode_scores_and_associative_scan():
    rewards, anchors, group_ids, mask = _batch(11)
    scores = np.random.default_rng(11).integers(0, 2, size=B).astype(np.float32)
    expected = ref.hgpo(rewards, anchors, group_ids, mask, episode_scores=scores)
    _close(_hgpo(rewards, anchors, group_ids, mask, episode_scores=scores), expected, 1e-4)
    _close(_hgpo(rewards, anchors, group_ids, mask, episode_scores=scores, method="associative"),
           expected, 1e-4)


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**31 - 1))
def test_reduces_to_gigpo(seed):
    rewards, anchors, group_ids, mask = _batch(seed)
    expected = np.asarray(_gigpo(rewards, anchors, group_ids, mask))
    _close(_hgpo(rewards, anchors, group_ids, mask, max_depth=1), expected, 1e-5)
    # All the weight on depth 1: depth 2 and 3 weigh 2^-60 and 3^-60 of it.
    _close(_hgpo(rewards, anchors, group_ids, mask, alpha=-60.0), expected, 1e-5)
    # Single-step rows: no history beyond the state, every depth is depth 1.
    first = mask & (np.arange(T)[None, :] == 0)
    _close(_hgpo(rewards, anchors, group_ids, first),
           np.asarray(_gigpo(rewards, anchors, group_ids, first)), 1e-5)


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**31 - 1))
def test_no_repeated_state_is_grpo(seed):
    rewards, _, group_ids, mask = _batch(seed)
    mask[3, 0] = True
    rewards[3, 0] = 0.5
    distinct = np.arange(B * T, dtype=np.int32).reshape(B, T)
    scores = np.where(mask, rewards, 0.0).sum(axis=1)
    for std in ("unbiased", "none"):
        expected = np.where(mask, np.asarray(_grpo(scores, group_ids, std=std))[:, None], 0.0)
        _close(_hgpo(rewards, distinct, group_ids, mask, std=std), expected, 1e-4)


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**31 - 1))
def test_permuting_trajectories_permutes_outputs(seed):
    rewards, anchors, group_ids, mask = _batch(seed)
    perm = np.random.default_rng(seed).permutation(B)
    out = np.asarray(_hgpo(rewards, anchors, group_ids, mask))
    _close(_hgpo(rewards[perm], anchors[perm], group_ids[perm], mask[perm]), out[perm])


def test_jit_equals_eager_vmap_and_padding():
    parts = [_batch(seed) for seed in range(3)]
    for p in parts:
        _close(_hgpo(*p), hgpo(*p), 1e-5)
    out = jax.jit(jax.vmap(hgpo))(*[np.stack(x) for x in zip(*parts)])
    for k, p in enumerate(parts):
        _close(out[k], _hgpo(*p), 1e-4)
    empty = np.asarray(_hgpo(np.full((B, T), np.nan, np.float32), np.zeros((B, T), np.int32),
                             np.zeros(B, np.int32), np.zeros((B, T), bool)))
    assert not empty.any()


def test_bad_input_raises_one_clear_line():
    rewards, anchors, group_ids, mask = _batch(0)
    cases = [
        (dict(anchors=anchors[:, :2]), ValueError,
         r"hgpo: step_rewards has shape \(8, 6\) but anchors has shape \(8, 2\)"),
        (dict(group_ids=group_ids[:2]), ValueError, r"hgpo: group_ids has shape \(2,\)"),
        (dict(anchors=anchors.astype(np.float32)), TypeError, "hgpo: anchors has dtype float32"),
        (dict(max_depth=0), ValueError, "hgpo: max_depth=0"),
        (dict(max_depth=2.0), ValueError, "hgpo: max_depth=2.0"),
        (dict(min_depth=2), ValueError, "hgpo: min_depth=2"),
        (dict(alpha=float("inf")), ValueError, "hgpo: alpha=inf"),
        (dict(std="max"), ValueError, "hgpo: std='max'"),
        (dict(gamma=1.5), ValueError, "hgpo: gamma=1.5"),
        (dict(step_rewards=np.where(np.arange(T) == 0, np.inf, rewards).astype(np.float32)),
         ValueError, r"hgpo: step_rewards is not finite at index \(0, 0\)"),
    ]
    base = dict(step_rewards=rewards, anchors=anchors, group_ids=group_ids, mask=mask)
    for change, error, message in cases:
        arrays = {**base, **{k: v for k, v in change.items() if k in base}}
        options = {k: v for k, v in change.items() if k not in base}
        with pytest.raises(error, match=message) as raised:
            hgpo(arrays.pop("step_rewards"), arrays.pop("anchors"), arrays.pop("group_ids"),
                 arrays.pop("mask"), **options)
        assert "\n" not in str(raised.value)


def test_registry_entry():
    entry = registry.get("hgpo")
    assert entry.fn is hgpo and adv.hgpo is hgpo
    assert dict(entry.defaults) == {"gamma": 0.95, "omega": 1.0, "max_depth": 3, "min_depth": 1,
                                    "alpha": 1.0, "std": "unbiased", "eps": 1e-6,
                                    "singleton": "zero"}
    assert entry.input_level == entry.output_level == "step" and entry.needs_groups
    assert entry.whiten == "none" and "2602.22817" in entry.paper
    rewards, anchors, group_ids, mask = _batch(9)
    _close(entry.fn(rewards, anchors, group_ids, mask, **entry.defaults),
           ref.hgpo(rewards, anchors, group_ids, mask), 1e-4)
