"""Does the policy learn? Per group: held-out reward before and after RL, the gain with its CI over seeds, and how
many runs collapsed (moe_rl.analysis.collapse). A comparison of methods is evidence only where this table says the
policy learns (docs/design.md section 9), so the report puts it first.

    learning_table(data, last_k=5)   # group, n_runs, start, final, gain, gain_ci_low, gain_ci_high, learns, ...
"""

from __future__ import annotations

import pandas as pd

from moe_rl.analysis.aggregate import run_finals, run_initials, summarize
from moe_rl.analysis.collapse import METRIC, count_collapses
from moe_rl.analysis.load import RunSet

COLUMNS = ["group", "n_runs", "start", "final", "gain", "gain_ci_low", "gain_ci_high", "learns", "n_collapsed",
           "n_diverged"]


def learning_table(data: RunSet, last_k: int, metric: str = METRIC) -> pd.DataFrame:
    """One row per group. start: each run's pre-RL evaluation (step 0); final: its evaluation after training
    (`run_finals`); gain: final - start per run, mean and 95% CI over runs (Student t); learns: the CI lies above 0
    (never with one run). n_collapsed / n_diverged: moe_rl.analysis.collapse's counts."""
    if metric not in data.steps.columns:
        return pd.DataFrame(columns=COLUMNS)
    per_run = pd.DataFrame({"start": run_initials(data.steps, metric, 1),
                            "final": run_finals(data.steps, metric, last_k)})
    per_run["gain"] = per_run["final"] - per_run["start"]
    per_run = data.runs[["run", "group"]].merge(per_run, left_on="run", right_index=True)
    counts = count_collapses(data, metric).set_index("group")
    rows = []
    for group in data.groups:
        runs = per_run[per_run["group"] == group]
        if not len(runs):
            continue
        gain = summarize(runs["gain"])
        rows.append({"group": group, "n_runs": len(runs), "start": runs["start"].mean(), "final": runs["final"].mean(),
                     "gain": gain["mean"], "gain_ci_low": gain["ci_low"], "gain_ci_high": gain["ci_high"],
                     "learns": bool(gain["ci_low"] > 0) if pd.notna(gain["ci_low"]) else False,
                     "n_collapsed": int(counts.loc[group, "n_collapsed"]) if group in counts.index else 0,
                     "n_diverged": int(counts.loc[group, "n_diverged"]) if group in counts.index else 0})
    return pd.DataFrame(rows, columns=COLUMNS)
