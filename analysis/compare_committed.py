"""Does a rerun reproduce a committed study? Per cell and metric, a calibrated test of "the rerun's seeds come from
the committed cell's distribution", and the count of rejections against the count expected when nothing changed.

CPU runs are bit-identical on the same machine, not across machines (CPU kernels round differently), so a rerun
is judged against the committed spread over seeds, not against the committed digits. "The new mean lies inside
the committed 95% CI of the mean" is not that test: the CI is for the committed mean, and a new mean of 3 seeds,
itself noisy, lies outside it about 9% of the time with nothing changed. Two calibrated tests instead, each
rejecting a fraction alpha of (cell, metric) pairs when nothing changed:

    prediction  (default) the committed mean m, sd s and n predict the mean of the rerun's n' seeds:
                m +- t(1 - alpha/2, n - 1) s sqrt(1/n + 1/n'). Exact for normal seeds; needs the committed
                spread only (a one-seed rerun is tested too).
    welch       Welch's two-sample t of the two means (moe_rl.analysis.stats.welch_from_stats); uses the rerun's
                spread too, so a machine that widens the spread is not taken for a shift. With 3 + 3 seeds
                it is conservative (3.3% rejected at a nominal 5% in tests/analysis/test_analysis_stats.py).

The summary prints how many pairs were rejected, how many alpha x tested would be under no change, and the
binomial probability of at least the observed count under no change. Metrics of one cell are correlated
(slot churn and set change move together), so that probability is a guide, not an exact p-value.

Each table is a `tables/churn_vs_lr_depth.csv` as `moe-rl report` writes it (moe_rl.analysis.cells): one row per cell
(matched by `group`), with `n_runs` and `<metric>_mean`, `_ci_low`, `_ci_high`. The sd comes from the per-seed
values in `per_run_final.csv` beside the table when that file exists (reports write it), else from the 95% t CI:
s = (ci_high - ci_low) / 2 * sqrt(n) / t(0.975, n - 1).

    python -m moe_rl.analysis.compare_committed outputs/churn_repro/tables/churn_vs_lr_depth.csv \\
        results/churn_repro/tables/churn_vs_lr_depth.csv [--test welch] [--alpha 0.05] [--strict]

prints one line per cell and metric (inside | OUTSIDE | one run | missing) and the counts; exit status 0, or 1
with --strict when the number OUTSIDE is improbable under no change (binomial p < alpha).
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

import pandas as pd
import tyro
from scipy import special, stats

from moe_rl.analysis.aggregate import CONFIDENCE
from moe_rl.analysis.stats import welch_from_stats
from moe_rl.errors import ConfigError, DataError

METRICS = ("churn", "set_change", "token_any", "kl_median", "eval_final", "eval_gain")
PER_RUN = "per_run_final.csv"
COLUMNS = ["group", "metric", "new", "n_new", "committed", "sd", "n", "low", "high", "p", "test", "verdict"]


@dataclass
class CompareConfig:
    """Compare a new cell table with the committed one."""

    new: Annotated[str, tyro.conf.Positional, tyro.conf.arg(metavar="NEW_CSV")]
    """The rerun's tables/churn_vs_lr_depth.csv."""
    committed: Annotated[str, tyro.conf.Positional, tyro.conf.arg(metavar="COMMITTED_CSV")]
    """The committed tables/churn_vs_lr_depth.csv (keep a copy: a rerun's report must not overwrite it first)."""
    metrics: tuple[str, ...] = METRICS
    """Quantities to compare (each needs _mean, _ci_low and _ci_high columns in both tables)."""
    test: Literal["prediction", "welch"] = "prediction"
    """prediction: the committed cell's prediction interval for the new mean; welch: Welch's two-sample t (a
    cell whose rerun has one seed falls back to the prediction interval)."""
    alpha: float = 0.05
    """Level of each test; also of --strict's binomial test of the count."""
    strict: bool = False
    """Exit with status 1 when the number of OUTSIDE pairs is improbable under no change (binomial p < alpha)."""

    def __post_init__(self) -> None:
        if not 0 < self.alpha < 1:
            raise ConfigError(f"alpha must lie in (0, 1), got {self.alpha}")


@dataclass(frozen=True)
class Cell:
    """One cell's metric over its seeds."""

    mean: float
    sd: float
    n: int


def read_table(path: str) -> pd.DataFrame:
    if not Path(path).is_file():
        raise DataError(f"{path}: no such table (run `moe-rl report` first)")
    table = pd.read_csv(path)
    if "group" not in table:
        raise DataError(f"{path}: no `group` column; expected a churn_vs_lr_depth.csv written by moe-rl report")
    return table.set_index("group")


def read_per_run(table_path: str) -> pd.DataFrame | None:
    """The per-seed values beside a cell table (`per_run_final.csv`), or None when the report has none."""
    path = Path(table_path).with_name(PER_RUN)
    return pd.read_csv(path) if path.is_file() else None


def sd_from_ci(low: float, high: float, n: int, confidence: float = CONFIDENCE) -> float:
    """The sample sd behind a Student-t CI of the mean (moe_rl.analysis.aggregate.t_ci): half-width sqrt(n) / t."""
    if n < 2 or not (math.isfinite(low) and math.isfinite(high)):
        return math.nan
    return (high - low) / 2 * math.sqrt(n) / special.stdtrit(n - 1, (1 + confidence) / 2)  # t quantile


def cell_stats(rows: dict[str, dict], group: str, metric: str, per_run: pd.DataFrame | None) -> Cell:
    """Mean, sd and n of `metric` in one cell: from per-seed values when there are any, else from the table's
    row (`rows`: the table as {group: row})."""
    if per_run is not None and metric in per_run:
        values = per_run.loc[per_run["group"] == group, metric].astype(float)
        values = values[values.notna() & values.map(math.isfinite)]
        if len(values):
            return Cell(float(values.mean()), float(values.std(ddof=1)) if len(values) > 1 else math.nan, len(values))
    row = rows.get(group)
    if row is None or f"{metric}_mean" not in row:
        return Cell(math.nan, math.nan, 0)
    n = int(row["n_runs"]) if pd.notna(row.get("n_runs")) else 1
    return Cell(float(row[f"{metric}_mean"]), sd_from_ci(row[f"{metric}_ci_low"], row[f"{metric}_ci_high"], n), n)


def prediction_test(new: Cell, old: Cell, alpha: float) -> tuple[float, float, float]:
    """(low, high, p): the (1 - alpha) prediction interval for the mean of new.n seeds from the committed cell,
    and the two-sided p of the new mean under it (t on old.n - 1 df)."""
    scale = old.sd * math.sqrt(1 / old.n + 1 / new.n)
    half = special.stdtrit(old.n - 1, 1 - alpha / 2) * scale  # stdtrit, stdtr: scipy's t quantile and cdf
    if scale == 0:
        return old.mean, old.mean, float(new.mean == old.mean)
    return old.mean - half, old.mean + half, float(2 * special.stdtr(old.n - 1, -abs(new.mean - old.mean) / scale))


def welch_test(new: Cell, old: Cell, alpha: float) -> tuple[float, float, float]:
    """(low, high, p): Welch's test of new mean = committed mean; low-high are the new means it would accept
    (committed mean +- t(1 - alpha/2, df) se, at this se and df)."""
    diff = welch_from_stats(new.mean, new.sd, new.n, old.mean, old.sd, old.n, confidence=1 - alpha)
    half = (diff.ci_high - diff.ci_low) / 2
    return old.mean - half, old.mean + half, diff.p


def compare_one(new: Cell, old: Cell, test: str, alpha: float) -> dict:
    row = {"new": new.mean, "n_new": new.n, "committed": old.mean, "sd": old.sd, "n": old.n}
    if not math.isfinite(new.mean):
        return {**row, "low": math.nan, "high": math.nan, "p": math.nan, "test": "", "verdict": "missing"}
    if old.n < 2 or not math.isfinite(old.sd):
        return {**row, "low": math.nan, "high": math.nan, "p": math.nan, "test": "", "verdict": "one run"}
    use = "welch" if test == "welch" and new.n >= 2 and math.isfinite(new.sd) else "prediction"
    low, high, p = (welch_test if use == "welch" else prediction_test)(new, old, alpha)
    return {**row, "low": low, "high": high, "p": p, "test": use, "verdict": "OUTSIDE" if p < alpha else "inside"}


def compare(new: pd.DataFrame, committed: pd.DataFrame, metrics=METRICS, test: str = "prediction",
            alpha: float = 0.05, new_per_run: pd.DataFrame | None = None,
            committed_per_run: pd.DataFrame | None = None) -> pd.DataFrame:
    """One row per (committed cell, metric): COLUMNS. Cells only in the new table are left out (nothing to
    compare against); cells missing from it read 'missing', committed cells of one run 'one run'."""
    rows, new_rows, committed_rows = [], new.to_dict("index"), committed.to_dict("index")
    for group in committed.index:
        for metric in (m for m in metrics if f"{m}_mean" in committed):
            old = cell_stats(committed_rows, group, metric, committed_per_run)
            fresh = cell_stats(new_rows, group, metric, new_per_run)
            rows.append({"group": group, "metric": metric, **compare_one(fresh, old, test, alpha)})
    return pd.DataFrame(rows, columns=COLUMNS)


def outside_count(result: pd.DataFrame, alpha: float) -> tuple[int, int, float]:
    """(observed OUTSIDE, pairs tested, binomial P(count >= observed) under no change at rate alpha)."""
    tested = int(result["verdict"].isin(["inside", "OUTSIDE"]).sum())
    outside = int((result["verdict"] == "OUTSIDE").sum())
    return outside, tested, float(stats.binom.sf(outside - 1, tested, alpha)) if tested else math.nan


def format_lines(result: pd.DataFrame, alpha: float = 0.05) -> list[str]:
    interval = f"{100 * (1 - alpha):g}%"
    lines = [f"{r.verdict:>7}  {r.group}  {r.metric}: new {r.new:.4g} ({r.n_new} runs), committed "
             f"{r.committed:.4g} ({r.n} runs)" + (f", {interval} {r.test} interval [{r.low:.4g}, {r.high:.4g}], "
                                                  f"p {r.p:.3g}" if r.test else "")
             for r in result.itertuples()]
    counts = result["verdict"].value_counts().to_dict()
    outside, tested, p = outside_count(result, alpha)
    lines.append("compare: " + ", ".join(f"{n} {v}" for v, n in sorted(counts.items())) +
                 f" of {len(result)} (cell, metric) pairs")
    if tested:
        lines.append(f"compare: {outside} OUTSIDE of {tested} tested; expected under no change {alpha * tested:.1f} "
                     f"(alpha {alpha:g} x {tested}); P(>= {outside} OUTSIDE | no change) = {p:.3g} (binomial; "
                     "a cell's metrics are correlated, so read it as a guide)")
    return lines


def main(argv: list[str] | None = None) -> int:
    cfg = tyro.cli(CompareConfig, args=argv, prog="python -m moe_rl.analysis.compare_committed",
                   description=__doc__.split("\n\n")[0])
    try:
        new_per_run, committed_per_run = read_per_run(cfg.new), read_per_run(cfg.committed)
        result = compare(read_table(cfg.new), read_table(cfg.committed), cfg.metrics, cfg.test, cfg.alpha,
                         new_per_run, committed_per_run)
    except DataError as exc:
        print(f"compare_committed: error: {exc}", file=sys.stderr)
        return 2
    sources = [f"{name}: {'per-seed values' if per_run is not None else 'means and CIs'}"
               for name, per_run in (("new", new_per_run), ("committed", committed_per_run))]
    print(f"compare_committed: {cfg.test} test at alpha {cfg.alpha:g}; sd from " + ", ".join(sources))
    print("\n".join(format_lines(result, cfg.alpha)))
    _, _, p = outside_count(result, cfg.alpha)
    return 1 if cfg.strict and p < cfg.alpha else 0


if __name__ == "__main__":
    sys.exit(main())
