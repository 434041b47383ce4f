"""verl's optimal token baseline against its NumPy loop reference, the docstring example, and
properties tying it to GRPO without the std (Dr. GRPO's baseline)."""

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stepcredit import advantages as adv
from stepcredit.advantages import registry
from stepcredit.advantages.group import grpo
from stepcredit.advantages.optimal_baseline import optimal_token_baseline
from tests.reference import optimal_baseline as ref

B, N = 8, 10  # one shape for the module

_otb = jax.jit(optimal_token_baseline,
               static_argnames=("align", "handle_zero_tail", "singleton", "num_groups"))
_grpo = jax.jit(grpo, static_argnames=("std", "singleton"))


def _close(actual, expected, tol=1e-5):
    expected = np.asarray(expected, np.float64)
    scale = max(1.0, float(np.abs(expected).max(initial=0.0)))
    np.testing.assert_allclose(np.asarray(actual, np.float64), expected, rtol=tol, atol=tol * scale)


def _batch(seed, equal_scores=False):
    """Ragged rows with observation gaps, NaN padding, one empty row, singleton groups."""
    rng = np.random.default_rng(seed)
    mask = rng.random((B, N)) < 0.7
    lengths = rng.integers(1, N + 1, size=B)
    mask &= np.arange(N)[None, :] < lengths[:, None]
    mask[:, 0] |= True
    mask[3] = False                              # a padding trajectory
    scores = (np.full(B, 0.5) if equal_scores else rng.integers(0, 3, B)).astype(np.float32)
    logp = np.where(mask, -rng.exponential(1.0, (B, N)), np.nan).astype(np.float32)
    sum_sq = np.where(mask, rng.uniform(0.0, 1.0, (B, N)), np.nan).astype(np.float32)
    group_ids = np.array([7, 7, 7, 7, 1000, 1000, -3, 42], np.int32)  # -3, 42: singletons
    return scores, group_ids, mask, logp, sum_sq


def test_docstring_example():
    mask = np.array([[1, 1, 1], [1, 0, 1]], bool)
    scores, groups = np.array([1.0, 0.0], np.float32), np.array([0, 0], np.int32)
    _close(optimal_token_baseline(scores, groups, mask), [[0.5, 0, 0.4], [-0.5, 0, -0.6]])
    _close(optimal_token_baseline(scores, groups, mask, align="action"),
           [[0.5, 0.5, 0], [-0.5, 0, -0.5]])
    # pi = 0.5 everywhere and sum pi^2 = 0.5: w = 1 - 1 + 0.5 = 0.5, W halves, b unchanged.
    half = np.log(np.full((2, 3), 0.5, np.float32))
    _close(optimal_token_baseline(scores, groups, mask, half,
                                  sum_pi_squared=np.full((2, 3), 0.5, np.float32)),
           [[0.5, 0, 0.4], [-0.5, 0, -0.6]])
    # The zero tail: the first trajectory is uniquely longest (3 tokens against 2); from
    # column 2 on its baseline is 0, so A = G = 1 there.
    _close(optimal_token_baseline(scores, groups, mask, handle_zero_tail=True),
           [[0.5, 0, 1.0], [-0.5, 0, -0.6]])


@pytest.mark.parametrize("align", ["position", "action"])
@pytest.mark.parametrize("handle_zero_tail", [False, True])
@pytest.mark.parametrize("singleton", ["raw", "zero"])
def test_matches_reference(align, handle_zero_tail, singleton):
    for seed in range(3):
        scores, group_ids, mask, logp, sum_sq = _batch(seed, equal_scores=seed == 2)
        options = dict(align=align, handle_zero_tail=handle_zero_tail, singleton=singleton)
        for logps, squares in ((None, None), (logp, None), (logp, sum_sq)):
            expected = ref.optimal_token_baseline(scores, group_ids, mask, logps, squares,
                                                  **options)
            _close(_otb(scores, group_ids, mask, logps, sum_pi_squared=squares, **options),
                   expected, 1e-4)


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**31 - 1))
def test_full_rows_with_equal_energy_give_grpo_without_std(seed):
    """Every trajectory has an action token at every column and the same log-probs per column:
    W is equal across a group, b is the group mean, and A is `grpo(std="none")`."""
    scores, group_ids, _, logp, _ = _batch(seed)
    mask = np.ones((B, N), bool)
    column = np.broadcast_to(logp[0:1].clip(-5, 0) if np.isfinite(logp[0]).all()
                             else np.full((1, N), -0.7, np.float32), (B, N))
    expected = np.asarray(_grpo(scores, group_ids, std="none", singleton="raw"))[:, None]
    for logps in (None, np.nan_to_num(column, nan=-0.7)):
        _close(_otb(scores, group_ids, mask, logps), np.broadcast_to(expected, (B, N)), 1e-4)


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**31 - 1))
def test_permuting_trajectories_permutes_outputs(seed):
    scores, group_ids, mask, logp, _ = _batch(seed)
    perm = np.random.default_rng(seed).permutation(B)
    out = np.asarray(_otb(scores, group_ids, mask, logp))
    _close(_otb(scores[perm], group_ids[perm], mask[perm], logp[perm]), out[perm])


def test_all_equal_scores_give_near_zero_and_padding_gives_zero():
    scores, group_ids, mask, logp, _ = _batch(5, equal_scores=True)
    out = np.asarray(_otb(scores, group_ids, mask, logp, singleton="zero"))
    assert np.abs(out).max() < 1e-5 and not out[~mask].any() and not out[3].any()
    # verl's singleton keeps its return: rows 6 and 7 are singletons.
    raw = np.asarray(_otb(scores, group_ids, mask, logp))
    _close(raw[6:], np.where(mask[6:], 0.5, 0.0))


def test_jit_equals_eager_and_vmap_equals_loop():
    parts = [_batch(seed) for seed in range(3)]
    for scores, group_ids, mask, logp, _ in parts:
        _close(_otb(scores, group_ids, mask, logp),
               optimal_token_baseline(scores, group_ids, mask, logp), 1e-6)
    stacked = [np.stack([p[i] for p in parts]) for i in range(4)]
    out = jax.jit(jax.vmap(optimal_token_baseline))(*stacked)
    for k, (scores, group_ids, mask, logp, _) in enumerate(parts):
        _close(out[k], _otb(scores, group_ids, mask, logp), 1e-5)


def test_bad_input_raises_one_clear_line():
    scores, group_ids, mask, logp, sum_sq = _batch(0)
    fn = optimal_token_baseline
    cases = [
        (lambda: fn(scores[:3], group_ids, mask), ValueError,
         r"optimal_token_baseline: group_ids has shape \(8,\); it must be \[B\] = \(3,\)"),
        (lambda: fn(scores, group_ids, mask[:3]), ValueError,
         r"optimal_token_baseline: action_mask has shape \(3, 10\) but scores has shape \(8,\)"),
        (lambda: fn(scores, group_ids, mask, logp[:, :4]), ValueError,
         r"optimal_token_baseline: action_mask has shape \(8, 10\) but ref_logp has shape"),
        (lambda: fn(scores, group_ids.astype(np.float32), mask), TypeError,
         "optimal_token_baseline: group_ids has dtype float32"),
        (lambda: fn(scores, group_ids, mask, sum_pi_squared=sum_sq), ValueError,
         "optimal_token_baseline: sum_pi_squared is given but ref_logp is None"),
        (lambda: fn(np.where(np.arange(B) == 1, np.nan, scores).astype(np.float32), group_ids,
                    mask), ValueError, r"optimal_token_baseline: scores is not finite at index \(1,\)"),
        (lambda: fn(scores, group_ids, mask, np.where(mask, np.inf, logp).astype(np.float32)),
         ValueError, r"optimal_token_baseline: ref_logp is not finite at index \(0, 0\)"),
        (lambda: fn(scores, group_ids, mask, align="turn"), ValueError,
         "optimal_token_baseline: align='turn'"),
        (lambda: fn(scores, group_ids, mask, eps=-1.0), ValueError,
         "optimal_token_baseline: eps=-1.0"),
    ]
    for call, error, message in cases:
        with pytest.raises(error, match=message) as raised:
            call()
        assert "\n" not in str(raised.value)


def test_registry_entry():
    entry = registry.get("optimal_token_baseline")
    assert entry.fn is optimal_token_baseline and adv.optimal_token_baseline is entry.fn
    assert dict(entry.defaults) == {"eps": 1e-8, "align": "position", "handle_zero_tail": False,
                                    "singleton": "raw"}
    assert entry.output_level == "token" and entry.whiten == "none" and entry.needs_groups
    assert "ref_logp" in entry.fields and not entry.needs_critic
    scores, group_ids, mask, logp, _ = _batch(9)
    step_index = np.where(mask, 0, -1).astype(np.int32)
    out = registry.apply("optimal_token_baseline", adv.CreditInputs(
        scores=scores, group_ids=group_ids, step_index=step_index, ref_logp=logp))
    _close(out.advantages, ref.optimal_token_baseline(scores, group_ids, mask, logp), 1e-4)
    assert out.level == "token" and out.returns is None
    without = registry.apply("optimal_token_baseline", adv.CreditInputs(
        scores=scores, group_ids=group_ids, step_index=step_index))
    _close(without.advantages, ref.optimal_token_baseline(scores, group_ids, mask), 1e-4)
