"""Tests of stepcredit.diagnose.metrics: loop references, scipy, hand-computed cases, bootstrap."""

import ast
import math

import numpy as np
import pytest
import scipy.stats

from stepcredit.diagnose import metrics
from stepcredit.diagnose.metrics import (Metric, auc, blame_localisation, bootstrap_interval,
                                         collateral_blame, evaluate, sign_agreement, spearman)
from stepcredit.diagnose.result import METRICS

# Slow, obvious references: Python loops over the real steps. -----------------------


def _real_steps(mask):
    return [(b, t) for b in range(mask.shape[0]) for t in range(mask.shape[1]) if mask[b, t]]


def reference_auc(credit, good, mask):
    goods = [credit[i] for i in _real_steps(mask) if good[i]]
    bads = [credit[i] for i in _real_steps(mask) if not good[i]]
    if not goods or not bads:
        return math.nan
    wins = sum(1.0 if g > b else 0.5 if g == b else 0.0 for g in goods for b in bads)
    return wins / (len(goods) * len(bads))


def _ranks(xs):
    """rank_i = 1 + #{j: x_j < x_i} + (#{j != i: x_j = x_i}) / 2, the average rank."""
    return [1 + sum(y < x for y in xs) + (sum(y == x for y in xs) - 1) / 2 for x in xs]


def reference_spearman(credit, truth, mask):
    steps = [i for i in _real_steps(mask) if math.isfinite(truth[i])]
    if len(steps) < 2:
        return math.nan
    x, y = _ranks([credit[i] for i in steps]), _ranks([truth[i] for i in steps])
    mx, my = sum(x) / len(x), sum(y) / len(y)
    sxy = sum((a - mx) * (b - my) for a, b in zip(x, y))
    sxx = sum((a - mx) ** 2 for a in x)
    syy = sum((b - my) ** 2 for b in y)
    return math.nan if sxx == 0 or syy == 0 else sxy / math.sqrt(sxx * syy)


def reference_sign_agreement(credit, truth, truth_se, mask, z=1.96):
    agree = []
    for i in _real_steps(mask):
        if math.isfinite(truth[i]) and math.isfinite(truth_se[i]) and abs(truth[i]) > z * truth_se[i]:
            agree.append(credit[i] != 0 and (credit[i] > 0) == (truth[i] > 0))
    return sum(agree) / len(agree) if agree else math.nan


def reference_blame_localisation(credit, good, mask, failed):
    scores = []
    for b in range(mask.shape[0]):
        steps = [t for t in range(mask.shape[1]) if mask[b, t]]
        bad = [t for t in steps if not good[b, t]]
        if not failed[b] or len(bad) != 1 or len(steps) < 2:
            continue
        lowest = min(credit[b, t] for t in steps)
        at_lowest = [t for t in steps if credit[b, t] == lowest]
        scores.append(1 / len(at_lowest) if bad[0] in at_lowest else 0.0)
    return sum(scores) / len(scores) if scores else math.nan


def reference_collateral_blame(credit, good, mask, failed):
    blamed = [credit[b, t] < 0 for b, t in _real_steps(mask) if good[b, t] and failed[b]]
    return sum(blamed) / len(blamed) if blamed else math.nan


def _data(seed, b=12, t=9, levels=4):
    """Random padded batch with many ties: credit and truth take `levels` values."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, t + 1, b)
    mask = np.arange(t)[None, :] < lengths[:, None]
    credit = rng.integers(-levels // 2, levels - levels // 2, (b, t)).astype(np.float32) / 2
    credit[~mask] = np.nan  # padding is never read
    good = rng.random((b, t)) < 0.6
    # Make several failed trajectories hold exactly one bad step.
    single = rng.random(b) < 0.5
    good[single] = True
    good[single, rng.integers(0, lengths[single])] = False
    truth = rng.integers(-3, 4, (b, t)) * 0.5 + rng.normal(0, 0.1, (b, t)) * (rng.random((b, t)) < 0.5)
    truth[rng.random((b, t)) < 0.1] = np.nan
    truth_se = rng.random((b, t)) * 0.8
    truth_se[rng.random((b, t)) < 0.1] = np.nan
    failed = rng.random(b) < 0.6
    return dict(credit=credit, good=good, mask=mask, truth=truth, truth_se=truth_se, failed=failed)


def _same(a, b):
    return (math.isnan(a) and math.isnan(b)) or a == pytest.approx(b, abs=1e-12)


SEEDS = range(20)

# Against the references and scipy. --------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
def test_auc_matches_pairwise_reference_and_mann_whitney(seed):
    d = _data(seed)
    got = auc(d["credit"], d["good"], d["mask"])
    assert isinstance(got, Metric) and got.n == d["mask"].sum()
    assert _same(got.value, reference_auc(d["credit"], d["good"], d["mask"]))
    x = d["credit"][d["mask"] & d["good"]]
    y = d["credit"][d["mask"] & ~d["good"]]
    u = scipy.stats.mannwhitneyu(x, y).statistic
    assert got.value == pytest.approx(u / (x.size * y.size), abs=1e-12)


@pytest.mark.parametrize("seed", SEEDS)
def test_spearman_matches_rank_formula_and_scipy(seed):
    d = _data(seed)
    got = spearman(d["credit"], d["truth"], d["mask"])
    keep = d["mask"] & np.isfinite(d["truth"])
    assert got.n == keep.sum()
    assert _same(got.value, reference_spearman(d["credit"], d["truth"], d["mask"]))
    expected = scipy.stats.spearmanr(d["credit"][keep], d["truth"][keep]).statistic
    assert got.value == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("z", [0.0, 1.0, 1.96])
def test_sign_agreement_matches_loop(seed, z):
    d = _data(seed)
    got = sign_agreement(d["credit"], d["truth"], d["truth_se"], d["mask"], z=z)
    expected = reference_sign_agreement(d["credit"], d["truth"], d["truth_se"], d["mask"], z)
    assert _same(got.value, expected)
    with np.errstate(invalid="ignore"):
        qualifies = (d["mask"] & np.isfinite(d["truth"]) & np.isfinite(d["truth_se"])
                     & (np.abs(d["truth"]) > z * d["truth_se"]))
    assert got.n == qualifies.sum()


@pytest.mark.parametrize("seed", SEEDS)
def test_blame_localisation_matches_loop(seed):
    d = _data(seed)
    got = blame_localisation(d["credit"], d["good"], d["mask"], d["failed"])
    expected = reference_blame_localisation(d["credit"], d["good"], d["mask"], d["failed"])
    assert _same(got.value, expected)
    single = d["failed"] & ((d["mask"] & ~d["good"]).sum(axis=1) == 1) & (d["mask"].sum(axis=1) >= 2)
    assert got.n == single.sum() > 0


def test_blame_localisation_is_the_expected_share_under_random_tie_breaking():
    # Break ties at random many times and count how often the bad step is picked.
    d = _data(3, b=40)
    rng = np.random.default_rng(0)
    picked = []
    for _ in range(400):
        jitter = rng.random(d["credit"].shape) * 1e-3  # smaller than the 0.5 credit spacing
        picked.append(blame_localisation(d["credit"] + jitter, d["good"], d["mask"], d["failed"]).value)
    expected = blame_localisation(d["credit"], d["good"], d["mask"], d["failed"]).value
    assert np.mean(picked) == pytest.approx(expected, abs=0.02)


@pytest.mark.parametrize("seed", SEEDS)
def test_collateral_blame_matches_loop(seed):
    d = _data(seed)
    got = collateral_blame(d["credit"], d["good"], d["mask"], d["failed"])
    expected = reference_collateral_blame(d["credit"], d["good"], d["mask"], d["failed"])
    assert _same(got.value, expected)
    assert got.n == (d["mask"] & d["good"] & d["failed"][:, None]).sum()


@pytest.mark.parametrize("seed", range(5))
def test_evaluate_computes_every_metric_of_a_diagnosis(seed):
    d = _data(seed)
    got = evaluate(d["credit"], d["mask"], good=d["good"], advantage=d["truth"],
                   advantage_se=d["truth_se"], failed=d["failed"], z=1.0)
    assert tuple(got) == METRICS
    expected = {
        "auc": auc(d["credit"], d["good"], d["mask"]),
        "spearman": spearman(d["credit"], d["truth"], d["mask"]),
        "sign_agreement": sign_agreement(d["credit"], d["truth"], d["truth_se"], d["mask"], z=1.0),
        "blame_localisation": blame_localisation(d["credit"], d["good"], d["mask"], d["failed"]),
        "collateral_blame": collateral_blame(d["credit"], d["good"], d["mask"], d["failed"]),
    }
    for name in METRICS:
        assert got[name].n == expected[name].n
        assert _same(got[name].value, expected[name].value)


# Hand-computed cases. ----------------------------------------------------------------

T_, F_ = True, False


def test_auc_of_separating_reversed_and_constant_credit():
    good = np.array([[T_, T_, F_, F_, T_], [F_, T_, F_, T_, F_]])
    mask = np.array([[T_] * 5, [T_, T_, T_, F_, F_]])
    separating = np.where(good, 1.0, -1.0)
    assert auc(separating, good, mask) == (1.0, 8)
    assert auc(-separating, good, mask) == (0.0, 8)
    assert auc(np.full((2, 5), 0.3), good, mask) == (0.5, 8)
    # The docstring's example: 1 + 1 + 0.5 + 1 of 4 pairs.
    assert auc([[2, 1, 1, 0]], [[T_, T_, F_, F_]], np.ones((1, 4), bool)) == (0.875, 4)


def test_auc_is_near_one_half_for_random_credit_on_large_data():
    rng = np.random.default_rng(1)
    b, t = 2000, 15
    mask = np.arange(t)[None, :] < rng.integers(1, t + 1, b)[:, None]
    value, n = auc(rng.normal(size=(b, t)), rng.random((b, t)) < 0.5, mask)
    assert n == mask.sum() > 10_000
    assert abs(value - 0.5) < 0.02


def test_auc_is_nan_without_both_classes():
    mask = np.array([[T_, T_, F_]])
    good = np.array([[T_, T_, F_]])  # the only bad step is padding
    value, n = auc(np.array([[1.0, 2.0, 3.0]]), good, mask)
    assert math.isnan(value) and n == 2


def test_spearman_hand_example_and_undefined_cases():
    mask = np.ones((1, 3), bool)
    assert spearman([[1.0, 2.0, 3.0]], [[0.1, 0.3, 0.2]], mask) == (0.5, 3)
    assert spearman([[1.0, 2.0, 3.0]], [[3.0, 2.0, 1.0]], mask).value == pytest.approx(-1.0)
    value, n = spearman([[1.0, 1.0, 1.0]], [[0.1, 0.3, 0.2]], mask)  # constant credit
    assert math.isnan(value) and n == 3
    value, n = spearman([[1.0, 2.0, 3.0]], [[np.nan, 0.3, np.inf]], mask)  # one finite truth
    assert math.isnan(value) and n == 1


def test_sign_agreement_hand_example():
    mask = np.ones((1, 4), bool)
    se = np.full((1, 4), 0.5)
    value, n = sign_agreement([[1.0, -1.0, 0.0, 5.0]], [[2.0, 2.0, -2.0, 0.1]], se, mask)
    assert n == 3 and value == pytest.approx(1 / 3)
    value, n = sign_agreement([[1.0]], [[0.1]], [[0.5]], [[True]])
    assert math.isnan(value) and n == 0


def test_broadcast_credit_localises_blame_with_probability_one_over_length():
    # One value per trajectory (as GRPO): every step ties, the bad one wins a 1/T_i draw.
    lengths = np.array([5, 3, 4])
    mask = np.arange(5)[None, :] < lengths[:, None]
    good = mask.copy()
    good[[0, 1, 2], [2, 0, 3]] = False
    credit = np.repeat([[-1.0], [-0.5], [-2.0]], 5, axis=1)
    failed = np.ones(3, bool)
    value, n = blame_localisation(credit, good, mask, failed)
    assert n == 3 and value == pytest.approx(np.mean(1 / lengths))
    # All equal length T: exactly 1/T.
    full = np.ones((3, 5), bool)
    assert blame_localisation(credit, good & full | ~mask, full, failed).value == pytest.approx(1 / 5)


def test_blame_localisation_hand_example_and_exclusions():
    mask = np.ones((4, 3), bool)
    good = np.array([[T_, F_, T_], [F_, T_, T_], [F_, F_, T_], [T_, F_, T_]])
    credit = np.array([[0.0, -1.0, 0.0], [0.0, 0.0, 0.0], [-1.0, -1.0, 0.0], [-5.0, 0.0, 0.0]])
    failed = np.array([T_, T_, T_, F_])  # row 2 has two bad steps, row 3 did not fail
    assert blame_localisation(credit, good, mask, failed) == (pytest.approx(2 / 3), 2)
    # A step strictly lower than the bad one scores 0.
    assert blame_localisation(credit[3:], good[3:], mask[3:], np.array([T_])) == (0.0, 1)
    value, n = blame_localisation(credit, good, mask, np.zeros(4, bool))
    assert math.isnan(value) and n == 0
    # A failed one-step trajectory has nothing to localise.
    value, n = blame_localisation(credit[:1], good[:1], np.array([[T_, T_, F_]]),
                                  failed[:1])
    assert (value, n) == (1.0, 1)
    value, n = blame_localisation(credit[1:2], good[1:2], np.array([[T_, F_, F_]]), failed[1:2])
    assert math.isnan(value) and n == 0


def test_collateral_blame_of_grpo_like_broadcast():
    mask = np.array([[T_, T_, T_, T_], [T_, T_, F_, F_]])
    good = np.array([[T_, F_, T_, T_], [T_, T_, F_, F_]])
    failed = np.array([T_, T_])
    assert collateral_blame(np.full((2, 4), -0.7), good, mask, failed) == (1.0, 5)
    assert collateral_blame(np.zeros((2, 4)), good, mask, failed) == (0.0, 5)
    assert collateral_blame([[-1.0, 0.0, -1.0]], [[T_, T_, F_]], np.ones((1, 3), bool),
                            np.array([T_])) == (0.5, 2)
    value, n = collateral_blame(np.full((2, 4), -0.7), good, mask, np.zeros(2, bool))
    assert math.isnan(value) and n == 0


# Bootstrap. ------------------------------------------------------------------------


def _clustered(num_clusters, per_cluster=8, t=10, seed=0):
    """Credit that tells good from bad with a per-cluster effect, so clusters matter."""
    rng = np.random.default_rng(seed)
    b = num_clusters * per_cluster
    clusters = np.repeat(rng.permutation(num_clusters) * 7 + 3, per_cluster)  # arbitrary ids
    mask = np.arange(t)[None, :] < rng.integers(2, t + 1, b)[:, None]
    good = rng.random((b, t)) < 0.5
    shift = rng.normal(0, 1, num_clusters * 7 + 10)[clusters][:, None]
    credit = good * (1.0 + shift) + rng.normal(size=(b, t))
    return credit, good, mask, clusters


def test_bootstrap_interval_covers_the_estimate_and_shrinks_with_more_clusters():
    widths = []
    for num_clusters in (10, 160):
        credit, good, mask, clusters = _clustered(num_clusters)
        estimate = auc(credit, good, mask).value
        low, high = bootstrap_interval(lambda rows: auc(credit[rows], good[rows], mask[rows]).value,
                                       clusters)
        assert low < estimate < high
        widths.append(high - low)
    assert widths[1] < widths[0] / 2


def test_bootstrap_resamples_whole_clusters():
    clusters = np.array([5, 9, 5, 2, 9, 9, 2, 7])
    seen = []

    def statistic(rows):
        assert rows.dtype == np.int64
        seen.append(rows)
        return float(len(rows))

    bootstrap_interval(statistic, clusters, num_resamples=50, seed=3)
    assert len(seen) == 50
    members = {c: set(np.flatnonzero(clusters == c)) for c in np.unique(clusters)}
    for rows in seen:
        drawn = clusters[rows]
        counts = {c: int((drawn == c).sum()) for c in members}
        for c, rows_of_c in members.items():
            times = counts[c] // len(rows_of_c)
            assert counts[c] == times * len(rows_of_c)  # whole clusters only
            assert all(int((rows == r).sum()) == times for r in rows_of_c)
        assert sum(counts[c] // len(members[c]) for c in members) == len(members)
    # Different resamples differ, and the same seed draws the same ones.
    assert len({tuple(r) for r in seen}) > 1
    again = []
    bootstrap_interval(lambda rows: again.append(rows) or 0.0, clusters, num_resamples=50, seed=3)
    assert all(np.array_equal(a, b) for a, b in zip(seen, again))


def test_bootstrap_drops_nan_resamples_and_needs_half_of_them():
    clusters = np.arange(20)
    counter = iter(range(10_000))

    def sometimes_nan(rows, every):
        i = next(counter)
        return math.nan if i % every == 0 else float(i % 7)

    low, high = bootstrap_interval(lambda r: sometimes_nan(r, 3), clusters)  # a third NaN
    assert (low, high) == (0.0, 6.0)
    low, high = bootstrap_interval(lambda r: math.nan if next(counter) % 3 else 1.0, clusters)
    assert math.isnan(low) and math.isnan(high)


def test_bootstrap_of_several_metrics_at_once_matches_one_at_a_time():
    d = _data(0, b=40)
    clusters = np.arange(40) // 4
    inputs = dict(good=d["good"], advantage=d["truth"], advantage_se=d["truth_se"], failed=d["failed"])

    def values(rows):
        got = evaluate(d["credit"][rows], d["mask"][rows], **{k: v[rows] for k, v in inputs.items()})
        return np.array([m.value for m in got.values()])

    low, high = bootstrap_interval(values, clusters, num_resamples=60, seed=1)
    assert low.shape == high.shape == (len(METRICS),)
    for k in range(len(METRICS)):
        one = bootstrap_interval(lambda rows: values(rows)[k], clusters, num_resamples=60, seed=1)
        np.testing.assert_array_equal([low[k], high[k]], one)


# Bad inputs. -------------------------------------------------------------------------


def _steps(b=4, t=7):
    return np.zeros((b, t)), np.ones((b, t), bool)


def test_shape_mismatch_names_the_arguments():
    credit, _ = _steps()
    with pytest.raises(ValueError, match=r"auc: credit has shape \(4, 7\) but mask has shape \(4, 6\)"):
        auc(credit, np.ones((4, 7), bool), np.ones((4, 6), bool))
    with pytest.raises(ValueError, match=r"spearman: credit has shape \(4, 7\) but truth has shape"):
        spearman(credit, np.zeros((4, 6)), np.ones((4, 7), bool))
    with pytest.raises(ValueError, match=r"sign_agreement: credit .* but truth_se has shape \(7,\)"):
        sign_agreement(credit, credit, np.zeros(7), np.ones((4, 7), bool))
    with pytest.raises(ValueError, match=r"blame_localisation: credit .* but failed has shape \(7,\)"):
        blame_localisation(credit, np.ones((4, 7), bool), np.ones((4, 7), bool), np.ones(7, bool))
    with pytest.raises(ValueError, match=r"collateral_blame: credit has shape \(28,\); it must be"):
        collateral_blame(credit.ravel(), np.ones(28, bool), np.ones(28, bool), np.ones(4, bool))


def test_nan_credit_on_a_real_step_is_an_error_but_not_on_padding():
    credit, mask = _steps()
    good = np.arange(28).reshape(4, 7) % 2 == 0
    credit[2, 3] = np.nan
    with pytest.raises(ValueError, match=r"auc: credit is NaN at 1 real step\(s\), the first at \[2, 3\]"):
        auc(credit, good, mask)
    mask[2, 3] = False
    assert auc(credit, good, mask).n == 27


def test_wrong_dtypes_name_the_argument():
    credit, mask = _steps()
    with pytest.raises(ValueError, match="auc: mask has dtype int64; it must be bool"):
        auc(credit, mask, mask.astype(np.int64))
    with pytest.raises(ValueError, match="collateral_blame: good has dtype float64"):
        collateral_blame(credit, credit, mask, np.ones(4, bool))
    with pytest.raises(ValueError, match="blame_localisation: failed has dtype int64"):
        blame_localisation(credit, mask, mask, np.ones(4, np.int64))
    with pytest.raises(ValueError, match="spearman: credit has dtype <U1"):
        spearman(np.full((4, 7), "a"), credit, mask)
    with pytest.raises(ValueError, match="evaluate: advantage has dtype bool"):
        evaluate(credit, mask, good=mask, advantage=mask, advantage_se=credit, failed=np.ones(4, bool))


def test_bad_values_name_the_argument():
    credit, mask = _steps()
    se = np.zeros((4, 7))
    se[1, 1] = -0.5
    with pytest.raises(ValueError, match=r"sign_agreement: truth_se is -0.5 at real step \[1, 1\]"):
        sign_agreement(credit, credit, se, mask)
    with pytest.raises(ValueError, match=r"evaluate: advantage_se is -0.5 at real step \[1, 1\]"):
        evaluate(credit, mask, good=mask, advantage=credit, advantage_se=se, failed=np.ones(4, bool))
    with pytest.raises(ValueError, match="sign_agreement: z=-1.0; it must be a finite number >= 0"):
        sign_agreement(credit, credit, np.zeros((4, 7)), mask, z=-1.0)


def test_bootstrap_rejects_bad_arguments():
    with pytest.raises(ValueError, match="bootstrap_interval: clusters has dtype float64"):
        bootstrap_interval(lambda rows: 0.0, np.zeros(4))
    with pytest.raises(ValueError, match=r"bootstrap_interval: clusters has shape \(2, 2\)"):
        bootstrap_interval(lambda rows: 0.0, np.zeros((2, 2), int))
    with pytest.raises(ValueError, match="bootstrap_interval: num_resamples=0"):
        bootstrap_interval(lambda rows: 0.0, np.arange(4), num_resamples=0)
    with pytest.raises(ValueError, match="bootstrap_interval: level=1.0"):
        bootstrap_interval(lambda rows: 0.0, np.arange(4), level=1.0)
    with pytest.raises(ValueError, match=r"bootstrap_interval: statistic returned shape \(2, 2\)"):
        bootstrap_interval(lambda rows: np.zeros((2, 2)), np.arange(4))


def test_metrics_import_only_numpy():
    tree = ast.parse(open(metrics.__file__, encoding="utf-8").read())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom) and node.module}
    assert imported == {"__future__", "typing", "numpy", "stepcredit"}
