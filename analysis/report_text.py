"""Sections of a report's README.md beyond the summary: the cells of a churn sweep with both readings and their
CIs, the churn scaling fit and its extrapolation, and the figure panels that were left out.

Every number is written with its 95% CI over seeds and the number of runs it rests on.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from moe_rl.analysis.cells import READING_HELP, READING_LABELS
from moe_rl.analysis.scaling import PAPER_CHURN, TARGET


def _pct(value: float) -> str:
    return "" if not math.isfinite(value) else f"{100 * value:.3g}%"


def with_ci(mean: float, low: float, high: float, percent: bool = False) -> str:
    """'1.2% [0.9%, 1.5%]'; no brackets when there is no interval (one run)."""
    fmt = _pct if percent else (lambda v: "" if not math.isfinite(v) else f"{v:.3g}")
    if not math.isfinite(mean):
        return ""
    return fmt(mean) + (f" [{fmt(low)}, {fmt(high)}]" if math.isfinite(low) and math.isfinite(high) else " (no CI)")


def _row_cell(row: pd.Series, name: str, percent: bool = False) -> str:
    return with_ci(row[f"{name}_mean"], row[f"{name}_ci_low"], row[f"{name}_ci_high"], percent)


def cells_markdown(cells: pd.DataFrame) -> str:
    """One line per cell: both churn readings, tokens changed anywhere, median KL and held-out reward."""
    if cells.empty or cells["churn_mean"].isna().all():
        return ""
    header = ["cell", "runs", "slot churn", "set change", "token any", "median KL/update (nats)",
              "held-out before RL", "held-out after RL", "held-out gain", "learns"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for _, row in cells.iterrows():
        values = [row["group"], str(int(row["n_runs"])), _row_cell(row, "churn", True),
                  _row_cell(row, "set_change", True), _row_cell(row, "token_any", True),
                  _row_cell(row, "kl_median"), _row_cell(row, "eval_start"), _row_cell(row, "eval_final"),
                  _row_cell(row, "eval_gain"), "yes" if row["learns"] else "no"]
        lines.append("| " + " | ".join(values) + " |")
    legend = "; ".join(f"{READING_LABELS[k]}: {READING_HELP[k]}" for k in READING_HELP)
    return "\n".join(["", "## Cells: churn in both readings, policy change and learning", "",
                      "Per cell, mean over its runs (seeds) and [95% CI, Student t over seeds]; each run's churn is "
                      f"its mean over its updates, its KL the median over them. {legend}. `learns`: the CI of the "
                      "held-out gain (after minus before RL) lies above 0 (never with one seed).", "", *lines, ""])


def scaling_markdown(tables: dict[str, pd.DataFrame]) -> str:
    """The fit's coefficients, the extrapolation to the paper's model, and where ~10% appears while RL learns."""
    text = cells_markdown(tables.get("churn_vs_lr_depth", pd.DataFrame()))
    if "scaling_fit" not in tables:
        return text
    fit, extra, near = tables["scaling_fit"], tables["scaling_extrapolation"], tables["near_10pct"]
    lines = ["", "## Churn scaling fit", "",
             "log(reading) = a + b log(median KL per update) + c log(MoE layers) + d log(experts) + e log(top-k)"
             + (" + f log(init layers), init layers the depth whose residual init a run took" if
                (fit["term"] == "init_layers").any() else "") + ", "
             "least squares over runs; [95% CI] from a bootstrap over "
             + ("warm starts within each architecture, then runs within them"
                if (fit.get("bootstrap", pd.Series(["runs"])) != "runs").any()
                else "runs (not every architecture has two or more warm starts: the intervals leave out "
                     "warm-start variance)")
             + " (analysis/scaling.py, docs/analysis.md). "
             "A term the runs do not vary is left out (blank).", "",
             "| reading | term | estimate [CI] | R^2 | runs |", "|---|---|---|---|---|"]
    for _, r in fit.iterrows():
        estimate = with_ci(r["estimate"], r["ci_low"], r["ci_high"])
        reading = READING_LABELS[r["reading"]]
        lines.append(f"| {reading} | {r['term']} | {estimate} | {r['r2']:.3f} | {int(r['n_runs'])} |")
    target = f"{TARGET['model.n_layers']} MoE layers, {TARGET['model.n_experts']} experts, top-{TARGET['model.top_k']}"
    lines += ["", f"Extrapolated to {target} (the GSPO paper's model), at the median KL per update of the runs in "
              "cells that learn (all runs if none does):", "",
              "| reading | KL per update | predicted [CI] | KL per update for 10% [CI] | terms left out |",
              "|---|---|---|---|---|"]
    labels = {**READING_LABELS, "set_change_from_churn": "set change from slot churn, 1 - (1 - c)^K"}
    for _, r in extra.iterrows():
        needed = with_ci(r[f"driver_for_{PAPER_CHURN:g}"], r["driver_for_ci_low"], r["driver_for_ci_high"])
        bound = r.get("within_k_slot_bound")
        flag = "" if not isinstance(bound, (bool, np.bool_)) else (" (within K x slot)" if bound else
                                                                  " (**breaks set change <= K x slot churn**)")
        lines.append(f"| {labels[r['reading']]}{flag} | {r['driver_ref']:.3g} | "
                     f"{with_ci(r['predicted'], r['predicted_ci_low'], r['predicted_ci_high'], True)} | {needed} | "
                     f"{r['dropped'] or 'none'} |")
    if "scaling_set_change_check" in tables and len(tables["scaling_set_change_check"]):
        lines += ["", "Set change is at most K x slot churn by definition (a changed set has a changed slot). The "
                  "direct fit of set change does not know that; the row `set change from slot churn` derives it "
                  "from the slot-churn law as 1 - (1 - c)^K, which never breaks the bound. How well that form "
                  "holds on the runs (set change / slot churn, measured against the form's ratio):", "",
                  "| top-k | runs | measured ratio [95% CI] | 1 - (1 - c)^K over c | bound K |",
                  "|---|---|---|---|---|"]
        for r in tables["scaling_set_change_check"].itertuples():
            lines.append(f"| {r.top_k} | {r.n_runs} | {with_ci(r.measured_ratio, r.ratio_ci_low, r.ratio_ci_high)} "
                         f"| {r.independent_slots_ratio:.3g} | {r.bound} |")
    if "scaling_check" in tables:
        lines += ["", "Check: the paper-shaped runs (same depth, experts and top-k as the target) are held out of the "
                  "fit; their measured reading beside the law's prediction at their own median KL per update:", "",
                  "| reading | lr | runs | KL per update | measured [CI] | predicted [CI] | agree |",
                  "|---|---|---|---|---|---|---|"]
        for _, r in tables["scaling_check"].iterrows():
            lines.append(f"| {labels[r['reading']]} | {r['optim.lr']:g} | {int(r['n_runs'])} | {r['driver']:.3g} | "
                         f"{with_ci(r['measured'], r['measured_ci_low'], r['measured_ci_high'], True)} | "
                         f"{with_ci(r['predicted'], r['predicted_ci_low'], r['predicted_ci_high'], True)} | "
                         f"{'yes' if r.get('agrees') else '**no**'} |")
        lines += ["", "agree: the runs' log readings and the log prediction differ by at most the two intervals' "
                  "half-widths added in quadrature (moe_rl.analysis.scaling.agrees)."]
    n_terms = fit.groupby("reading")["estimate"].apply(lambda e: int(e.notna().sum())).max()
    n_runs = int(fit["n_runs"].min())
    if n_runs < 5 * n_terms:
        lines += ["", f"Only {n_runs} runs for {n_terms} coefficients: the bootstrap intervals are optimistic and the "
                  "extrapolation is a rough guide."]
    lines += ["", near_sentence(near), ""]
    return text + "\n".join(lines)


def near_sentence(near: pd.DataFrame) -> str:
    """Which cells read 5-20% per update, in which reading, and whether RL learned there."""
    parts = []
    for reading, label in READING_LABELS.items():
        rows = near[near["reading"] == reading]
        learning = rows[rows["learns"]]
        if rows.empty:
            parts.append(f"{label}: no cell")
            continue
        names = ", ".join(f"{r.group} ({_pct(r.value)}, {int(r.n_runs)} runs)" for r in learning.itertuples())
        parts.append(f"{label}: {len(rows)} cell(s), of which RL learns in {len(learning)}"
                     + (f": {names}" if names else ""))
    return "Where churn is near the paper's ~10% (5-20% per update): " + "; ".join(parts) + "."


def no_rl_signal_runs(metrics: pd.DataFrame) -> pd.DataFrame:
    """Per run with any optimizer step whose advantages were all zero (churn/no_rl_signal = 1): how many of its
    updates, out of how many, and at which rollout steps. Empty when no run logged the flag or none had one."""
    if "churn/no_rl_signal" not in metrics.columns:
        return pd.DataFrame(columns=["run", "updates", "of", "steps"])
    flagged = metrics["churn/no_rl_signal"] == 1
    rows = [{"run": run, "updates": int(flagged[lines.index].sum()), "of": len(lines),
             "steps": sorted(int(s) for s in lines.loc[flagged[lines.index], "step"].unique())}
            for run, lines in metrics.groupby("run", sort=False) if flagged[lines.index].any()]
    return pd.DataFrame(rows, columns=["run", "updates", "of", "steps"])


def _steps_text(steps: list[int], limit: int = 8) -> str:
    shown = ", ".join(map(str, steps[:limit]))
    return shown + (f" and {len(steps) - limit} more" if len(steps) > limit else "")


def no_rl_signal_markdown(table: pd.DataFrame) -> str:
    """The runs whose churn was, at some updates, not RL's: every group's rewards were equal there."""
    if table.empty:
        return ""
    lines = ["", "## Churn without RL signal", "",
             "At these updates every group's rewards were equal, so every advantage was zero and the objective gave "
             "no gradient: the routing churn logged there comes from the load-balancing loss alone (and the KL term "
             "when kl_coef > 0), and every objective would have made the same update (metric churn/no_rl_signal). "
             "Read those runs' churn as the router's drift without RL, not as an effect of the objective or the "
             "routing mode.", ""]
    lines += [f"- {row.run}: {row.updates} of {row.of} updates (rollout steps {_steps_text(row.steps)})"
              for row in table.itertuples()]
    return "\n".join([*lines, ""])


def skipped_markdown(skipped: list[str]) -> str:
    if not skipped:
        return ""
    return "\n".join(["", "## Panels left out", "", "Panels whose metric is 0 or missing in every run are not drawn:",
                      "", *[f"- {item}" for item in skipped], ""])


def learning_markdown(table: pd.DataFrame) -> str:
    """The report's first question: does held-out reward rise, by how much, and did any run collapse?"""
    if table.empty:
        return ""
    header = ["group", "runs", "held-out before RL", "held-out after RL", "gain [95% CI]", "learns", "collapsed",
              "diverged"]
    lines = ["## Does the policy learn?", "",
             "Held-out reward (`eval/reward`) at step 0 and after training, per group; the gain is each run's final "
             "minus start, mean and 95% CI over runs (Student t); `learns` means the CI lies above 0. A run collapsed "
             "if it diverged or its held-out reward fell below half its start and stayed there to the end "
             "(analysis/collapse.py).", "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for _, row in table.iterrows():
        # the baseline row (moe_rl.analysis.baseline.with_baseline): one measurement, no runs
        if pd.isna(row["n_runs"]):
            lines.append(f"| {row['group']} | | | {row['final']:.3f} +- {row['baseline_se']:.3f} (baseline) | | | | |")
            continue
        lines.append(f"| {row['group']} | {int(row['n_runs'])} | {row['start']:.3f} | {row['final']:.3f} | "
                     f"{with_ci(row['gain'], row['gain_ci_low'], row['gain_ci_high'])} | "
                     f"{'yes' if row['learns'] else 'no'} | {int(row['n_collapsed'])} | {int(row['n_diverged'])} |")
    return "\n".join(lines) + "\n\n"


PAIRED_LABELS = {"eval_gain": "held-out gain", "eval_final": "held-out after RL", "reward_final": "training reward"}


def _p(value: float) -> str:
    return "" if not math.isfinite(value) else ("<0.001" if value < 0.001 else f"{value:.3f}")


def paired_markdown(table: pd.DataFrame | None, margin: float) -> str:
    """The paired method comparisons (moe_rl.analysis.comparisons): one line per (metric, setting, pair of methods)."""
    if table is None or table.empty:
        return ""
    header = ["metric", "setting", "a - b", "pairs", "difference [95% CI]", "p", "p (Holm)", f"p TOST (+-{margin:g})",
              "MDD", "reading"]
    lines = ["## Paired comparisons of methods", "",
             "Runs of two methods with the same seed share their warm start and step-0 evaluation: each row is the "
             "mean over seeds of a - b with its 95% CI (paired t), the paired p-value, Holm's adjustment across the "
             f"rows of the metric, the TOST p-value of |difference| >= {margin:g} (small: equivalent within "
             "+-margin), and the minimum detectable difference (MDD: the true difference found with 80% power at "
             "level 0.05, at the observed spread). `reading`: a direction only where the Holm-adjusted p < 0.05, "
             "\"no difference\" only where TOST p < 0.05. `tables/paired_comparisons.csv` has every column.", "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in table.itertuples():
        lines.append(f"| {PAIRED_LABELS.get(r.metric, r.metric)} | {r.setting} | {r.a} - {r.b} | {r.n_pairs} | "
                     f"{with_ci(r.diff, r.ci_low, r.ci_high)} | {_p(r.p)} | {_p(r.p_holm)} | {_p(r.p_tost)} | "
                     f"{'' if not math.isfinite(r.mdd) else f'{r.mdd:.3g}'} | {r.reading} |")
    return "\n".join(lines) + "\n"


def baseline_section(baseline: dict | None, against: pd.DataFrame | None) -> str:
    """The baseline row (the warm start at its best temperature, and greedy) and each group against it."""
    if baseline is None:
        return ""
    from moe_rl.analysis.baseline import baseline_markdown

    lines = ["## Against the warm start's best", "",
             "RL that only sharpens the policy beats the warm start sampled at T = 1 but not the warm start at its "
             "own best temperature. The baseline: the warm start sampled at the temperature that scored best on the "
             "validation split (`moe-rl evaluate`), and greedy, on held-out prompts (+- SE over prompts):", "",
             baseline_markdown([baseline]).rstrip("\n"), "",
             "Per group, the final held-out accuracy minus the baseline's (sampled at the training temperature "
             "against the baseline at its best; greedy against greedy), mean over runs with a 95% CI that adds the "
             "seeds' spread and the baseline's SE in quadrature (analysis/baseline.py). `beats` means the CI lies "
             "above 0.", "",
             "| group | decoding | runs | after RL | baseline | difference [95% CI] | beats |",
             "|---|---|---|---|---|---|---|"]
    for r in (against if against is not None else pd.DataFrame()).itertuples():
        lines.append(f"| {r.group} | {r.decoding} | {r.n_runs} | {r.final:.3f} | {r.baseline:.3f} | "
                     f"{with_ci(r.diff, r.ci_low, r.ci_high)} | {'yes' if r.beats_baseline else 'no'} |")
    return "\n".join(lines) + "\n\n"
