"""Paired comparisons of methods over seeds: runs of two methods with the same seed at the same other settings
share their warm start, prompts and step-0 evaluation, so their difference is measured per seed, not between
two noisy group means.

    paired_comparisons(per_run, group_by, margin=0.05)
    critical_points(per_run, "optim.lr", group_by)      # per method: where the held-out change turns negative

For each setting of the non-method group keys (learning rate, depth, ...; one block when there are none), each
pair of methods (`method_keys`: objective, routing mode, rollout correction) and each metric (held-out gain,
final held-out reward, final training reward by default): the mean paired difference a - b with its t CI, the
paired t p-value, Holm's adjustment of that p across every row of the metric (the table's family), the TOST
p-value of |difference| >= margin, and the minimum detectable difference at the observed spread of the
differences. `reading` says what the row allows: "a > b" or "a < b" only from the Holm-adjusted p, "no
difference" only from TOST (never from a CI that merely overlaps 0). Columns: see COLUMNS and docs/analysis.md.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np
import pandas as pd

from moe_rl.analysis.aggregate import group_label
from moe_rl.analysis.stats import ALPHA, POWER, critical_point, holm, mdd_paired, paired_differences, paired_t, tost_p

METHOD_KEYS = ("objective.name", "routing_mode")
METRICS = ("eval_gain", "eval_final", "reward_final")
COLUMNS = ["metric", "setting", "a", "b", "n_pairs", "mean_a", "mean_b", "diff", "ci_low", "ci_high", "p", "p_holm",
           "margin", "p_tost", "sd_diff", "mdd", "reading"]


def method_keys(group_by: Sequence[str]) -> list[str]:
    """The group keys that name a method rather than a setting: objective, routing mode, and any key with a
    `correction` component (the rollout correction, however its config nests it)."""
    return [k for k in group_by if k in METHOD_KEYS or "correction" in k.split(".")]


def _labels(frame: pd.DataFrame, keys: Sequence[str]) -> list[str]:
    """Each row's label over `keys` ("grpo R2", "lr=0.001"); "" for every row when there are no keys."""
    return [group_label(row, keys) if keys else "" for _, row in frame.iterrows()]


def paired_comparisons(per_run: pd.DataFrame, group_by: Sequence[str], metrics: Sequence[str] = METRICS,
                       margin: float = 0.05, alpha: float = ALPHA, power: float = POWER) -> pd.DataFrame:
    """The paired table (COLUMNS) of `per_run` (one row per run: seed, the group keys, the metric columns;
    moe_rl.analysis.per_run.per_run_final). Settings and methods are in the order of their key values, as text (as
    the report's groups: "grpo R2" before "grpo native"); a pair is listed as (earlier, later), a - b. Empty when
    no block holds two methods."""
    methods = method_keys(group_by)
    settings = [k for k in group_by if k not in methods]
    if not methods:
        return pd.DataFrame(columns=COLUMNS)
    frame = per_run.assign(_method=_labels(per_run, methods), _setting=_labels(per_run, settings))
    frame = frame.sort_values([*settings, *methods], key=lambda column: column.astype(str), kind="stable")
    rows = [_row(metric, setting, a, b, block, margin, alpha, power)
            for metric in metrics if metric in frame
            for setting, block in frame.groupby("_setting", sort=False)
            for a, b in itertools.combinations(block["_method"].unique(), 2)]
    table = pd.DataFrame(rows, columns=COLUMNS)
    for metric in table["metric"].unique():
        rows_of = table["metric"] == metric
        table.loc[rows_of, "p_holm"] = holm(table.loc[rows_of, "p"].to_numpy(dtype=float))
    table["reading"] = [reading(r, alpha) for r in table.itertuples()]
    return table


def _row(metric: str, setting: str, a: str, b: str, block: pd.DataFrame, margin: float, alpha: float,
         power: float) -> dict:
    by_seed = block.pivot_table(index="seed", columns="_method", values=metric, aggfunc="mean")
    pairs = by_seed.reindex(columns=[a, b]).dropna()  # a method with no value here: no pairs
    diff = paired_t(pairs[a], pairs[b])
    d = paired_differences(pairs[a], pairs[b])
    sd = float(d.std(ddof=1)) if len(d) > 1 else np.nan
    return {"metric": metric, "setting": setting, "a": a, "b": b, "n_pairs": len(pairs),
            "mean_a": float(pairs[a].mean()), "mean_b": float(pairs[b].mean()), "diff": diff.mean_diff,
            "ci_low": diff.ci_low, "ci_high": diff.ci_high, "p": diff.p, "p_holm": np.nan, "margin": margin,
            "p_tost": tost_p(diff, margin), "sd_diff": sd,
            "mdd": mdd_paired(len(d), sd, alpha, power) if len(d) > 1 else np.nan, "reading": ""}


def reading(row, alpha: float = ALPHA) -> str:
    """'a > b' / 'a < b' (Holm-adjusted p < alpha; ', within margin' when TOST also holds), 'no difference'
    (TOST p < alpha: the difference lies within +-margin), 'inconclusive' otherwise or with fewer than 2 pairs."""
    if not np.isfinite(row.p_holm):
        return "inconclusive"
    equivalent = np.isfinite(row.p_tost) and row.p_tost < alpha
    if row.p_holm < alpha:
        direction = "a > b" if row.diff > 0 else "a < b"
        return f"{direction}, within margin" if equivalent else direction
    return "no difference" if equivalent else "inconclusive"


CRITICAL_COLUMNS = ["method", "setting", "axis", "n_seeds", "critical", "ci_low", "ci_high"]


def critical_points(per_run: pd.DataFrame, axis: str, group_by: Sequence[str], value: str = "eval_gain",
                    log_axis: bool = True) -> pd.DataFrame:
    """Per method (and setting of the group keys other than the method keys and `axis`): the `axis` value
    (learning rate, minibatches per rollout batch) where the mean over seeds of `value` turns negative, with
    its 95% CI over seeds (moe_rl.analysis.stats.critical_point, t inversion). Columns: CRITICAL_COLUMNS; -inf / inf
    where the crossing lies below / above the grid."""
    methods = method_keys(group_by)
    settings = [k for k in group_by if k not in methods and k != axis]
    frame = per_run.assign(_method=_labels(per_run, methods), _setting=_labels(per_run, settings))
    rows = []
    for (method, setting), runs in frame.groupby(["_method", "_setting"], sort=True):
        point = critical_point(runs, axis, value, log_axis=log_axis)
        rows.append({"method": method, "setting": setting, "axis": axis, "n_seeds": point.n_seeds,
                     "critical": point.value, "ci_low": point.ci_low, "ci_high": point.ci_high})
    return pd.DataFrame(rows, columns=CRITICAL_COLUMNS)
