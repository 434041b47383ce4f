"""IGPO (information-gain turn rewards, group-normalised, discounted) against its NumPy reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from stepcredit import advantages as adv
from stepcredit.advantages import CreditInputs
from stepcredit.advantages.group import grpo
from stepcredit.advantages.igpo import igpo, information_gain
from stepcredit.advantages.turn_returns import gtpo
from tests.reference import igpo as ref
from tests.test_gigpo import _close

B, T = 12, 4  # one shape for the whole module: every new shape recompiles
_STATIC = ("normalize", "order", "std", "num_groups", "method")
_igpo = jax.jit(igpo, static_argnames=_STATIC)
_gain = jax.jit(information_gain, static_argnames=("gain",))

EXAMPLE = (jnp.array([[0.2, jnp.nan, jnp.nan], [0.1, -0.1, jnp.nan]]), jnp.array([1.0, 0.0]),
           jnp.array([0, 0]), jnp.array([[1, 1, 0], [1, 1, 1]], bool))


def _batch(seed, one_turn=False):
    """Prefix masks with NaN padding (an empty row), a singleton and an all-equal group."""
    rng = np.random.default_rng(seed)
    lengths = np.ones(B, int) if one_turn else rng.integers(1, T + 1, size=B)
    lengths[4] = 1 if one_turn else 0            # a trajectory with no valid turn
    mask = np.arange(T)[None, :] < lengths[:, None]
    ids = rng.choice(np.array([7, 1000, -3], np.int32), size=B)
    ids[-1] = 555                                # singleton
    ids[:3] = -77                                # all-equal group
    gains = rng.normal(size=(B, T)).astype(np.float32) * 0.3
    scores = rng.integers(0, 2, size=B).astype(np.float32)
    gains[:3], scores[:3], mask[:3] = 0.25, 1.0, np.arange(T) < (1 if one_turn else 2)
    gains[~mask] = np.nan
    return gains, scores, ids, mask


def test_hand_computed_example():
    _close(_igpo(*EXAMPLE), [[1.8323, 1.9341, 0], [-1.8323, -1.4761, -0.6108]], tol=1e-4)
    _close(_igpo(*EXAMPLE), ref.igpo(*(np.asarray(x) for x in EXAMPLE)))
    # The beliefs 0.1, 0.4, 0.5: the last turn's gain is the outcome's business.
    _close(_gain(jnp.log(jnp.array([[0.1, 0.4, 0.5]])), jnp.ones((1, 3), bool)), [[0.3, 0.1, 0]])
    _close(_gain(jnp.log(jnp.array([[0.1, 0.4, 0.5]])), jnp.ones((1, 3), bool),
                 gain="log_probability"), [[np.log(4.0), np.log(1.25), 0]])


@pytest.mark.parametrize("normalize,order,std", [("joint", "normalize_first", "biased"),
                                                 ("separate", "normalize_first", "unbiased"),
                                                 ("joint", "discount_first", "none"),
                                                 ("separate", "discount_first", "biased")])
def test_matches_reference(normalize, order, std):
    for seed in range(2):
        gains, scores, ids, mask = _batch(seed)
        out = _igpo(gains, scores, ids, mask, gamma=0.9, normalize=normalize, order=order,
                    std=std)
        _close(out, ref.igpo(gains, scores, ids, mask, gamma=0.9, normalize=normalize,
                             order=order, std=std))
        assert np.all(np.asarray(out)[~mask] == 0.0)


@pytest.mark.parametrize("gain", ["probability", "log_probability"])
def test_information_gain_matches_reference(gain):
    rng = np.random.default_rng(3)
    mask = rng.random((B, T)) < 0.7  # gaps too: the gain reaches the next valid turn
    logp = np.log(rng.uniform(0.01, 1.0, size=(B, T))).astype(np.float32)
    logp[~mask] = np.nan
    _close(_gain(logp, mask, gain=gain), ref.information_gain(logp, mask, gain))


def test_one_turn_per_trajectory_is_grpo():
    gains, scores, ids, mask = _batch(5, one_turn=True)
    for std in ("biased", "unbiased"):
        expected = np.where(mask, np.asarray(grpo(scores, ids, std=std))[:, None], 0.0)
        for normalize, order in (("joint", "normalize_first"), ("separate", "discount_first")):
            _close(_igpo(gains, scores, ids, mask, gamma=0.5, normalize=normalize, order=order,
                         std=std), expected)


def test_zero_gain_separate_is_the_discounted_group_normalised_outcome():
    _, scores, ids, mask = _batch(6)
    zeros = np.where(mask, 0.0, np.nan).astype(np.float32)
    # GRPO over the trajectories that have turns (the empty row has no last turn to compare).
    outcome = np.asarray(grpo(scores, np.where(mask.any(1), ids, 9999), std="biased"))
    remaining = mask.sum(1, keepdims=True) - 1 - np.arange(T)[None, :]
    for gamma in (1.0, 0.8):
        expected = np.where(mask, gamma ** np.maximum(remaining, 0) * outcome[:, None], 0.0)
        _close(_igpo(zeros, scores, ids, mask, gamma=gamma, normalize="separate"), expected)


def test_discount_first_joint_is_gtpo_over_all_turns():
    gains, scores, ids, mask = _batch(7)
    last = mask & ~np.concatenate([mask[:, 1:], np.zeros((B, 1), bool)], axis=1)
    rewards = np.where(last, scores[:, None], gains)
    _close(_igpo(gains, scores, ids, mask, gamma=0.7, order="discount_first", std="unbiased"),
           gtpo(rewards, ids, mask, gamma=0.7, baseline="all_turns", std="unbiased"))


def test_vmap_over_batches_equals_loop():
    batches = [_batch(seed) for seed in (8, 9)]
    stacked = [np.stack(x) for x in zip(*batches)]
    out = jax.vmap(lambda g, s, i, m: igpo(g, s, i, m, gamma=0.9, num_groups=None))(*stacked)
    for k, batch in enumerate(batches):
        _close(out[k], _igpo(*batch, gamma=0.9))


def test_registry_entry_derives_the_gain_from_answer_beliefs():
    entry = adv.get("igpo")
    assert entry.needs_information_gain and entry.needs_groups and not entry.needs_critic
    assert not adv.get("grpo").needs_information_gain
    assert entry.defaults["gamma"] == 1.0 and entry.input_defaults == {"gain": "probability"}
    assert entry.output_level == "step" and entry.whiten == "none"
    rng = np.random.default_rng(10)
    _, scores, ids, mask = _batch(10)
    logp = np.log(rng.uniform(0.05, 1.0, size=(B, T))).astype(np.float32)
    inputs = CreditInputs(mask=mask, scores=scores, group_ids=ids, answer_logp=logp)
    for gain in ("probability", "log_probability"):
        out = adv.apply("igpo", inputs, {"gain": gain, "normalize": "separate"})
        _close(out.advantages, ref.igpo(ref.information_gain(logp, mask, gain), scores, ids, mask,
                                        normalize="separate"))
    with pytest.raises(ValueError, match="needs answer_logp"):
        adv.apply("igpo", CreditInputs(mask=mask, scores=scores, group_ids=ids))


def test_bad_input_gives_clear_errors():
    gains, scores, ids, mask = _batch(11)
    with pytest.raises(ValueError, match="igpo: order='later'"):
        igpo(gains, scores, ids, mask, order="later")
    with pytest.raises(ValueError, match="igpo: gamma=1.5 is outside"):
        igpo(gains, scores, ids, mask, gamma=1.5)
    with pytest.raises(ValueError, match="information_gain is not finite at index"):
        igpo(np.where(mask, np.nan, 0.0).astype(np.float32), scores, ids, mask)
    with pytest.raises(ValueError, match="scores"):
        igpo(gains, scores[:-1], ids, mask)
    with pytest.raises(ValueError, match="information_gain: gain='odds'"):
        information_gain(gains, mask, gain="odds")
    with pytest.raises(ValueError, match="answer_logp holds a positive value"):
        information_gain(np.where(mask, 0.5, np.nan).astype(np.float32), mask)
