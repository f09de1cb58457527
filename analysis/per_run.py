"""Per-run tables: the numbers every committed CI, collapse count and bootstrap is computed from, small enough to
commit (a few kB per study, where the run directories are hundreds of MB).

    per_run_final(data, metrics, last_k)   one row per run: run, group, seed, status, the group keys, the
                                           warm start (init_from's warm-start name, where the config has one), the cell
                                           quantities of moe_rl.analysis.cells.run_summary (churn, set_change, ...,
                                           eval_gain) and each metric's final value
                                           (moe_rl.analysis.aggregate.run_finals)
    per_run_eval(data)                     one row per (run, evaluation): run, group, seed, step, eval/* metrics

`tables/final_scores.csv` and `tables/churn_vs_lr_depth.csv` are these values summarised over each group's runs
(mean and Student-t CI): tests/analysis/test_analysis_per_run.py recomputes them from the per-run files.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import PurePath

import pandas as pd

from moe_rl.analysis.aggregate import EVAL_PREFIX, run_finals
from moe_rl.analysis.cells import QUANTITIES, SCALING_KEYS, run_summary
from moe_rl.analysis.load import RunSet

RUN_FIELDS = ["run", "group", "seed", "status"]


def warm_start_name(init_from):
    """The warm start a run started from, by its name: the sweep's warm-start key for a checkpoint inside one
    (`.../warmstart/<key>/checkpoints/latest.pt` -> `<key>`), else the file's name. The path itself names where the
    sweep folder lay, so two runs from one warm start copied into another sweep would count as two."""
    if not isinstance(init_from, str) or not init_from:
        return init_from
    path = PurePath(init_from)
    return path.parent.parent.name if path.parent.name == "checkpoints" else path.name


def _run_fields(data: RunSet) -> pd.DataFrame:
    # init_from names the warm start: the cluster of a bootstrap over warm starts (moe_rl.analysis.stats).
    keys = [k for k in dict.fromkeys([*data.group_by, *SCALING_KEYS, "init_from"]) if k in data.runs
            and k not in RUN_FIELDS]
    frame = data.runs[[*RUN_FIELDS, *keys]].copy()
    if "init_from" in frame:
        frame["init_from"] = frame["init_from"].map(warm_start_name)
    return frame


def per_run_final(data: RunSet, metrics: Sequence[str], last_k: int = 5,
                  summary: pd.DataFrame | None = None) -> pd.DataFrame:
    """One row per run (in data.runs order): RUN_FIELDS, the group keys, scaling keys and init_from, QUANTITIES (the
    run's values behind churn_vs_lr_depth.csv), then one column per metric of `metrics` that was logged, named as in
    final_scores.csv (`reward`, `eval/reward`, `routing/update/churn`, ...): the run's final value. `summary`:
    run_summary(data, last_k), when the caller has it already."""
    summary = run_summary(data, last_k) if summary is None else summary
    frame = _run_fields(data).merge(summary[["run", *QUANTITIES]], on="run", how="left")
    for metric in (m for m in metrics if m in data.steps.columns):
        frame[metric] = frame["run"].map(run_finals(data.steps, metric, last_k))
    return frame


def per_run_eval(data: RunSet) -> pd.DataFrame:
    """One row per (run, step) that logged an evaluation: run, group, seed, step, and every eval/* metric. Step 0
    is the pre-RL evaluation; the last step (total_steps) the evaluation after training."""
    columns = [c for c in data.steps.columns if c.startswith(EVAL_PREFIX)]
    if not columns:
        return pd.DataFrame(columns=["run", "group", "seed", "step"])
    rows = data.steps.dropna(subset=columns, how="all")[["run", "step", *columns]]
    return data.runs[["run", "group", "seed"]].merge(rows, on="run").sort_values(["run", "step"], ignore_index=True)
