"""Does a rerun reproduce a committed study? Per cell and metric, whether the new value lies inside the committed
seed CI.

CPU runs are bit-identical on the same machine, not across machines (CPU kernels round differently), so a rerun
is judged against the committed 95% confidence interval over seeds, not against the committed digits. Both tables
are `tables/churn_vs_lr_depth.csv` as `moe-rl report` writes them (analysis.cells): one row per cell, with
`<metric>_mean`, `<metric>_ci_low`, `<metric>_ci_high` columns. A cell is matched by its `group` label.

    python -m analysis.compare_committed outputs/churn_repro/tables/churn_vs_lr_depth.csv \\
        results/churn_repro/tables/churn_vs_lr_depth.csv

prints one line per cell and metric (inside | OUTSIDE | no CI (one seed) | missing) and a count; exit status 0,
or 1 with --strict when any value lies outside its interval.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import pandas as pd
import tyro

from moe_rl.errors import DataError

METRICS = ("churn", "set_change", "token_any", "kl_median", "eval_final", "eval_gain")


@dataclass
class CompareConfig:
    """Compare a new cell table with the committed one."""

    new: Annotated[str, tyro.conf.Positional, tyro.conf.arg(metavar="NEW_CSV")]
    """The rerun's tables/churn_vs_lr_depth.csv."""
    committed: Annotated[str, tyro.conf.Positional, tyro.conf.arg(metavar="COMMITTED_CSV")]
    """The committed tables/churn_vs_lr_depth.csv (keep a copy: a rerun's report must not overwrite it first)."""
    metrics: tuple[str, ...] = METRICS
    """Quantities to compare (each needs _mean, _ci_low and _ci_high columns in both tables)."""
    strict: bool = False
    """Exit with status 1 when any new value lies outside the committed interval."""


def _read(path: str) -> pd.DataFrame:
    if not Path(path).is_file():
        raise DataError(f"{path}: no such table (run `moe-rl report` first)")
    table = pd.read_csv(path)
    if "group" not in table:
        raise DataError(f"{path}: no `group` column; expected a churn_vs_lr_depth.csv written by moe-rl report")
    return table.set_index("group")


def verdict(value: float, low: float, high: float) -> str:
    """'inside' | 'OUTSIDE' | 'no CI' (the committed cell has one run) | 'missing' (no new value)."""
    if not math.isfinite(value):
        return "missing"
    if not (math.isfinite(low) and math.isfinite(high)):
        return "no CI"
    return "inside" if low <= value <= high else "OUTSIDE"


def compare(new: pd.DataFrame, committed: pd.DataFrame, metrics=METRICS) -> pd.DataFrame:
    """One row per (committed cell, metric): group, metric, new, committed mean, ci_low, ci_high, verdict. Cells
    only in the new table are left out (nothing to compare against); cells missing from it read 'missing'."""
    rows = []
    for group, old in committed.iterrows():
        for metric in metrics:
            if f"{metric}_mean" not in committed:
                continue
            value = float(new.at[group, f"{metric}_mean"]) if group in new.index and f"{metric}_mean" in new else math.nan
            low, high = float(old[f"{metric}_ci_low"]), float(old[f"{metric}_ci_high"])
            rows.append({"group": group, "metric": metric, "new": value, "committed": float(old[f"{metric}_mean"]),
                         "ci_low": low, "ci_high": high, "verdict": verdict(value, low, high)})
    return pd.DataFrame(rows, columns=["group", "metric", "new", "committed", "ci_low", "ci_high", "verdict"])


def format_lines(result: pd.DataFrame) -> list[str]:
    lines = [f"{r.verdict:>7}  {r.group}  {r.metric}: new {r.new:.4g}, committed {r.committed:.4g} "
             f"[{r.ci_low:.4g}, {r.ci_high:.4g}]" for r in result.itertuples()]
    counts = result["verdict"].value_counts().to_dict()
    lines.append("compare: " + ", ".join(f"{n} {v}" for v, n in sorted(counts.items())) +
                 f" of {len(result)} (cell, metric) pairs; committed 95% CIs are over seeds")
    return lines


def main(argv: list[str] | None = None) -> int:
    cfg = tyro.cli(CompareConfig, args=argv, prog="python -m analysis.compare_committed",
                   description=__doc__.split("\n\n")[0])
    try:
        result = compare(_read(cfg.new), _read(cfg.committed), cfg.metrics)
    except DataError as exc:
        print(f"compare_committed: error: {exc}", file=sys.stderr)
        return 2
    print("\n".join(format_lines(result)))
    return 1 if cfg.strict and (result["verdict"] == "OUTSIDE").any() else 0


if __name__ == "__main__":
    sys.exit(main())
