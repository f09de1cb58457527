"""Churn per run and per cell of a scaling sweep, in both readings, with the policy change and whether RL learned.

A cell is one setting of the swept fields (one group: lr x depth x experts x top-k); its runs are seeds. Churn is
read three ways (docs/design.md section 5, docs/metrics.md), always side by side:

    slot churn   routing/update/churn        share of a token's K activated experts that change in one update
    set change   routing/update/set_change   share of (token, layer) router decisions whose top-K set changed
    token any    routing/update/token_any    share of tokens whose expert path changed in at least one layer

Per run (`run_summary`), over its optimizer steps: the mean of each reading; the median of `update/kl` (the k3
estimator is heavy-tailed: a few outlying updates of 10-100 nats rule its mean); the held-out reward before RL
(`eval_start`, the step-0 evaluation), after it (`eval_final`, moe_rl.analysis.aggregate.run_finals) and their
difference (`eval_gain`); the training reward over the first and last `last_k` rollout steps and their difference.
Per cell (`churn_vs_lr_depth`): each of those as mean and 95% CI over the runs (Student t), and `learns`: whether the
CI of the held-out gain lies above 0 (never with one seed: no CI).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from moe_rl.analysis.aggregate import run_finals, run_initials, summarize
from moe_rl.analysis.load import RunSet

READINGS = {"churn": "routing/update/churn", "set_change": "routing/update/set_change",
            "token_any": "routing/update/token_any"}
READING_LABELS = {"churn": "slot churn", "set_change": "set change", "token_any": "tokens changed in any layer"}
READING_HELP = {"churn": "share of a token's K experts that change", "set_change": "share of (token, layer) "
                "decisions whose top-K set changed", "token_any": "share of tokens whose path changed anywhere"}
SCALING_KEYS = ("optim.lr", "model.n_layers", "model.n_experts", "model.top_k", "model.init_depth")
KL = "update/kl"
QUANTITIES = (*READINGS, "kl_median", "eval_start", "eval_final", "eval_gain", "reward_start", "reward_final",
              "reward_gain")


def run_summary(data: RunSet, last_k: int = 5) -> pd.DataFrame:
    """One row per run: run, group (if grouped), the scaling keys, and QUANTITIES (NaN where not logged)."""
    keys = ["group"] if "group" in data.runs else []
    frame = data.runs[["run", *keys]].copy()
    for key in SCALING_KEYS:
        frame[key] = data.runs[key] if key in data.runs else np.nan
    metrics = data.metrics.groupby("run")
    for name, metric in READINGS.items():
        frame[name] = frame["run"].map(metrics[metric].mean()) if metric in data.metrics else np.nan
    frame["kl_median"] = frame["run"].map(metrics[KL].median()) if KL in data.metrics else np.nan
    for prefix, metric in (("eval", "eval/reward"), ("reward", "reward")):
        if metric not in data.steps:
            frame[[f"{prefix}_start", f"{prefix}_final", f"{prefix}_gain"]] = np.nan
            continue
        frame[f"{prefix}_start"] = frame["run"].map(run_initials(data.steps, metric, last_k))
        frame[f"{prefix}_final"] = frame["run"].map(run_finals(data.steps, metric, last_k))
        frame[f"{prefix}_gain"] = frame[f"{prefix}_final"] - frame[f"{prefix}_start"]
    return frame


def churn_vs_lr_depth(data: RunSet, last_k: int = 5) -> pd.DataFrame:
    """One row per cell: group, SCALING_KEYS, n_runs, then `<quantity>_mean`, `_ci_low`, `_ci_high` for each of
    QUANTITIES, and `learns`; sorted by the scaling keys."""
    per_run = run_summary(data, last_k)
    by = ["group"] if "group" in per_run else list(SCALING_KEYS)
    rows = []
    for _, runs in per_run.groupby(by, sort=False, dropna=False):
        row = {"group": runs["group"].iloc[0] if "group" in runs else "all runs",
               **{key: runs[key].iloc[0] for key in SCALING_KEYS}, "n_runs": len(runs)}
        for name in QUANTITIES:
            stats = summarize(runs[name])
            row.update({f"{name}_mean": stats["mean"], f"{name}_ci_low": stats["ci_low"],
                        f"{name}_ci_high": stats["ci_high"]})
        row["learns"] = bool(row["eval_gain_ci_low"] > 0)  # NaN (one seed) compares False
        rows.append(row)
    return pd.DataFrame(rows).sort_values([*SCALING_KEYS, "group"], ignore_index=True)
