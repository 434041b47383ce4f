"""How well step credit matches the ground truth: the five metrics of a diagnosis.

Every metric grades an estimator's step credit `[B, T]` (B trajectories, T
steps, padded) against what the simulator knows: the oracle progress labels
`good`, the Monte Carlo advantage A^pi(s_t, a_t) with its standard error, and
which trajectories failed. `mask` `[B, T]` (bool, True on real steps) decides
which positions count; padding is never read.

Each metric returns `Metric(value, n)`: the value (NaN when nothing
qualifies, as each docstring says) and n, how many items it was computed
over (steps, or trajectories for `blame_localisation`). `evaluate` computes
all of `stepcredit.diagnose.result.METRICS` at once; `bootstrap_interval`
gives a percentile interval by resampling whole clusters of trajectories.

Plain NumPy, vectorised: ranks come from one sort of the flattened real steps
(O(n log n)), and no metric loops over steps or trajectories in Python.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import numpy as np

from stepcredit.diagnose.result import METRICS


class Metric(NamedTuple):
    """One metric's value and the number of items it was computed over.

    Attributes:
      value: the metric, a float (NaN when no item qualifies or it is undefined).
      n: how many items it counted: steps, or trajectories for `blame_localisation`.
    """

    value: float
    n: int


# Boundary checks. ---------------------------------------------------------------


def _steps(fn: str, name: str, x: Any, shape: tuple[int, ...] | None) -> np.ndarray:
    """`x` as a float64 `[B, T]` array of `shape` (the credit's); bools are refused."""
    x = np.asarray(x)
    if x.dtype == np.bool_ or not (np.issubdtype(x.dtype, np.floating)
                                   or np.issubdtype(x.dtype, np.integer)):
        raise ValueError(f"{fn}: {name} has dtype {x.dtype}; it must be a real number type")
    if shape is None and x.ndim != 2:
        raise ValueError(f"{fn}: {name} has shape {x.shape}; it must be [B, T]")
    if shape is not None and x.shape != shape:
        raise ValueError(f"{fn}: credit has shape {shape} but {name} has shape {x.shape}; "
                         f"both must be [B, T]")
    return x.astype(np.float64, copy=False)


def _bools(fn: str, name: str, x: Any, shape: tuple[int, ...], expected: str) -> np.ndarray:
    x = np.asarray(x)
    if x.dtype != np.bool_:
        raise ValueError(f"{fn}: {name} has dtype {x.dtype}; it must be bool")
    if x.shape != shape:
        raise ValueError(f"{fn}: credit has shape {shape} but {name} has shape {x.shape}; "
                         f"{name} must be {expected}")
    return x


def _credit_and_mask(fn: str, credit: Any, mask: Any) -> tuple[np.ndarray, np.ndarray]:
    """Checks `credit` `[B, T]` real numbers, `mask` `[B, T]` bool, no NaN credit on a real step."""
    credit = _steps(fn, "credit", credit, None)
    mask = _bools(fn, "mask", mask, credit.shape, "[B, T] like credit")
    nan = np.isnan(credit) & mask
    if nan.any():
        b, t = np.argwhere(nan)[0]
        raise ValueError(f"{fn}: credit is NaN at {int(nan.sum())} real step(s), the first at "
                         f"[{b}, {t}]; credit must be a number on every step the mask keeps")
    return credit, mask


def _standard_error(fn: str, name: str, se: Any, mask: np.ndarray) -> np.ndarray:
    """`se` `[B, T]` like the mask, >= 0 (or NaN) on every real step."""
    se = _steps(fn, name, se, mask.shape)
    negative = mask & (se < 0)
    if negative.any():
        b, t = np.argwhere(negative)[0]
        raise ValueError(f"{fn}: {name} is {se[b, t]} at real step [{b}, {t}]; "
                         f"a standard error must be >= 0 (or NaN where unknown)")
    return se


def _check_z(fn: str, z: Any) -> float:
    if isinstance(z, bool) or not isinstance(z, (int, float, np.integer, np.floating)) \
            or not np.isfinite(z) or z < 0:
        raise ValueError(f"{fn}: z={z!r}; it must be a finite number >= 0")
    return float(z)


# Ranks. --------------------------------------------------------------------------


def _average_ranks(x: np.ndarray) -> np.ndarray:
    """1-based ranks of the 1-D `x`, ties sharing the mean of their ranks (one sort)."""
    order = np.argsort(x, kind="stable")
    ordered = x[order]
    first = np.empty(x.size, dtype=bool)
    first[:1] = True
    np.not_equal(ordered[1:], ordered[:-1], out=first[1:])
    starts = np.flatnonzero(first)
    ends = np.append(starts[1:], x.size)
    ranks = np.empty(x.size, dtype=np.float64)
    ranks[order] = ((starts + ends + 1) / 2.0)[np.cumsum(first) - 1]
    return ranks


# The metrics on checked arrays. -------------------------------------------------


def _auc(credit: np.ndarray, good: np.ndarray, mask: np.ndarray) -> Metric:
    labels = good[mask]
    n_good = int(labels.sum())
    n_bad = labels.size - n_good
    if n_good == 0 or n_bad == 0:
        return Metric(float("nan"), labels.size)
    ranks = _average_ranks(credit[mask])
    u = ranks[labels].sum() - n_good * (n_good + 1) / 2.0
    return Metric(float(u / (n_good * n_bad)), labels.size)


def _spearman(credit: np.ndarray, truth: np.ndarray, mask: np.ndarray) -> Metric:
    keep = mask & np.isfinite(truth)
    n = int(keep.sum())
    if n < 2:
        return Metric(float("nan"), n)
    x = _average_ranks(credit[keep])
    y = _average_ranks(truth[keep])
    x -= x.mean()
    y -= y.mean()
    denominator = np.sqrt((x * x).sum() * (y * y).sum())
    if denominator == 0.0:
        return Metric(float("nan"), n)
    return Metric(float(np.clip((x * y).sum() / denominator, -1.0, 1.0)), n)


def _sign_agreement(credit: np.ndarray, truth: np.ndarray, truth_se: np.ndarray,
                    mask: np.ndarray, z: float) -> Metric:
    with np.errstate(invalid="ignore"):
        keep = mask & np.isfinite(truth) & np.isfinite(truth_se) & (np.abs(truth) > z * truth_se)
    n = int(keep.sum())
    if n == 0:
        return Metric(float("nan"), n)
    agree = np.sign(credit[keep]) == np.sign(truth[keep])
    return Metric(float(agree.mean()), n)


def _blame_localisation(credit: np.ndarray, good: np.ndarray, mask: np.ndarray,
                        failed: np.ndarray) -> Metric:
    bad = mask & ~good
    # A one-step trajectory's only step is trivially its lowest: nothing to localise.
    keep = failed & (bad.sum(axis=1) == 1) & (mask.sum(axis=1) >= 2)
    n = int(keep.sum())
    if n == 0:
        return Metric(float("nan"), n)
    credit, mask = credit[keep], mask[keep]
    blamed = credit[np.arange(n), bad[keep].argmax(axis=1)]
    lowest = np.where(mask, credit, np.inf).min(axis=1)
    ties = (mask & (credit == lowest[:, None])).sum(axis=1)
    return Metric(float(np.mean((blamed == lowest) / ties)), n)


def _collateral_blame(credit: np.ndarray, good: np.ndarray, mask: np.ndarray,
                      failed: np.ndarray) -> Metric:
    keep = mask & good & failed[:, None]
    n = int(keep.sum())
    if n == 0:
        return Metric(float("nan"), n)
    return Metric(float((credit[keep] < 0).mean()), n)


# Public metrics. ----------------------------------------------------------------


def auc(credit, good, mask) -> Metric:
    """Area under the ROC curve of the step credit for telling good steps from bad ones.

    AUC = P(c_g > c_b) + 1/2 P(c_g = c_b) for a random good step g and a random
    bad step b among the real steps, i.e. the Mann-Whitney statistic

        AUC = (R_good - n_good (n_good + 1) / 2) / (n_good n_bad),

    with R_good the sum of the good steps' average ranks (ties share the mean
    rank, so each tied pair counts 1/2) in the credit of all real steps; one
    sort, O(n log n). 1 when credit separates good from bad perfectly, 0 when
    reversed, 0.5 for constant or random credit.

    Args:
      credit: `[B, T]` step credit (real numbers; not NaN where `mask` is True).
      good: `[B, T]` bool oracle progress labels (good steps True).
      mask: `[B, T]` bool, True on real steps; False positions are ignored.

    Returns:
      `Metric(value, n)`: the AUC (NaN when the real steps hold no good step
      or no bad step) and n the number of real steps.

    Raises:
      ValueError: a shape or dtype is wrong, or credit is NaN on a real step.

    References:
      Mann and Whitney, "On a test of whether one of two random variables is
      stochastically larger than the other", Ann. Math. Statist. 18 (1947).
      Hanley and McNeil, "The meaning and use of the area under a receiver
      operating characteristic (ROC) curve", Radiology 143 (1982).

    Example: credit [[2, 1, 1, 0]], good [[T, T, F, F]] (all real): the good
    steps beat the bad ones in 1 + 1 + 0.5 + 1 of 4 pairs, AUC 0.875, n 4.
    """
    credit, mask = _credit_and_mask("auc", credit, mask)
    good = _bools("auc", "good", good, credit.shape, "[B, T] like credit")
    return _auc(credit, good, mask)


def spearman(credit, truth, mask) -> Metric:
    """Spearman rank correlation between the step credit and the true advantage.

    rho = Pearson(rank(c), rank(A)) over the real steps where A is finite, with
    average ranks for ties (so it equals `scipy.stats.spearmanr`); without ties
    rho = 1 - 6 sum_i d_i^2 / (n (n^2 - 1)), d_i the difference of ranks.

    Args:
      credit: `[B, T]` step credit (not NaN where `mask` is True).
      truth: `[B, T]` true advantage; NaN or infinite entries are left out.
      mask: `[B, T]` bool, True on real steps; False positions are ignored.

    Returns:
      `Metric(value, n)`: rho (NaN when fewer than 2 steps count or either
      input is constant over them) and n the number of steps counted.

    Raises:
      ValueError: a shape or dtype is wrong, or credit is NaN on a real step.

    References:
      Spearman, "The proof and measurement of association between two things",
      Amer. J. Psychol. 15 (1904).

    Example: credit [[1, 2, 3]], truth [[0.1, 0.3, 0.2]]: ranks (1, 2, 3) and
    (1, 3, 2), sum d^2 = 2, rho = 1 - 12 / 24 = 0.5, n 3.
    """
    credit, mask = _credit_and_mask("spearman", credit, mask)
    truth = _steps("spearman", "truth", truth, credit.shape)
    return _spearman(credit, truth, mask)


def sign_agreement(credit, truth, truth_se, mask, *, z: float = 1.96) -> Metric:
    """Share of clearly signed steps whose credit has the sign of the true advantage.

    A real step qualifies when its truth is significantly nonzero,
    |A_t| > z se_t (A_t and se_t finite); the metric is the share of qualifying
    steps with sign(c_t) = sign(A_t). Credit exactly 0 never agrees.

    Args:
      credit: `[B, T]` step credit (not NaN where `mask` is True).
      truth: `[B, T]` true advantage (NaN where unknown).
      truth_se: `[B, T]` its standard error (>= 0, NaN where unknown).
      mask: `[B, T]` bool, True on real steps; False positions are ignored.
      z: keyword, the interval's half-width in standard errors (1.96: 95%).

    Returns:
      `Metric(value, n)`: the share (NaN when no step qualifies) and n the
      number of qualifying steps.

    Raises:
      ValueError: a shape or dtype is wrong, credit is NaN or truth_se negative
        on a real step, or z is not a finite number >= 0.

    Example: credit [[1, -1, 0, 5]], truth [[2, 2, -2, 0.1]], truth_se all 0.5:
    the first three qualify (|0.1| < 0.98), one agrees: 1/3, n 3.
    """
    fn = "sign_agreement"
    credit, mask = _credit_and_mask(fn, credit, mask)
    truth = _steps(fn, "truth", truth, credit.shape)
    truth_se = _standard_error(fn, "truth_se", truth_se, mask)
    return _sign_agreement(credit, truth, truth_se, mask, _check_z(fn, z))


def _failed(fn: str, failed: Any, credit: np.ndarray) -> np.ndarray:
    failed = np.asarray(failed)
    if failed.dtype != np.bool_:
        raise ValueError(f"{fn}: failed has dtype {failed.dtype}; it must be bool")
    if failed.shape != credit.shape[:1]:
        raise ValueError(f"{fn}: credit has shape {credit.shape} but failed has shape "
                         f"{failed.shape}; failed must be [B]")
    return failed


def blame_localisation(credit, good, mask, failed) -> Metric:
    """How often the one bad step of a failed trajectory gets its lowest credit.

    Over the failed trajectories of at least two real steps, exactly one of
    them bad (step b), the expected share in which b has the trajectory's lowest credit when ties
    are broken uniformly at random:

        score_i = [c_b = min_t c_t] / #{t : c_t = min_t c_t},

    i.e. 1 when b alone is lowest, 1/k when it ties with k - 1 other steps, 0
    when another step is strictly lower. Credit broadcast to every step (one
    value per trajectory, as GRPO) scores 1/T_i.

    Args:
      credit: `[B, T]` step credit (not NaN where `mask` is True).
      good: `[B, T]` bool oracle progress labels (bad steps False).
      mask: `[B, T]` bool, True on real steps; False positions are ignored.
      failed: `[B]` bool, True for the trajectories that failed.

    Returns:
      `Metric(value, n)`: the mean score (NaN when no trajectory qualifies) and
      n the number of qualifying trajectories.

    Raises:
      ValueError: a shape or dtype is wrong, or credit is NaN on a real step.

    Example: failed trajectories with good [[T, F, T], [F, T, T]] and credit
    [[0, -1, 0], [0, 0, 0]] score 1 and 1/3: value 2/3, n 2.
    """
    fn = "blame_localisation"
    credit, mask = _credit_and_mask(fn, credit, mask)
    good = _bools(fn, "good", good, credit.shape, "[B, T] like credit")
    return _blame_localisation(credit, good, mask, _failed(fn, failed, credit))


def collateral_blame(credit, good, mask, failed) -> Metric:
    """Share of good steps in failed trajectories that get negative credit.

    #{t good, real, in a failed trajectory : c_t < 0} / #{t good, real, in a
    failed trajectory}. An estimator that broadcasts a failed trajectory's
    negative return to every step (GRPO) scores 1; credit 0 is not blame.

    Args:
      credit: `[B, T]` step credit (not NaN where `mask` is True).
      good: `[B, T]` bool oracle progress labels.
      mask: `[B, T]` bool, True on real steps; False positions are ignored.
      failed: `[B]` bool, True for the trajectories that failed.

    Returns:
      `Metric(value, n)`: the share (NaN when no good step lies in a failed
      trajectory) and n the number of such steps.

    Raises:
      ValueError: a shape or dtype is wrong, or credit is NaN on a real step.

    Example: a failed trajectory with good [[T, T, F]] and credit
    [[-1, 0, -1]]: one of two good steps is blamed, 0.5, n 2.
    """
    fn = "collateral_blame"
    credit, mask = _credit_and_mask(fn, credit, mask)
    good = _bools(fn, "good", good, credit.shape, "[B, T] like credit")
    return _collateral_blame(credit, good, mask, _failed(fn, failed, credit))


def evaluate(credit, mask, *, good, advantage, advantage_se, failed,
             z: float = 1.96) -> dict[str, Metric]:
    """All the metrics of a diagnosis (`result.METRICS`) for one estimator's credit.

    Checks the inputs once, then computes `auc(credit, good, mask)`,
    `spearman(credit, advantage, mask)`, `sign_agreement(credit, advantage,
    advantage_se, mask, z=z)`, `blame_localisation(credit, good, mask, failed)`
    and `collateral_blame(credit, good, mask, failed)`.

    Args:
      credit: `[B, T]` step credit (not NaN where `mask` is True).
      mask: `[B, T]` bool, True on real steps.
      good: `[B, T]` bool oracle progress labels.
      advantage: `[B, T]` Monte Carlo A^pi (NaN where not estimated).
      advantage_se: `[B, T]` its standard error.
      failed: `[B]` bool, True for failed trajectories.
      z: the half-width in standard errors for `sign_agreement`.

    Returns:
      metric name -> `Metric(value, n)`, in the order of `METRICS`.

    Raises:
      ValueError: as the metrics do, naming the argument.
    """
    fn = "evaluate"
    credit, mask = _credit_and_mask(fn, credit, mask)
    good = _bools(fn, "good", good, credit.shape, "[B, T] like credit")
    advantage = _steps(fn, "advantage", advantage, credit.shape)
    advantage_se = _standard_error(fn, "advantage_se", advantage_se, mask)
    failed = _failed(fn, failed, credit)
    z = _check_z(fn, z)
    values = {
        "auc": _auc(credit, good, mask),
        "spearman": _spearman(credit, advantage, mask),
        "sign_agreement": _sign_agreement(credit, advantage, advantage_se, mask, z),
        "blame_localisation": _blame_localisation(credit, good, mask, failed),
        "collateral_blame": _collateral_blame(credit, good, mask, failed),
    }
    return {name: values[name] for name in METRICS}


# Confidence intervals. ----------------------------------------------------------


def bootstrap_interval(statistic: Callable[[np.ndarray], Any], clusters, *,
                       num_resamples: int = 200, level: float = 0.95,
                       seed: int = 0) -> tuple[Any, Any]:
    """Percentile bootstrap interval of `statistic`, resampling whole clusters.

    The C distinct ids in `clusters` (one per (seed, task) group of
    trajectories) are the units: each resample draws C clusters uniformly with
    replacement and calls `statistic(rows)` with the row indices of their
    trajectories (a cluster drawn twice gives its rows twice). The interval is
    the (1 - level)/2 and (1 + level)/2 percentiles (linear interpolation) of
    the resampled values; resamples where the statistic is NaN are dropped,
    and the interval is NaN when fewer than half of them remain.

    `statistic` may return a float or a `[K]` array (several metrics from one
    resample, e.g. the values of `evaluate`); each entry then gets its own
    interval and its own NaN count.

    Args:
      statistic: `rows` `[B']` int64 -> float or `[K]` floats.
      clusters: `[B]` integer cluster id of each trajectory (any values).
      num_resamples: how many resamples to draw (>= 1).
      level: the interval's coverage, in (0, 1).
      seed: seed of the NumPy generator that draws the resamples.

    Returns:
      `(low, high)`: floats, or `[K]` float64 arrays when `statistic` returns `[K]`.

    Raises:
      ValueError: clusters is not a non-empty `[B]` integer array, num_resamples
        or level is out of range, or statistic returns something that is not a
        scalar or a `[K]` array of one fixed shape.

    References:
      Efron and Tibshirani, "An Introduction to the Bootstrap" (1993), ch. 13
      (percentile intervals). Field and Welsh, "Bootstrapping clustered data",
      J. R. Statist. Soc. B 69 (2007) (resampling whole clusters).

    Example: `bootstrap_interval(lambda rows: auc(credit[rows], good[rows],
    mask[rows]).value, stacked.group_ids)`.
    """
    fn = "bootstrap_interval"
    clusters = np.asarray(clusters)
    if clusters.dtype == np.bool_ or not np.issubdtype(clusters.dtype, np.integer):
        raise ValueError(f"{fn}: clusters has dtype {clusters.dtype}; it must be integer ids")
    if clusters.ndim != 1 or clusters.size == 0:
        raise ValueError(f"{fn}: clusters has shape {clusters.shape}; it must be [B] with B >= 1")
    if isinstance(num_resamples, bool) or not isinstance(num_resamples, (int, np.integer)) \
            or num_resamples < 1:
        raise ValueError(f"{fn}: num_resamples={num_resamples!r}; it must be an int >= 1")
    if not 0.0 < level < 1.0:
        raise ValueError(f"{fn}: level={level!r}; it must lie in (0, 1)")

    _, cluster_of_row = np.unique(clusters, return_inverse=True)
    rows_by_cluster = np.argsort(cluster_of_row, kind="stable")
    sizes = np.bincount(cluster_of_row)
    starts = np.cumsum(sizes) - sizes
    num_clusters = sizes.size
    draws = np.random.default_rng(seed).integers(0, num_clusters, size=(num_resamples, num_clusters))

    values = []
    for drawn in draws:
        lengths = sizes[drawn]
        # Position of each resampled row in rows_by_cluster: its cluster's start plus
        # its index within the cluster.
        within = np.arange(lengths.sum()) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        rows = rows_by_cluster[np.repeat(starts[drawn], lengths) + within]
        value = np.asarray(statistic(rows), dtype=np.float64)
        if value.ndim > 1 or (values and value.shape != values[0].shape):
            raise ValueError(f"{fn}: statistic returned shape {value.shape}; it must return a "
                             f"float or a [K] array, the same shape on every resample")
        values.append(value)
    values = np.stack(values)
    columns = values.reshape(num_resamples, -1)
    enough = 2 * (~np.isnan(columns)).sum(axis=0) >= num_resamples
    tail = 50.0 * (1.0 - level)
    low = np.full(columns.shape[1], np.nan)
    high = np.full(columns.shape[1], np.nan)
    if enough.any():
        low[enough], high[enough] = np.nanpercentile(columns[:, enough], [tail, 100.0 - tail], axis=0)
    if values.ndim == 1:
        return float(low[0]), float(high[0])
    return low, high
