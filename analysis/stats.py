"""Tests and intervals for comparing methods over seeds: paired and Welch t, TOST equivalence, Holm's correction,
the minimum detectable difference, a cluster bootstrap over warm starts, and the critical point of a stability axis.

Inputs are per-run values (one number per seed: a run's final held-out reward, its held-out change, its median
KL); outputs are plain numbers or small frozen dataclasses. Conventions (those of moe_rl.analysis.aggregate): non-finite
values are left out (for paired tests, the pair is), fewer than 2 values give NaN, and no test claims more than
its data hold (a zero spread gives p = 0 or 1, never an error).

    paired_t(a, b)                   Difference of means a - b, pairs = same seed; t CI and two-sided p
    paired_bootstrap_ci(a, b)        percentile bootstrap CI of the mean paired difference
    welch(a, b)                      Welch two-sample t (unequal variances, Welch-Satterthwaite df)
    tost_paired(a, b, margin)        equivalence: p of "|mean difference| >= margin" (small p: equivalent)
    tost_welch(a, b, margin)         the same, unpaired
    holm(p_values)                   Holm-Bonferroni adjusted p-values across a table's pairs
    mdd_paired(n, sd_diff)           smallest true paired difference found with the given power
    cluster_bootstrap(frame, ...)    resample clusters (warm starts), then runs within them
    cluster_bootstrap_ci(frame, ...) its percentile CI of a column's mean
    critical_point(frame, ...)       axis value where the mean change over seeds crosses 0, with a CI over seeds

Why t and not the bootstrap for the main intervals: with the 3-5 seeds a CPU study affords, a percentile
bootstrap cannot leave the range of the values and covers far less than its nominal level (docs/analysis.md,
"Means and intervals"). `paired_bootstrap_ci` and the bootstrap of `critical_point` are there for larger samples
and for statistics with no t interval; with few seeds read them as optimistic.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pandas as pd
from scipy import integrate, optimize, special, stats

from moe_rl.analysis.aggregate import BOOTSTRAP_SEED, CONFIDENCE, N_RESAMPLES, bootstrap_ci

ALPHA = 0.05
POWER = 0.8


@dataclass(frozen=True)
class Difference:
    """A difference of means a - b: its standard error, degrees of freedom, CI and two-sided p-value."""

    mean_diff: float
    se: float
    df: float
    ci_low: float
    ci_high: float
    p: float
    n_a: int
    """Values of a used (pairs, for a paired test)."""
    n_b: int



def _finite(values) -> np.ndarray:
    x = np.asarray(values, dtype=float)
    return x[np.isfinite(x)]


def paired_differences(a, b) -> np.ndarray:
    """a - b over the pairs where both are finite (a[i] and b[i] are one seed's values)."""
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if a.shape != b.shape:
        raise ValueError(f"paired values need equal lengths, got {a.shape} and {b.shape}")
    keep = np.isfinite(a) & np.isfinite(b)
    return a[keep] - b[keep]


def t_difference(mean_diff: float, se: float, df: float, n_a: int, n_b: int,
                 confidence: float = CONFIDENCE) -> Difference:
    """The t interval and two-sided p of `mean_diff` with standard error `se` on `df` degrees of freedom. A zero
    `se` (no spread) gives a zero-width interval and p = 0 (a nonzero difference) or 1 (none)."""
    if not (math.isfinite(se) and math.isfinite(df) and df > 0):
        return Difference(mean_diff, se, df, math.nan, math.nan, math.nan, n_a, n_b)
    if se == 0:
        return Difference(mean_diff, 0.0, df, mean_diff, mean_diff, float(mean_diff == 0), n_a, n_b)
    half = special.stdtrit(df, (1 + confidence) / 2) * se  # stdtrit, stdtr: the t quantile and cdf (fast ufuncs)
    p = 2 * special.stdtr(df, -abs(mean_diff) / se)
    return Difference(mean_diff, se, df, mean_diff - half, mean_diff + half, float(p), n_a, n_b)


def paired_t(a, b, confidence: float = CONFIDENCE) -> Difference:
    """Paired t-test of mean(a - b) = 0 over seeds: d = a - b per pair, se = sd(d) / sqrt(n), df = n - 1."""
    d = paired_differences(a, b)
    if len(d) < 2:
        return Difference(float(d.mean()) if len(d) else math.nan, *(math.nan,) * 5, len(d), len(d))
    return t_difference(float(d.mean()), float(d.std(ddof=1) / math.sqrt(len(d))), len(d) - 1, len(d), len(d),
                        confidence)


def paired_bootstrap_ci(a, b, confidence: float = CONFIDENCE, n_resamples: int = N_RESAMPLES,
                        seed: int = BOOTSTRAP_SEED) -> tuple[float, float]:
    """Percentile bootstrap CI of the mean paired difference: pairs (seeds) are resampled, never split."""
    return bootstrap_ci(paired_differences(a, b), confidence=confidence, n_resamples=n_resamples, seed=seed)


def welch_from_stats(mean_a: float, sd_a: float, n_a: int, mean_b: float, sd_b: float, n_b: int,
                     confidence: float = CONFIDENCE) -> Difference:
    """Welch's t for mean_a - mean_b from summary statistics: se^2 = sd_a^2/n_a + sd_b^2/n_b, and the
    Welch-Satterthwaite df = se^4 / ((sd_a^2/n_a)^2/(n_a-1) + (sd_b^2/n_b)^2/(n_b-1))."""
    if n_a < 2 or n_b < 2:
        return Difference(mean_a - mean_b, *(math.nan,) * 5, n_a, n_b)
    va, vb = sd_a ** 2 / n_a, sd_b ** 2 / n_b
    se = math.sqrt(va + vb)
    df = (va + vb) ** 2 / (va ** 2 / (n_a - 1) + vb ** 2 / (n_b - 1)) if se > 0 else float(n_a + n_b - 2)
    return t_difference(mean_a - mean_b, se, df, n_a, n_b, confidence)


def welch(a, b, confidence: float = CONFIDENCE) -> Difference:
    """Welch two-sample t-test of mean(a) = mean(b) (independent samples, variances not assumed equal)."""
    a, b = _finite(a), _finite(b)
    if len(a) < 2 or len(b) < 2:
        return Difference(float(a.mean() - b.mean()) if len(a) and len(b) else math.nan, *(math.nan,) * 5,
                          len(a), len(b))
    return welch_from_stats(float(a.mean()), float(a.std(ddof=1)), len(a), float(b.mean()), float(b.std(ddof=1)),
                            len(b), confidence)


# ---------------------------------------------------------------------------------------------------------------------
# Equivalence (TOST)


def tost_p(diff: Difference, margin: float) -> float:
    """Two one-sided tests of H0: |true difference| >= margin. p = max(P(T >= (d + margin)/se),
    P(T <= (d - margin)/se)), T ~ t(df): the larger of the two one-sided p-values. p < alpha means the
    difference lies within +-margin at level alpha, which is the same as the (1 - 2 alpha) CI lying inside
    (-margin, margin)."""
    if margin <= 0:
        raise ValueError(f"margin must be > 0, got {margin}")
    d, se, df = diff.mean_diff, diff.se, diff.df
    if not (math.isfinite(d) and math.isfinite(se) and math.isfinite(df)):
        return math.nan
    if se == 0:
        return 0.0 if abs(d) < margin else 1.0
    return float(max(stats.t.sf((d + margin) / se, df), stats.t.cdf((d - margin) / se, df)))


def tost_paired(a, b, margin: float) -> float:
    """TOST p-value for paired values (same seed = pair) at the equivalence margin +-`margin`."""
    return tost_p(paired_t(a, b), margin)


def tost_welch(a, b, margin: float) -> float:
    """TOST p-value for two independent samples (Welch's se and df) at the margin +-`margin`."""
    return tost_p(welch(a, b), margin)


# ---------------------------------------------------------------------------------------------------------------------
# Multiple comparisons, power


def holm(p_values) -> np.ndarray:
    """Holm-Bonferroni adjusted p-values, in the input order. With the m finite p-values sorted ascending,
    p_adj(i) = max over j <= i of min(1, (m - j + 1) p(j)); rejecting where p_adj < alpha controls the
    family-wise error rate at alpha. NaN entries stay NaN and do not count in m."""
    p = np.asarray(p_values, dtype=float)
    adjusted = np.full(p.shape, np.nan)
    finite = np.flatnonzero(np.isfinite(p))
    if not len(finite):
        return adjusted
    order = finite[np.argsort(p[finite], kind="stable")]
    m = len(order)
    steps = np.minimum(1.0, (m - np.arange(m)) * p[order])
    adjusted[order] = np.maximum.accumulate(steps)
    return adjusted


def power_paired(delta: float, sd_diff: float, n: int, alpha: float = ALPHA) -> float:
    """Power of the two-sided paired t-test at level alpha when the true mean difference is `delta`: with
    t_c = t(1 - alpha/2, n - 1) and T' ~ noncentral t(n - 1, delta sqrt(n) / sd_diff), P(T' > t_c) + P(T' < -t_c)."""
    df, tc = n - 1, stats.t.ppf(1 - alpha / 2, n - 1)
    nc = delta * math.sqrt(n) / sd_diff
    power = stats.nct.sf(tc, df, nc) + stats.nct.cdf(-tc, df, nc)
    return float(power) if math.isfinite(power) else _noncentral_t_power(tc, df, nc)


def _noncentral_t_power(tc: float, df: int, nc: float) -> float:
    """P(|T'| > tc) for T' = (Z + nc) / sqrt(V / df), V ~ chi^2(df), by integrating over V: scipy's noncentral t
    returns NaN at one degree of freedom and a large noncentrality (a 2-seed design far from its MDD)."""
    def tail(v: float) -> float:
        scale = tc * math.sqrt(v / df)
        return stats.chi2.pdf(v, df) * (stats.norm.sf(scale - nc) + stats.norm.cdf(-scale - nc))

    return float(integrate.quad(tail, 0.0, math.inf, limit=200)[0])


def mdd_paired(n: int, sd_diff: float, alpha: float = ALPHA, power: float = POWER, exact: bool = True) -> float:
    """Minimum detectable difference of a paired design with n pairs whose differences have sd `sd_diff`: the
    true mean difference that the two-sided paired t-test at level alpha finds with probability `power`.

    exact (default): the root of power_paired(delta) = power (noncentral t). exact=False: the normal
    approximation (z(1 - alpha/2) + z(power)) sd_diff / sqrt(n), which ignores that sd_diff is estimated and is
    too small at few seeds (n = 3: 1.62 sd against the exact 3.26 sd; n = 5: 1.25 against 1.68)."""
    if n < 2 or not math.isfinite(sd_diff):
        return math.nan
    normal = (stats.norm.ppf(1 - alpha / 2) + stats.norm.ppf(power)) * sd_diff / math.sqrt(n)
    if not exact or sd_diff == 0:
        return float(normal)
    # The power depends on delta / sd_diff only, so the root is found in units of sd_diff: an sd of 1e-17 (methods
    # that agree to rounding) would otherwise put the noncentral t where scipy returns NaN.
    return float(sd_diff * _mdd_in_sds(n, alpha, power))


@functools.cache
def _mdd_in_sds(n: int, alpha: float, power: float) -> float:
    upper = (stats.norm.ppf(1 - alpha / 2) + stats.norm.ppf(power)) / math.sqrt(n)
    while power_paired(upper, 1.0, n, alpha) < power:
        upper *= 2
    return float(optimize.brentq(lambda d: power_paired(d, 1.0, n, alpha) - power, 0.0, upper, xtol=1e-12 * upper))


# ---------------------------------------------------------------------------------------------------------------------
# Cluster bootstrap


def cluster_resamples(clusters, n_resamples: int = N_RESAMPLES, seed: int = BOOTSTRAP_SEED, strata=None):
    """Row indices of two-stage bootstrap resamples: draw the clusters (warm starts) with replacement, then,
    within each drawn cluster, its rows (runs) with replacement. Yields n_resamples index arrays.

    `strata` (one label per row, e.g. the architecture): draw the clusters within each stratum, as many as it has.
    A designed factor (the architectures a sweep chose) is then in every resample as often as in the data, and only
    the random one (which warm start each architecture got) varies; drawn across strata instead, a resample can
    leave an architecture out or count it twice."""
    rng = np.random.default_rng(seed)
    labels = np.asarray(clusters)
    strata = np.zeros(len(labels), dtype=int) if strata is None else np.asarray(strata)
    groups = []  # per stratum: its clusters' row indices
    for stratum in pd.unique(strata):
        rows = strata == stratum
        groups.append([np.flatnonzero(rows & (labels == c)) for c in pd.unique(labels[rows])])
    for _ in range(n_resamples):
        picked = []
        for members in groups:
            for c in rng.integers(len(members), size=len(members)):
                picked.append(members[c][rng.integers(len(members[c]), size=len(members[c]))])
        yield np.concatenate(picked)


def cluster_bootstrap(frame: pd.DataFrame, cluster: str, statistic: Callable[[pd.DataFrame], float],
                      n_resamples: int = N_RESAMPLES, seed: int = BOOTSTRAP_SEED) -> np.ndarray:
    """`statistic` over the two-stage resamples of `frame` (`cluster_resamples` of its `cluster` column). Runs
    that share a warm start are not independent; resampling them as if they were leaves the warm-start factor
    out of every interval. Returns the n_resamples values (their percentiles are a CI)."""
    return np.array([statistic(frame.iloc[rows]) for rows in cluster_resamples(frame[cluster], n_resamples, seed)])


def cluster_bootstrap_ci(frame: pd.DataFrame, cluster: str, value: str, confidence: float = CONFIDENCE,
                         n_resamples: int = N_RESAMPLES, seed: int = BOOTSTRAP_SEED) -> tuple[float, float]:
    """Percentile CI of the mean of column `value` under the cluster bootstrap (NaN with fewer than 2 clusters)."""
    x = frame[value].to_numpy(dtype=float)
    keep = np.isfinite(x)
    x, clusters = x[keep], frame[cluster].to_numpy()[keep]
    if len(pd.unique(clusters)) < 2:
        return math.nan, math.nan
    means = np.array([x[rows].mean() for rows in cluster_resamples(clusters, n_resamples, seed)])
    low, high = np.quantile(means, [(1 - confidence) / 2, (1 + confidence) / 2])
    return float(low), float(high)


# ---------------------------------------------------------------------------------------------------------------------
# Critical point of a stability axis


@dataclass(frozen=True)
class CriticalPoint:
    """Where the mean change over seeds turns negative along an ordered axis (learning rate, staleness).

    value: -inf when the mean is already negative at the first grid point, +inf when it never turns negative
    on the grid; a CI bound is -inf / +inf where the data allow a crossing beyond that end of the grid."""

    value: float
    ci_low: float
    ci_high: float
    n_seeds: int
    below_grid: float
    """Share of bootstrap resamples whose mean is negative already at the first grid point (NaN for method t)."""
    above_grid: float
    """Share of bootstrap resamples whose mean never turns negative on the grid (NaN for method t)."""


def zero_crossing(axis, mean, log_axis: bool = True) -> float:
    """The first axis value where `mean` (ordered by increasing axis) goes from >= 0 to < 0, interpolated
    linearly in log(axis) (or in axis) between the two bracketing grid points. NaN means are skipped;
    -inf if the first is already < 0, +inf if none is."""
    axis, mean = np.asarray(axis, dtype=float), np.asarray(mean, dtype=float)
    keep = np.isfinite(mean)
    x = np.log(axis[keep]) if log_axis else axis[keep]
    y = mean[keep]
    negative = np.flatnonzero(y < 0)
    if not len(y) or not len(negative):
        return math.inf
    i = negative[0]
    if i == 0:
        return -math.inf
    cross = x[i - 1] + y[i - 1] / (y[i - 1] - y[i]) * (x[i] - x[i - 1])
    return float(math.exp(cross) if log_axis else cross)


def critical_point(frame: pd.DataFrame, axis: str, value: str, seed: str = "seed", log_axis: bool = True,
                   method: str = "t", confidence: float = CONFIDENCE, n_resamples: int = N_RESAMPLES,
                   rng_seed: int = BOOTSTRAP_SEED) -> CriticalPoint:
    """The axis value where the mean over seeds of `value` (e.g. held-out change per run) crosses zero
    (`zero_crossing` of the per-axis means), with a CI over seeds.

    method "t" (default): the axis values where the t CI of the mean (each seed's curve interpolated like the
    mean) contains 0, i.e. where a t-test would not reject "change = 0" (a test-inversion interval; a bound
    at the grid's edge reads -inf / +inf: the data cannot exclude a crossing beyond the grid). method
    "bootstrap": percentile bootstrap over seeds; a resample draws whole seeds, each with its values at every
    axis point. Measured coverage of a nominal 95% interval (a log-linear truth, 4 grid points, noise 0.05 per
    point and 0.03 per seed, 200 datasets): t 0.94 / 0.93 / 0.92 at 3 / 5 / 8 seeds, bootstrap 0.70 / 0.82 /
    0.87. Use the bootstrap only with many seeds.

    `frame` has one row per (seed, axis value); several rows of one seed at one axis value are averaged."""
    table = frame.pivot_table(index=seed, columns=axis, values=value, aggfunc="mean").sort_index(axis=1)
    grid, values = table.columns.to_numpy(dtype=float), table.to_numpy(dtype=float)  # (S seeds, A axis points)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # an axis point no seed reached: its mean is NaN
        point = zero_crossing(grid, np.nanmean(values, axis=0), log_axis)
    if method == "t":
        low, high = _inverted_t_ci(grid, values, log_axis, confidence)
        return CriticalPoint(point, low, high, len(values), math.nan, math.nan)
    if method != "bootstrap":
        raise ValueError(f"method must be 't' or 'bootstrap', got {method!r}")
    draws = np.random.default_rng(rng_seed).integers(len(values), size=(n_resamples, len(values)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        means = np.nanmean(values[draws], axis=1)  # (R, A)
    crossings = np.array([zero_crossing(grid, m, log_axis) for m in means])
    if len(values) < 2:
        low = high = math.nan
    else:
        low, high = np.quantile(crossings, [(1 - confidence) / 2, (1 + confidence) / 2], method="inverted_cdf")
    return CriticalPoint(point, float(low), float(high), len(values), float(np.mean(crossings == -math.inf)),
                         float(np.mean(crossings == math.inf)))


def _inverted_t_ci(grid: np.ndarray, values: np.ndarray, log_axis: bool, confidence: float,
                   n_points: int = 801) -> tuple[float, float]:
    """Hull of the axis values (on a fine grid between the first and last grid point) where the t CI of the
    mean contains 0. Between two adjacent grid points the mean and its CI come from the seeds that have both
    points (each seed's curve interpolated linearly there), so that a seed missing a cell far from the crossing
    still counts near it; a stretch that fewer than 2 seeds cover cannot exclude 0 and counts as inside. With
    every seed complete this is the interval of the seeds' interpolated curves. Empty: the crossing itself where
    the seeds agree exactly, else beyond the grid on the side the mean points to."""
    x = np.log(grid) if log_axis else grid
    fine = np.linspace(x[0], x[-1], n_points)
    stretch = np.clip(np.searchsorted(x, fine, side="right") - 1, 0, len(x) - 2)  # (n_points,) its left grid point
    inside, known = np.zeros(n_points, dtype=bool), False
    for i in range(len(x) - 1):
        at = stretch == i
        ends_S2 = values[:, i : i + 2]
        ends_S2 = ends_S2[np.isfinite(ends_S2).all(axis=1)]  # the seeds that have both ends
        if len(ends_S2) < 2:
            inside[at] = True
            continue
        known = True
        w = (fine[at] - x[i]) / (x[i + 1] - x[i])
        curves = ends_S2[:, :1] * (1 - w) + ends_S2[:, 1:] * w  # (S, points of this stretch)
        mean, se = curves.mean(axis=0), curves.std(axis=0, ddof=1) / math.sqrt(len(curves))
        inside[at] = np.abs(mean) <= stats.t.ppf((1 + confidence) / 2, len(curves) - 1) * se
    if not known:
        return math.nan, math.nan
    hits = np.flatnonzero(inside)
    if not len(hits):  # no spread, or a mean whose CI excludes 0 everywhere on the grid
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            point = zero_crossing(grid, np.nanmean(values, axis=0), log_axis)
        if math.isfinite(point):
            return point, point
        return (float(grid[-1]), math.inf) if point > 0 else (-math.inf, float(grid[0]))
    to_axis = np.exp if log_axis else (lambda v: v)
    low = -math.inf if hits[0] == 0 or not _excludes_zero(values[:, 0], confidence, above=True) \
        else float(to_axis(fine[hits[0]]))
    high = math.inf if hits[-1] == n_points - 1 or not _excludes_zero(values[:, -1], confidence, above=False) \
        else float(to_axis(fine[hits[-1]]))
    return low, high


def _excludes_zero(values_S: np.ndarray, confidence: float, above: bool) -> bool:
    """Whether the t CI of the mean of one grid point's seeds lies wholly above 0 (`above`) or wholly below it.
    A crossing beyond the grid's top is excluded only where the change at the top is surely negative already,
    and one below its bottom only where the change at the bottom is surely positive: a change surely positive at
    the top may still turn negative further up, however the stretches inside the grid read."""
    values_S = values_S[np.isfinite(values_S)]
    if len(values_S) < 2:
        return False
    half = stats.t.ppf((1 + confidence) / 2, len(values_S) - 1) * values_S.std(ddof=1) / math.sqrt(len(values_S))
    mean = values_S.mean()
    return mean - half > 0 if above else mean + half < 0
