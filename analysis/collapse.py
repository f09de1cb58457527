"""Collapse: when a run has visibly failed, defined once so every report counts it the same way.

A run collapsed if it diverged (non-finite loss or logits: status "diverged"), or if its held-out reward fell below
`FRACTION` (half) of its starting value and stayed there for the rest of the run: there is an evaluation from which
on every evaluation, the last included, reads below FRACTION x the first evaluation (step 0, before any update).
A dip that recovers is not a collapse; a run that ends below half its start after at least one evaluation is.
A run whose start is 0 cannot collapse by this rule (there is nothing to lose) unless it diverged.

    collapse_step([0, 10, 20, 30], [0.6, 0.5, 0.2, 0.1])      # -> 20
    count_collapses(data)                                      # group, n_runs, n_collapsed, n_diverged
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import pandas as pd

FRACTION = 0.5
METRIC = "eval/reward"


def collapse_step(steps: Sequence[int], values: Sequence[float], fraction: float = FRACTION) -> int | None:
    """The first step from which every later value (finite or not) is below fraction x values[0]; None if none.

    A non-finite value counts as below (a run that produces NaN has failed)."""
    if len(values) < 2 or not math.isfinite(values[0]) or values[0] <= 0:
        return None
    threshold = fraction * values[0]
    first = None
    for step, value in zip(steps[1:], values[1:]):
        below = not math.isfinite(value) or value < threshold
        first = (step if first is None else first) if below else None
    return first


def run_collapsed(steps: Sequence[int], values: Sequence[float], diverged: bool = False,
                  fraction: float = FRACTION) -> bool:
    """Diverged, or held-out reward below fraction x its start for the rest of the run."""
    return diverged or collapse_step(steps, values, fraction) is not None


def collapses(data, metric: str = METRIC, fraction: float = FRACTION) -> pd.DataFrame:
    """One row per run: run, group (if set), diverged, collapse_step (NaN if none), collapsed."""
    rows = []
    steps = data.steps
    for _, info in data.runs.iterrows():
        curve = steps[(steps["run"] == info["run"])] if metric in steps.columns else steps.iloc[:0]
        curve = curve[["step", metric]].dropna() if len(curve) else curve
        diverged = info.get("status") == "diverged"
        at = collapse_step(curve["step"].tolist(), curve[metric].tolist(), fraction) if len(curve) else None
        rows.append({"run": info["run"], "group": info.get("group", info["run"]), "diverged": diverged,
                     "collapse_step": float("nan") if at is None else at, "collapsed": diverged or at is not None})
    return pd.DataFrame(rows)


def count_collapses(data, metric: str = METRIC, fraction: float = FRACTION) -> pd.DataFrame:
    """Per group: n_runs, n_collapsed, n_diverged (groups from moe_rl.analysis.aggregate.add_groups, else one per
    run)."""
    per_run = collapses(data, metric, fraction)
    return (per_run.groupby("group", sort=False)
            .agg(n_runs=("run", "size"), n_collapsed=("collapsed", "sum"), n_diverged=("diverged", "sum"))
            .reset_index())
