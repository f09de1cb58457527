"""analysis/stats.py against textbook values: scipy's t-tests, hand-worked Holm and TOST examples, published power
of the paired t-test (G*Power), the cluster bootstrap's spread under a two-level model, and the critical point of
a stability axis on a known log-linear law."""

import math

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from moe_rl.analysis.stats import (
    cluster_bootstrap,
    cluster_bootstrap_ci,
    cluster_resamples,
    critical_point,
    holm,
    mdd_paired,
    paired_bootstrap_ci,
    paired_t,
    power_paired,
    tost_p,
    tost_paired,
    tost_welch,
    welch,
    welch_from_stats,
    zero_crossing,
)

A = np.array([0.62, 0.55, 0.71, 0.60, 0.66])
B = np.array([0.58, 0.54, 0.63, 0.61, 0.57])


# --- t-tests -----------------------------------------------------------------------------------------------


def test_paired_t_equals_scipy_ttest_rel_and_the_hand_formula():
    result, reference = paired_t(A, B), stats.ttest_rel(A, B)
    d = A - B  # 0.04, 0.01, 0.08, -0.01, 0.09: mean 0.042, sd 0.04324
    assert result.mean_diff == pytest.approx(0.042) and result.df == 4
    assert result.se == pytest.approx(np.std(d, ddof=1) / math.sqrt(5))
    assert result.p == pytest.approx(reference.pvalue, rel=1e-10)
    ci = reference.confidence_interval(0.95)
    assert (result.ci_low, result.ci_high) == pytest.approx((ci.low, ci.high), rel=1e-10)
    half_width = 2.776445 * result.se
    assert (result.ci_low, result.ci_high) == pytest.approx((0.042 - half_width, 0.042 + half_width))


def test_paired_t_drops_incomplete_pairs_and_handles_no_spread():
    a, b = np.append(A, np.nan), np.append(B, 0.5)
    assert paired_t(a, b).p == paired_t(A, B).p and paired_t(a, b).n_a == 5
    same = paired_t(A, A)
    assert same.p == 1.0 and same.ci_low == same.ci_high == 0.0
    shifted = paired_t(A + 0.1, A)  # every pair differs by exactly 0.1
    assert shifted.p == 0.0 and shifted.ci_low == pytest.approx(0.1)
    assert math.isnan(paired_t([0.5], [0.4]).p)
    with pytest.raises(ValueError, match="equal lengths"):
        paired_t(A, B[:3])


def test_paired_bootstrap_resamples_pairs_and_is_reproducible():
    low, high = paired_bootstrap_ci(A, B, n_resamples=500)
    assert low < 0.042 < high and (low, high) == paired_bootstrap_ci(A, B, n_resamples=500)
    assert min(A - B) <= low and high <= max(A - B)  # a percentile bootstrap cannot leave the values' range


def test_welch_equals_scipy_and_the_satterthwaite_df():
    a, b = np.array([0.30, 0.35, 0.28, 0.40]), np.array([0.20, 0.45, 0.10, 0.33, 0.25, 0.15])
    result, reference = welch(a, b), stats.ttest_ind(a, b, equal_var=False)
    assert result.p == pytest.approx(reference.pvalue, rel=1e-10)
    assert result.df == pytest.approx(reference.df, rel=1e-10)
    ci = reference.confidence_interval(0.95)
    assert (result.ci_low, result.ci_high) == pytest.approx((ci.low, ci.high), rel=1e-10)
    va, vb = np.var(a, ddof=1) / 4, np.var(b, ddof=1) / 6
    assert result.df == pytest.approx((va + vb) ** 2 / (va ** 2 / 3 + vb ** 2 / 5))
    from_stats = welch_from_stats(a.mean(), a.std(ddof=1), 4, b.mean(), b.std(ddof=1), 6)
    assert from_stats == result
    assert math.isnan(welch([0.3], b).p)


# --- equivalence ---------------------------------------------------------------------------------------------


def test_tost_is_the_larger_of_two_one_sided_t_tests():
    margin = 0.05
    lower = stats.ttest_1samp(A - B, -margin, alternative="greater").pvalue
    upper = stats.ttest_1samp(A - B, margin, alternative="less").pvalue
    assert tost_paired(A, B, margin) == pytest.approx(max(lower, upper), rel=1e-10)
    # Welch: the same two one-sided tests with Welch's se and df (scipy: shift one sample by the margin).
    a, b = A, B + 0.01
    lower = stats.ttest_ind(a + margin, b, equal_var=False, alternative="greater").pvalue
    upper = stats.ttest_ind(a - margin, b, equal_var=False, alternative="less").pvalue
    assert tost_welch(a, b, margin) == pytest.approx(max(lower, upper), rel=1e-10)


def test_tost_known_p_and_its_duality_with_the_90pct_interval():
    # Differences -k, 0, k, 0, 0: mean 0, se = k sqrt(0.5) / sqrt(5). At margin = t(0.95, 4) se both one-sided
    # statistics are +-t(0.95, 4), so p = 0.05 exactly; TOST at alpha 0.05 rejects iff the 90% CI lies inside
    # (-margin, margin).
    k = 0.02
    d = np.array([-k, 0, k, 0, 0])
    se = k * math.sqrt(0.5) / math.sqrt(5)
    t95 = 2.131847  # t(0.95, 4)
    assert tost_paired(d, np.zeros(5), t95 * se) == pytest.approx(0.05, abs=1e-6)
    assert tost_paired(d, np.zeros(5), 2 * t95 * se) < 0.05 < tost_paired(d, np.zeros(5), 0.9 * t95 * se)
    ci90 = paired_t(A, B, confidence=0.90)
    for margin in (0.06, 0.07, 0.08, 0.1):
        inside = -margin < ci90.ci_low and ci90.ci_high < margin
        assert (tost_paired(A, B, margin) < 0.05) == inside, margin
    assert tost_paired(A, A, 0.01) == 0.0  # no spread, difference 0: inside any margin
    with pytest.raises(ValueError, match="margin"):
        tost_p(paired_t(A, B), 0.0)


# --- Holm ----------------------------------------------------------------------------------------------------


def test_holm_hand_worked():
    # Sorted: 0.005 x 4 = 0.02; 0.01 x 3 = 0.03; 0.03 x 2 = 0.06; 0.04 x 1 = 0.04 -> max(0.06, 0.04) = 0.06.
    assert holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    # Capped at 1; NaN stays NaN and does not count in m (m = 3 here).
    assert holm([0.5, np.nan, 0.4, 0.01]) == pytest.approx([0.8, np.nan, 0.8, 0.03], nan_ok=True)
    assert holm([0.02]) == pytest.approx([0.02]) and len(holm([])) == 0
    # Holm is never below the raw p-values, never above Bonferroni.
    p = np.random.default_rng(0).uniform(0, 0.2, size=12)
    adjusted = holm(p)
    assert (adjusted >= p).all() and (adjusted <= np.minimum(1, 12 * p) + 1e-15).all()


# --- power -----------------------------------------------------------------------------------------------------


def test_power_matches_published_values_and_mdd_inverts_it():
    # G*Power, one-sample / paired t, two-tailed, alpha 0.05: d = 0.5, n = 34 -> power 0.807778;
    # d = 1, n = 10 -> 0.8031 (effect sizes in units of the sd of the differences).
    assert power_paired(0.5, 1.0, 34) == pytest.approx(0.807778, abs=1e-6)
    assert power_paired(1.0, 1.0, 10) == pytest.approx(0.8031, abs=1e-4)
    assert power_paired(0.0, 1.0, 10) == pytest.approx(0.05)  # no difference: the test's level
    for n in (3, 5, 10, 34):
        mdd = mdd_paired(n, 0.04)
        assert power_paired(mdd, 0.04, n) == pytest.approx(0.8, abs=1e-9)
        normal = mdd_paired(n, 0.04, exact=False)
        assert normal == pytest.approx((1.959964 + 0.841621) * 0.04 / math.sqrt(n), rel=1e-6)
        assert normal < mdd  # the normal approximation ignores that the sd is estimated
    assert mdd_paired(10, 1.0) < 1.0 < mdd_paired(9, 1.0)  # n = 10 is the smallest n with power >= 0.8 at d = 1
    assert mdd_paired(3, 1.0) == pytest.approx(3.264, abs=1e-3) and math.isnan(mdd_paired(1, 1.0))


# --- cluster bootstrap -----------------------------------------------------------------------------------------


def _two_level(rng, clusters=6, per=3, between=1.0, within=0.2) -> pd.DataFrame:
    effect = rng.normal(0, between, clusters)
    return pd.DataFrame({"warm_start": np.repeat(np.arange(clusters), per),
                         "value": np.repeat(effect, per) + rng.normal(0, within, clusters * per)})


def test_cluster_bootstrap_carries_the_warm_start_variance():
    # Two-level model: the grand mean's sd is sqrt(between^2 / C + within^2 / (C m)) = 0.416 at C 6, m 3.
    # The run-level bootstrap sees 18 "independent" runs and is too narrow; the cluster bootstrap is not.
    rng = np.random.default_rng(0)
    truth = math.sqrt(1.0 / 6 + 0.04 / 18)
    ratios_cluster, ratios_runs = [], []
    for _ in range(20):
        frame = _two_level(rng)
        runs = frame["value"].to_numpy()
        means = [runs[rows].mean() for rows in cluster_resamples(frame["warm_start"], 200, int(rng.integers(99)))]
        naive = runs[rng.integers(18, size=(200, 18))].mean(axis=1)
        ratios_cluster.append(np.std(means) / truth)
        ratios_runs.append(np.std(naive) / truth)
    assert 0.75 < np.mean(ratios_cluster) < 1.15  # the bootstrap's (C-1)/C shrinkage, nearly unbiased
    assert np.mean(ratios_runs) < 0.65


def test_cluster_resamples_keep_runs_inside_their_drawn_clusters():
    frame = pd.DataFrame({"warm_start": ["a", "a", "b", "b", "b", "c"], "value": [1, 1, 10, 10, 10, 100.0]})
    size = frame["warm_start"].value_counts()
    for rows in cluster_resamples(frame["warm_start"], n_resamples=50):
        drawn = frame["warm_start"].iloc[rows].value_counts()
        assert (drawn % size[drawn.index] == 0).all()  # a drawn warm start brings as many runs as it has
        assert drawn.sum() in {3, 4, 5, 6, 7, 8, 9}  # 3 clusters of 1-3 runs
    low, high = cluster_bootstrap_ci(frame, "warm_start", "value", n_resamples=200)
    assert (low, high) == cluster_bootstrap_ci(frame, "warm_start", "value", n_resamples=200)
    assert 1 <= low < high <= 100
    means = cluster_bootstrap(frame, "warm_start", lambda f: f["value"].mean(), n_resamples=200)
    assert (low, high) == tuple(np.quantile(means, [0.025, 0.975]))  # the same draws through the frame API
    assert all(math.isnan(v) for v in cluster_bootstrap_ci(frame.head(2), "warm_start", "value"))


# --- critical point ------------------------------------------------------------------------------------------


def test_zero_crossing_interpolates_in_log_axis():
    # +0.1 at 1e-3, -0.3 at 1e-2: log10 x = -3 + 0.1 / 0.4 = -2.75.
    assert zero_crossing([1e-4, 1e-3, 1e-2], [0.2, 0.1, -0.3]) == pytest.approx(10 ** -2.75)
    assert zero_crossing([1, 2, 4, 8, 16], [0.2, 0.1, -0.1, -0.2, -0.3]) == pytest.approx(2 * math.sqrt(2))
    assert zero_crossing([1, 2, 4], [0.2, 0.1, -0.1], log_axis=False) == pytest.approx(3.0)
    assert zero_crossing([1, 2, 4], [-0.1, 0.1, 0.2]) == -math.inf
    assert zero_crossing([1, 2, 4], [0.3, 0.1, 0.2]) == math.inf
    assert zero_crossing([1, 2, 4, 8], [0.2, np.nan, -0.2, -0.3]) == pytest.approx(2.0)  # 1 and 4 bracket it


def _stability_sweep(rng, seeds: int, noise: float = 0.05, seed_sd: float = 0.03,
                     grid=(1e-4, 1e-3, 1e-2, 1e-1)) -> pd.DataFrame:
    x0 = 10 ** -2.5  # the true critical learning rate: change = -0.2 log10(lr / x0)
    rows = [{"seed": s, "lr": lr, "change": -0.2 * math.log10(lr / x0) + shift + rng.normal(0, noise)}
            for s, shift in enumerate(rng.normal(0, seed_sd, seeds)) for lr in grid]
    return pd.DataFrame(rows)


def test_critical_point_recovers_a_known_law_and_its_interval_covers():
    exact = critical_point(_stability_sweep(np.random.default_rng(0), 3, noise=0.0, seed_sd=0.0), "lr", "change")
    assert exact.value == pytest.approx(10 ** -2.5, rel=1e-12)  # a log-linear law is interpolated exactly
    assert exact.ci_low == exact.ci_high == pytest.approx(10 ** -2.5, rel=0.01)  # no spread: no width
    rng = np.random.default_rng(1)
    t_hits = boot_hits = 0
    for i in range(30):
        sweep = _stability_sweep(rng, 3)
        t_ci, boot = critical_point(sweep, "lr", "change"), critical_point(sweep, "lr", "change", method="bootstrap",
                                                                           n_resamples=200, rng_seed=i)
        assert t_ci.value == boot.value and t_ci.ci_low <= t_ci.value <= t_ci.ci_high
        t_hits += t_ci.ci_low <= 10 ** -2.5 <= t_ci.ci_high
        boot_hits += boot.ci_low <= 10 ** -2.5 <= boot.ci_high
    # 3 seeds: the t inversion covers near its nominal 95%, the percentile bootstrap far less (about 70%).
    assert t_hits >= 26 and boot_hits < t_hits


def test_a_seed_missing_a_far_cell_still_counts_near_the_crossing():
    """The crossing lies between 1e-3 and 1e-2 (5 seeds). Seed 4 missing its 1e-4 cell leaves the interval as it
    was (the first stretch still excludes 0 with four seeds); with four of five missing, that stretch has one seed,
    cannot exclude 0, and the interval opens below the grid. One seed everywhere: no interval."""
    sweep = _stability_sweep(np.random.default_rng(3), 5, noise=0.01)
    complete = critical_point(sweep, "lr", "change")
    assert 1e-3 < complete.ci_low < 10 ** -2.5 < complete.ci_high < 1e-2
    one_gone = sweep[~((sweep["seed"] == 4) & (sweep["lr"] == 1e-4))]
    again = critical_point(one_gone, "lr", "change")
    assert (again.ci_low, again.ci_high) == pytest.approx((complete.ci_low, complete.ci_high), rel=1e-12)
    four_gone = sweep[~((sweep["seed"] >= 1) & (sweep["lr"] == 1e-4))]
    assert critical_point(four_gone, "lr", "change").ci_low == -math.inf
    single = critical_point(sweep[sweep["seed"] == 0], "lr", "change")
    assert math.isnan(single.ci_low) and math.isnan(single.ci_high)


def test_critical_point_beyond_the_grid_is_open_ended():
    rows = [{"seed": s, "staleness": m, "change": 0.2 + 0.01 * s} for s in range(3) for m in (1, 2, 4, 8, 16)]
    stable = critical_point(pd.DataFrame(rows), "staleness", "change")
    assert stable.value == math.inf and stable.ci_high == math.inf and stable.ci_low == 16
    boot = critical_point(pd.DataFrame(rows), "staleness", "change", method="bootstrap", n_resamples=200)
    assert boot.above_grid == 1.0 and boot.below_grid == 0.0
    unstable = critical_point(pd.DataFrame(rows).assign(change=lambda f: -f["change"]), "staleness", "change")
    assert unstable.value == -math.inf and unstable.ci_low == -math.inf and unstable.ci_high == 1
    # Noisy seeds near 0 at the first point: the interval reaches below the grid.
    near = pd.DataFrame([{"seed": s, "staleness": m, "change": (0.01 if m == 1 else -0.1 * m) + 0.05 * (s - 1)}
                         for s in range(3) for m in (1, 2, 4)])
    assert critical_point(near, "staleness", "change").ci_low == -math.inf
    # Undecided in the middle, surely positive at the top: the crossing may still lie above the grid.
    spread = {1: 0.001, 2: 0.02, 4: 0.001}
    rising = pd.DataFrame([{"seed": s, "staleness": m, "change": {1: 0.05, 2: 0.0, 4: 0.03}[m] + spread[m] * (s - 1)}
                           for s in range(3) for m in (1, 2, 4)])
    interval = critical_point(rising, "staleness", "change")
    assert 1 < interval.ci_low < 2 and interval.ci_high == math.inf
    with pytest.raises(ValueError, match="method"):
        critical_point(near, "staleness", "change", method="bca")
