"""ECPO against its NumPy loop reference, the docstring example, and properties tying it to GiGPO
(kappa = 0, or large anchor groups) and GRPO (no repeated state, or kappa -> inf)."""

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stepcredit.advantages import registry
from stepcredit.advantages.ecpo import ecpo
from tests.reference import ecpo as ref
# GiGPO's shape, docstring fixture and random batches serve ECPO's tests unchanged.
from tests.test_gigpo import FIXTURE, B, T, _batch, _close, _gigpo, _grpo

_ecpo = jax.jit(ecpo, static_argnames=("std", "singleton", "num_groups", "axis_name", "method"))


def test_hand_computed_example():
    expected = [[0.5 + 0.125 * 2 / 3, 0.5, 0.5], [-0.5 - 0.125 * 2 / 3, -0.5, 0.0],
                [0.25 * 2 / 3, -0.25 * 2 / 3, 0.0]]
    _close(ecpo(*FIXTURE, gamma=0.5, std="none"), expected)
    _close(ecpo(*FIXTURE, gamma=0.5, std="none"),
           [[0.58333, 0.5, 0.5], [-0.58333, -0.5, 0.0], [0.16667, -0.16667, 0.0]], 1e-4)
    # kappa = 2: a pair keeps half of its step credit.
    _close(ecpo(*FIXTURE, gamma=0.5, std="none", kappa=2.0),
           [[0.5625, 0.5, 0.5], [-0.5625, -0.5, 0.0], [0.125, -0.125, 0.0]])


@pytest.mark.parametrize("std", ["unbiased", "biased", "none"])
@pytest.mark.parametrize("singleton", ["zero", "raw"])
def test_matches_reference(std, singleton):
    for seed in range(3):
        for kappa in (0.5, 3.0):
            rewards, anchors, group_ids, mask = _batch(seed)
            expected = ref.ecpo(rewards, anchors, group_ids, mask, gamma=0.9, omega=0.7,
                                kappa=kappa, std=std, singleton=singleton)
            _close(_ecpo(rewards, anchors, group_ids, mask, gamma=0.9, omega=0.7, kappa=kappa,
                         std=std, singleton=singleton), expected, 1e-4)


def test_matches_reference_with_episode_scores_all_equal_groups_and_associative_scan():
    rewards, anchors, group_ids, mask = _batch(11)
    scores = np.random.default_rng(11).integers(0, 2, size=B).astype(np.float32)
    scores[3] = np.nan                      # the empty row's score is never read
    rewards[4:6] = np.where(mask[4:6], 1.0, np.nan)   # group 1000: all-equal rewards
    expected = ref.ecpo(rewards, anchors, group_ids, mask, episode_scores=scores)
    _close(_ecpo(rewards, anchors, group_ids, mask, episode_scores=scores), expected, 1e-4)
    _close(_ecpo(rewards, anchors, group_ids, mask, episode_scores=scores, method="associative"),
           expected, 1e-4)


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**31 - 1))
def test_kappa_zero_is_gigpo(seed):
    rewards, anchors, group_ids, mask = _batch(seed)
    for std in ("unbiased", "none"):
        _close(_ecpo(rewards, anchors, group_ids, mask, kappa=0.0, std=std),
               _gigpo(rewards, anchors, group_ids, mask, std=std), 1e-5)


def test_large_anchor_groups_approach_gigpo():
    """One state repeated over the whole group: n = 4 * 6 = 24 at most, w >= 24/25 for kappa 1."""
    rewards, _, group_ids, mask = _batch(5)
    mask[:] = True
    rewards = np.random.default_rng(5).normal(size=(B, T)).astype(np.float32)
    same = np.zeros((B, T), np.int32)
    out = np.asarray(_ecpo(rewards, same, group_ids, mask, kappa=1.0, std="none"))
    gig = np.asarray(_gigpo(rewards, same, group_ids, mask, std="none"))
    episode = np.asarray(_gigpo(rewards, same, group_ids, mask, std="none", omega=0.0))
    # Group 7 (rows 0-3, 24 steps) keeps 24/25 of its step term; group 1000 keeps 12/13.
    _close(out[:4] - episode[:4], (gig[:4] - episode[:4]) * 24 / 25)
    _close(out[4:6] - episode[4:6], (gig[4:6] - episode[4:6]) * 12 / 13)


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), kappa=st.floats(0.0, 50.0))
def test_all_distinct_anchors_equal_grpo_broadcast(seed, kappa):
    rewards, _, group_ids, mask = _batch(seed)
    mask[3, 0] = True                       # no empty row here: GRPO counts every trajectory
    rewards[3, 0] = 0.5
    distinct = np.arange(B * T, dtype=np.int32).reshape(B, T)
    scores = np.where(mask, rewards, 0.0).sum(axis=1)
    expected = np.where(mask, np.asarray(_grpo(scores, group_ids))[:, None], 0.0)
    _close(_ecpo(rewards, distinct, group_ids, mask, kappa=kappa), expected, 1e-4)


def test_huge_kappa_drops_the_step_term():
    rewards, anchors, group_ids, mask = _batch(8)
    _close(_ecpo(rewards, anchors, group_ids, mask, kappa=1e9),
           _gigpo(rewards, anchors, group_ids, mask, omega=0.0), 1e-5)


def test_shrinkage_never_grows_the_step_term():
    rewards, anchors, group_ids, mask = _batch(9)
    episode = np.asarray(_gigpo(rewards, anchors, group_ids, mask, omega=0.0))
    step_gig = np.asarray(_gigpo(rewards, anchors, group_ids, mask)) - episode
    step_ecpo = np.asarray(_ecpo(rewards, anchors, group_ids, mask)) - episode
    assert np.all(np.abs(step_ecpo) <= np.abs(step_gig) + 1e-6)
    assert np.all(step_ecpo * step_gig >= -1e-9)


def test_vmap_over_batches_equals_loop():
    batches = [_batch(seed) for seed in range(3)]
    stacked = [np.stack(parts) for parts in zip(*batches)]
    out = jax.jit(jax.vmap(ecpo))(*stacked)
    for k, parts in enumerate(batches):
        _close(out[k], _ecpo(*parts), 1e-4)


def test_bad_input_gives_clear_errors():
    rewards, anchors, group_ids, mask = FIXTURE
    with pytest.raises(ValueError, match=r"ecpo: kappa=-1.0; it must be finite and >= 0"):
        ecpo(rewards, anchors, group_ids, mask, kappa=-1.0)
    with pytest.raises(ValueError, match=r"ecpo: step_rewards has shape \(3, 3\) but anchors has "
                                         r"shape \(3, 2\)"):
        ecpo(rewards, anchors[:, :2], group_ids, mask)
    with pytest.raises(ValueError, match=r"ecpo: group_ids has shape \(2,\); it must be \[B\]"):
        ecpo(rewards, anchors, group_ids[:2], mask)
    with pytest.raises(TypeError, match="ecpo: anchors has dtype float32"):
        ecpo(rewards, anchors.astype(np.float32), group_ids, mask)
    with pytest.raises(ValueError, match="ecpo: std='max'"):
        ecpo(rewards, anchors, group_ids, mask, std="max")
    with pytest.raises(ValueError, match="ecpo: gamma=1.2"):
        ecpo(rewards, anchors, group_ids, mask, gamma=1.2)
    with pytest.raises(ValueError, match=r"ecpo: step_rewards is not finite at index \(0, 1\)"):
        ecpo(np.where(np.eye(3, dtype=bool)[[1, 2, 0]], np.nan, rewards), anchors, group_ids, mask)
    out = np.asarray(_ecpo(np.full((B, T), np.nan, np.float32), np.zeros((B, T), np.int32),
                           np.zeros(B, np.int32), np.zeros((B, T), bool)))
    assert not out.any()


def test_registry_entry():
    entry = registry.get("ecpo")
    assert entry.fn is ecpo
    assert dict(entry.defaults) == {"gamma": 0.95, "omega": 1.0, "kappa": 1.0, "std": "unbiased",
                                    "eps": 1e-6, "singleton": "zero"}
    assert entry.input_level == entry.output_level == "step" and entry.needs_groups
    assert entry.whiten == "none" and "2606.05885" in entry.paper
    rewards, anchors, group_ids, mask = _batch(9)
    _close(entry.fn(rewards, anchors, group_ids, mask, **entry.defaults),
           ref.ecpo(rewards, anchors, group_ids, mask), 1e-4)
