"""GTPO and Kevin (group-relative discounted per-turn returns), against NumPy loop references."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stepcredit import advantages
from stepcredit.advantages import CreditInputs, gae, group, turn_returns
from tests.reference import group as group_ref
from tests.reference import turn_returns as ref

B, T = 12, 4  # one shape for the whole module: every new shape recompiles
_STATIC = ("baseline", "std", "singleton", "num_groups", "method")
_gtpo = jax.jit(turn_returns.gtpo, static_argnames=_STATIC)
_kevin = jax.jit(turn_returns.kevin, static_argnames=_STATIC)
FUNCTIONS = {"gtpo": (_gtpo, ref.gtpo), "kevin": (_kevin, ref.kevin)}

EXAMPLE = (jnp.array([[0., 1.], [0., 0.], [1., jnp.nan]]), jnp.array([0, 0, 0]),
           jnp.array([[1, 1], [1, 1], [1, 0]], bool))


def _close(actual, expected, tol=1e-5):
    expected = np.asarray(expected, np.float64)
    scale = max(1.0, float(np.abs(expected).max(initial=0.0)))
    np.testing.assert_allclose(np.asarray(actual, np.float64), expected, rtol=tol, atol=tol * scale)


def _batch(seed):
    """Rewards with NaN padding (a gap, ragged ends, an empty row), a singleton and an all-equal group."""
    rng = np.random.default_rng(seed)
    mask = rng.random((B, T)) < 0.75
    mask[:, 0] = True
    mask[4] = False                              # a trajectory with no valid turn
    ids = rng.choice(np.array([7, 1000, -3], np.int32), size=B)
    ids[-1] = 555                                # singleton
    ids[:3] = -77                                # all-equal group
    rewards = rng.normal(size=(B, T)).astype(np.float32) * 2.0
    rewards[:3] = 0.5
    mask[:3] = True
    rewards[~mask] = np.nan
    return rewards, ids, mask


# --- hand-computed example (the docstrings') --------------------------------------------------

def test_docstring_examples():
    s = 1.0 / (0.5 + 1e-6)
    _close(_gtpo(*EXAMPLE, gamma=0.5), [[0, 0.5 / (np.sqrt(0.5) + 1e-6)],
                                        [-0.5 * s, -0.5 / (np.sqrt(0.5) + 1e-6)], [0.5 * s, 0]])
    _close(_gtpo(*EXAMPLE, gamma=0.5, baseline="all_turns"),
           [[0, 0.5 * s], [-0.5 * s, -0.5 * s], [0.5 * s, 0]])
    _close(_kevin(*EXAMPLE, gamma=0.5), [[0, 0.5], [-0.5, -0.5], [0.5, 0]])
    for name, (fn, reference) in FUNCTIONS.items():
        r, g, m = (np.asarray(x) for x in EXAMPLE)
        _close(fn(*EXAMPLE, gamma=0.5), reference(r, g, m, gamma=0.5))


# --- against the reference --------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(FUNCTIONS))
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("baseline", turn_returns.BASELINES)
@pytest.mark.parametrize("std", group.STDS)
def test_matches_reference_on_random_batches(name, seed, baseline, std):
    fn, reference = FUNCTIONS[name]
    rewards, ids, mask = _batch(seed)
    out = fn(rewards, ids, mask, gamma=0.7, baseline=baseline, std=std)
    expected = reference(rewards, ids, mask, gamma=0.7, baseline=baseline, std=std)
    assert np.isfinite(np.asarray(out)).all()
    _close(out, expected, 1e-4)
    assert np.all(np.asarray(out)[~mask] == 0)
    if baseline == "same_turn":                  # equal trajectories: equal returns per turn
        assert np.all(np.asarray(out)[:3] == 0)
        assert np.all(np.asarray(out)[-1] == 0)  # singleton group: one member per turn


@pytest.mark.parametrize("name", sorted(FUNCTIONS))
def test_singleton_raw_and_defaults_match_reference(name):
    fn, reference = FUNCTIONS[name]
    rewards, ids, mask = _batch(3)
    _close(fn(rewards, ids, mask, singleton="raw"), reference(rewards, ids, mask, singleton="raw"),
           1e-4)
    _close(fn(rewards, ids, mask), reference(rewards, ids, mask), 1e-4)
    # eager equals compiled, with num_groups given after remapping
    dense = group.dense_group_ids(ids)
    eager = getattr(turn_returns, name)(rewards, dense.ids, mask, num_groups=dense.num_groups)
    _close(eager, fn(rewards, ids, mask))


@pytest.mark.parametrize("method", ["chunked", "associative"])
def test_scan_methods_agree(method):
    rewards, ids, mask = _batch(4)
    _close(_kevin(rewards, ids, mask, method=method), _kevin(rewards, ids, mask), 1e-5)
    _close(_gtpo(rewards, ids, mask, method=method), _gtpo(rewards, ids, mask), 1e-4)


# --- properties tying them to other estimators ------------------------------------------------

@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), gamma=st.floats(0.0, 1.0))
def test_one_turn_gtpo_is_grpo_and_kevin_is_drgrpo(seed, gamma):
    rng = np.random.default_rng(seed)
    rewards = np.full((B, T), np.nan, np.float32)
    rewards[:, 0] = rng.normal(size=B)
    mask = np.zeros((B, T), bool)
    mask[:, 0] = True
    ids = rng.integers(0, 3, size=B).astype(np.int32)
    grpo = np.asarray(group.grpo(rewards[:, 0], ids))
    drgrpo = np.asarray(group.grpo(rewards[:, 0], ids, std="none"))
    for baseline in turn_returns.BASELINES:
        _close(np.asarray(_gtpo(rewards, ids, mask, gamma=gamma, baseline=baseline))[:, 0], grpo,
               1e-4)
        _close(np.asarray(_kevin(rewards, ids, mask, gamma=gamma, baseline=baseline))[:, 0],
               drgrpo, 1e-4)


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**31 - 1))
def test_gamma_one_and_final_reward_broadcasts_the_group_estimator(seed):
    """Equal lengths, the score on the last turn, gamma 1: every turn gets GRPO / Dr. GRPO's value."""
    rng = np.random.default_rng(seed)
    scores = rng.normal(size=B).astype(np.float32)
    rewards = np.zeros((B, T), np.float32)
    rewards[:, -1] = scores
    mask = np.ones((B, T), bool)
    ids = rng.integers(0, 3, size=B).astype(np.int32)
    grpo = np.asarray(group.grpo(scores, ids, std="biased"))
    drgrpo = np.asarray(group.grpo(scores, ids, std="none"))
    for baseline in turn_returns.BASELINES:
        _close(_kevin(rewards, ids, mask, gamma=1.0, baseline=baseline),
               np.repeat(drgrpo[:, None], T, 1), 1e-4)
        _close(_gtpo(rewards, ids, mask, gamma=1.0, baseline=baseline, std="biased"),
               np.repeat(grpo[:, None], T, 1), 1e-4)
    # same_turn with the unbiased std is GRPO's unbiased std at every index
    _close(_gtpo(rewards, ids, mask, gamma=1.0),
           np.repeat(np.asarray(group.grpo(scores, ids))[:, None], T, 1), 1e-4)


def test_returns_are_discounted_returns_and_gamma_zero_is_the_turn_score():
    rewards, ids, mask = _batch(5)
    _close(ref.turn_returns(rewards, mask, 0.7), gae.discounted_returns(rewards, mask, gamma=0.7),
           1e-5)
    # gamma 0, same_turn, std none: each turn's score minus the same-index mean of its group
    out = _kevin(rewards, ids, mask, gamma=0.0, baseline="same_turn")
    for t in range(T):
        expected = group_ref.group_normalize(np.where(mask[:, t], rewards[:, t], 0.0), ids,
                                             mask[:, t], std="none")
        _close(np.asarray(out)[:, t], expected, 1e-5)


# --- registry ---------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["gtpo", "kevin"])
def test_registry_entry_runs_at_its_defaults(name):
    entry = advantages.get(name)
    assert entry.output_level == "step" and entry.whiten == "none" and entry.needs_groups
    rewards, ids, mask = _batch(6)
    out = advantages.apply(name, CreditInputs(mask=mask, step_rewards=rewards, group_ids=ids))
    _close(out.advantages, getattr(ref, name)(rewards, ids, mask), 1e-4)
    assert out.returns is None and out.level == "step"


def test_registry_defaults():
    assert advantages.get("kevin").defaults["gamma"] == 0.4
    assert advantages.get("kevin").defaults["std"] == "none"
    assert advantages.get("gtpo").defaults["baseline"] == "same_turn"


# --- bad input --------------------------------------------------------------------------------

@pytest.mark.parametrize("fn", [turn_returns.gtpo, turn_returns.kevin])
def test_bad_input_raises_one_clear_line(fn):
    name = fn.__name__
    rewards, ids, mask = _batch(7)
    cases = [
        ((rewards[:, :3], ids, mask), {}, ValueError,
         rf"{name}: step_rewards has shape \(12, 3\) but mask has shape \(12, 4\)"),
        ((rewards, ids[:5], mask), {}, ValueError, rf"{name}: group_ids has shape \(5,\)"),
        ((np.zeros((B, T), np.int32), ids, mask), {}, TypeError, rf"{name}: step_rewards has dtype"),
        ((rewards, ids.astype(np.float32), mask), {}, TypeError, rf"{name}: group_ids has dtype"),
        ((rewards[0], ids, mask), {}, ValueError, rf"{name}: step_rewards has shape \(4,\)"),
        ((rewards, ids, mask), {"gamma": 1.5}, ValueError, rf"{name}: gamma=1.5 is outside"),
        ((rewards, ids, mask), {"baseline": "turn"}, ValueError, rf"{name}: baseline='turn'"),
        ((rewards, ids, mask), {"std": "sample"}, ValueError, rf"{name}: std='sample'"),
        ((np.where(mask, rewards, 0).astype(np.float32) + np.where(np.eye(B, T, dtype=bool), np.inf,
                                                                    0).astype(np.float32),
          ids, np.ones((B, T), bool)), {}, ValueError, rf"{name}: step_rewards is not finite"),
    ]
    for args, kwargs, error, message in cases:
        with pytest.raises(error, match=message) as info:
            fn(*args, **kwargs)
        assert "\n" not in str(info.value)
