"""Churn as an early warning (issue 54): does a per-update signal rise early in a run, before held-out accuracy
collapses, reliably enough for a practitioner to stop on? Each signal's threshold is fitted on one half of the runs
and its precision and recall are measured on the other half.

    moe-rl early-warning sweeps/routers sweeps/stability --out outputs/early_warning [--first-steps 5] [--min-lead 1]

writes
    <out>/early_warning.csv        one row per signal: the threshold fitted on the fit half, then on the test half
                                   alarms, hits, precision and recall with 95% Wilson intervals, and lead times
    <out>/early_warning_runs.csv   one row per (run, signal): half, collapsed, collapse step, the run's peak within
                                   the first K steps, its alarm step at the fitted threshold, lead, hit
    <out>/figures/early_warning.png  per signal, the per-step peak aligned to the collapse step, collapsed runs
                                   against the rest, with the fitted threshold

Definitions (fixed before any run was read; docs/analysis.md, "Early warning"):
- results only: finished or diverged runs (moe_rl.analysis.stability.RESULT_STATUSES); running, failed and
  interrupted runs are left out.
- collapsed: the stability map's decline rule (moe_rl.analysis.stability.run_changes): the mean of the last three
  held-out evaluations (`eval/reward`) minus the step-0 evaluation is below -2 x the noise floor
  sqrt(se_0^2 + mean(se_i^2) / 3); or the run diverged. Not collapsed: judged and not declined. A run with fewer
  than three evaluations after the start is not judged and is left out.
- collapse step: the first evaluation after step 0 below the decline line, start - 2 x floor (the line the mean of
  the last three crossed, so every declined run has one); for a diverged run, that or, if earlier or absent, the
  rollout step of its last line (the update that diverged). An evaluation at step s measures the policy before
  step s's updates, so the collapse happened in the updates of the steps since the previous evaluation: with
  evaluations every 5 steps the collapse step, and every lead time, is known to within 5 rollout steps.
- signal: a metric as logged per optimizer step (SIGNALS; rollout-level metrics repeat on each line of their step).
  The alarm at threshold T is the first rollout step t < K (K = --first-steps: the practitioner must stop early) at
  which some update logged a value >= T. Every candidate rises before a collapse, so only "above" alarms exist.
- lead: collapse step - alarm step, in rollout steps (x minibatches for updates). A hit is a collapsed run whose
  alarm leads by at least --min-lead steps. Precision = hits / runs alarmed: an alarm that comes too late to act on
  counts against it, as a false one does. Recall = hits / collapsed runs. Intervals: Wilson 95%.
- split: the fit half is the runs of even seed, the test half those of odd seed. A sweep's seeds are the replicates
  of each cell, so both halves hold every learning rate. The stability experiment trains seed s from warm start
  s mod warm_starts: with 1 or 3 warm starts both halves hold every warm start; with an even number the halves
  would be warm starts apart, and the split would test transfer to new warm starts as well.
- threshold: on the fit half, the value maximising F1 = 2 hits / (alarms + collapsed runs) among the runs' own
  peaks (the only values at which the counts change); on a tie the highest (the fewest alarms).

A signal that rises with the learning rate separates collapsed runs from the rest whenever collapses concentrate at
high learning rates, whether or not it says anything about a run at a given learning rate: the table's "learning
rate" row (the logged `lr` read as a signal) is that confound's own precision and recall, and
early_warning_runs.csv carries each run's `optim.lr`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import numpy as np
import pandas as pd
import tyro
from matplotlib.ticker import FuncFormatter, MaxNLocator
from scipy import stats

from moe_rl.analysis.load import load_runs
from moe_rl.analysis.panels import PERCENT, log_if_wide, percent_axis
from moe_rl.analysis.stability import FLOOR_SIGMAS, RESULT_STATUSES, run_changes
from moe_rl.analysis.style import OKABE_ITO, NarrowLogLocator, in_paper_style, new_figure, save
from moe_rl.errors import ConfigError, DataError

SIGNALS = {  # words -> the metric as logged (docs/metrics.md)
    "set change": "routing/update/set_change",
    "token-any churn": "routing/update/token_any",
    "k3 to the sampler": "rollout/kl",
    "clip fraction": "clip_ratio/region_mean",
    "grad norm": "grad_norm",
    "routing share of log w": "split/routing_share",
    "routing part of log w": "split/routing_abs_mean",
    # Not a signal but the confound: the logged lr reaches the run's optim.lr within the first steps (warmup: 10
    # updates), so its row is how well the learning rate alone tells the runs that collapse; a signal that does no
    # better carries nothing a practitioner did not know when choosing the learning rate.
    "learning rate": "lr",
}
# Not a candidate: the router margin, which `moe-rl probe` measures but `moe-rl train` does not log.
REFERENCE_SIGNAL = "grad norm"  # the bar: a routing signal must beat it to be worth a stop rule
CONFOUND = "learning rate"
CONFIDENCE = 0.95
TABLE_COLUMNS = ["signal", "metric", "first_steps", "min_lead", "threshold", "fit_runs", "fit_collapsed", "fit_alarms",
                 "fit_hits", "fit_f1", "test_runs", "test_collapsed", "test_alarms", "test_hits", "precision",
                 "precision_ci_low", "precision_ci_high", "recall", "recall_ci_low", "recall_ci_high", "f1",
                 "lead_median", "lead_min", "lead_max"]


# ---------------------------------------------------------------------------------------------------------------------
# Labels: which runs collapsed, and when


def collapse_labels(runs: pd.DataFrame, steps: pd.DataFrame) -> pd.DataFrame:
    """One row per judged result run: run, seed, half, status, collapsed, collapse_step, start, floor (the module
    docstring's definitions). `runs` and `steps`: moe_rl.analysis.load's frames."""
    evals = steps.dropna(subset=["eval/reward"])
    evals = evals[[c for c in ("run", "step", "eval/reward", "eval/reward_se") if c in evals]]
    changes = run_changes(evals).set_index("run")
    rows = []
    for info in runs.itertuples():
        if info.status not in RESULT_STATUSES or info.run not in changes.index:
            continue
        change = changes.loc[info.run]
        diverged = info.status == "diverged"
        if not diverged and not math.isfinite(change["declined"]):
            continue  # fewer than three evaluations after the start: not judged
        collapsed = diverged or bool(change["declined"])
        at = _first_below(evals[evals["run"] == info.run], change["start"] - FLOOR_SIGMAS * change["floor"])
        if diverged:  # NaN (no line: too few evaluations) or after the divergence: the step that diverged
            at = min(at, _last_step(steps, info.run)) if math.isfinite(at) else _last_step(steps, info.run)
        rows.append({"run": info.run, "seed": info.seed, "half": half_of(info.seed), "status": info.status,
                     "collapsed": collapsed, "collapse_step": at if collapsed else math.nan,
                     "start": change["start"], "floor": change["floor"]})
    return pd.DataFrame(rows, columns=["run", "seed", "half", "status", "collapsed", "collapse_step", "start",
                                       "floor"])


def half_of(seed) -> str:
    """'fit' for an even seed, 'test' for an odd one (the split rule of the module docstring)."""
    return "fit" if int(seed) % 2 == 0 else "test"


def _first_below(evals: pd.DataFrame, line: float) -> float:
    after = evals[(evals["step"] > 0) & (evals["eval/reward"] < line)]
    return float(after["step"].min()) if len(after) else math.nan


def _last_step(steps: pd.DataFrame, run: str) -> float:
    return float(steps.loc[steps["run"] == run, "step"].max())


# ---------------------------------------------------------------------------------------------------------------------
# Alarms, thresholds, precision and recall


def step_peaks(metrics: pd.DataFrame, metric: str) -> pd.DataFrame:
    """run, step, peak: the largest value `metric` took on the step's optimizer-step lines (NaN lines skipped)."""
    if metric not in metrics:
        return pd.DataFrame(columns=["run", "step", "peak"])
    lines = metrics[["run", "step", metric]].dropna()
    return lines.groupby(["run", "step"], as_index=False)[metric].max().rename(columns={metric: "peak"})


def run_peaks(peaks: pd.DataFrame, labels: pd.DataFrame, first_steps: int, min_lead: int) -> pd.DataFrame:
    """labels joined with two peaks per run: `peak` within the first `first_steps` rollout steps (an alarm at T fires
    iff peak >= T), and `peak_in_time`, within those steps and at least `min_lead` before the collapse step (a
    collapsed run is a hit at T iff peak_in_time >= T; NaN for the others). Runs that never logged the metric within
    the first steps are left out."""
    window = peaks[peaks["step"] < first_steps].merge(labels[["run", "collapse_step"]], on="run")
    in_time = window[window["step"] <= window["collapse_step"] - min_lead]
    frame = labels.merge(window.groupby("run")["peak"].max().rename("peak"), left_on="run", right_index=True)
    return frame.merge(in_time.groupby("run")["peak"].max().rename("peak_in_time"), left_on="run", right_index=True,
                       how="left")


def counts(frame: pd.DataFrame, threshold: float) -> dict[str, int]:
    """runs, collapsed, alarms (peak >= threshold) and hits (collapsed, peak_in_time >= threshold) of run_peaks rows."""
    hits = frame["collapsed"] & (frame["peak_in_time"] >= threshold)
    return {"runs": len(frame), "collapsed": int(frame["collapsed"].sum()),
            "alarms": int((frame["peak"] >= threshold).sum()), "hits": int(hits.sum())}


def f1(n: dict[str, int]) -> float:
    """2 hits / (alarms + collapsed): the harmonic mean of precision and recall; NaN with neither."""
    total = n["alarms"] + n["collapsed"]
    return 2 * n["hits"] / total if total else math.nan


def fit_threshold(fit: pd.DataFrame) -> float:
    """The threshold of best F1 on the fit runs among their peaks, the highest on a tie; NaN without a collapsed
    fit run (nothing to warn of)."""
    if not fit["collapsed"].any():
        return math.nan
    candidates = np.unique(np.concatenate([fit["peak"].to_numpy(float), fit["peak_in_time"].to_numpy(float)]))
    candidates = candidates[np.isfinite(candidates)]
    if not len(candidates):
        return math.nan
    scores = [f1(counts(fit, t)) for t in candidates]
    best = max(scores)
    return float(max(t for t, score in zip(candidates, scores) if score == best))


def wilson(successes: float, trials: float, confidence: float = CONFIDENCE) -> tuple[float, float]:
    """The Wilson score interval of a proportion (scipy's binomtest); NaNs for no trials (or NaN counts)."""
    if not trials or not math.isfinite(trials):
        return math.nan, math.nan
    ci = stats.binomtest(int(successes), int(trials)).proportion_ci(confidence, method="wilson")
    return float(ci.low), float(ci.high)


def alarm_steps(peaks: pd.DataFrame, threshold: float, first_steps: int) -> pd.Series:
    """run -> the first rollout step < first_steps at which the signal reached `threshold` (runs without an alarm
    are absent)."""
    alarmed = peaks[(peaks["step"] < first_steps) & (peaks["peak"] >= threshold)]
    return alarmed.groupby("run")["step"].min().astype(float)


def signal_reading(name: str, metric: str, peaks: pd.DataFrame, labels: pd.DataFrame, first_steps: int,
                   min_lead: int) -> tuple[dict, pd.DataFrame]:
    """One row of early_warning.csv (TABLE_COLUMNS) and the signal's rows of early_warning_runs.csv. Without a
    collapsed fit run there is no threshold, and the test half's readings are NaN."""
    frame = run_peaks(peaks, labels, first_steps, min_lead)
    fit, test = frame[frame["half"] == "fit"], frame[frame["half"] == "test"]
    threshold = fit_threshold(fit)
    frame = frame.assign(signal=name, alarm_step=frame["run"].map(alarm_steps(peaks, threshold, first_steps)))
    frame["lead"] = frame["collapse_step"] - frame["alarm_step"]
    frame["hit"] = frame["collapsed"] & (frame["peak_in_time"] >= threshold)
    on_fit, on_test = counts(fit, threshold), counts(test, threshold)
    precision, recall = wilson(on_test["hits"], on_test["alarms"]), wilson(on_test["hits"], on_test["collapsed"])
    if not math.isfinite(threshold):
        on_test = {k: (v if k in ("runs", "collapsed") else math.nan) for k, v in on_test.items()}
    leads = frame.loc[(frame["half"] == "test") & frame["hit"], "lead"]
    row = {"signal": name, "metric": metric, "first_steps": first_steps, "min_lead": min_lead,
           "threshold": threshold, **{f"fit_{k}": v for k, v in on_fit.items()}, "fit_f1": f1(on_fit),
           **{f"test_{k}": v for k, v in on_test.items()},
           "precision": _share(on_test["hits"], on_test["alarms"]), "precision_ci_low": precision[0],
           "precision_ci_high": precision[1], "recall": _share(on_test["hits"], on_test["collapsed"]),
           "recall_ci_low": recall[0], "recall_ci_high": recall[1], "f1": f1(on_test),
           "lead_median": leads.median(), "lead_min": leads.min(), "lead_max": leads.max()}
    return row, frame


def _share(part: float, whole: float) -> float:
    return part / whole if whole else math.nan


def early_warning_tables(metrics: pd.DataFrame, labels: pd.DataFrame, first_steps: int = 5, min_lead: int = 1,
                         signals: dict[str, str] = SIGNALS) -> tuple[pd.DataFrame, pd.DataFrame]:
    """early_warning.csv (one row per signal logged by some run) and early_warning_runs.csv (one row per run and
    signal). `metrics`: one row per optimizer step (moe_rl.analysis.load's `metrics`); `labels`: collapse_labels."""
    rows, per_run = [], []
    for name, metric in signals.items():
        peaks = step_peaks(metrics, metric)
        if peaks.empty:
            continue
        row, frame = signal_reading(name, metric, peaks, labels, first_steps, min_lead)
        rows.append(row)
        per_run.append(frame)
    run_columns = ["signal", "run", "seed", "half", "status", "collapsed", "collapse_step", "peak", "alarm_step",
                   "lead", "hit"]
    runs = pd.concat(per_run, ignore_index=True)[run_columns] if per_run else pd.DataFrame(columns=run_columns)
    return pd.DataFrame(rows, columns=TABLE_COLUMNS), runs


def verdict(table: pd.DataFrame) -> str:
    """One line: the signal of best F1 on the test half, and whether it beats grad norm there (or that none does);
    then the learning rate's own F1, the confound, where it was read."""
    tested = table.dropna(subset=["f1"])
    confound = tested[tested["signal"] == CONFOUND]
    tested = tested[tested["signal"] != CONFOUND]
    if tested.empty:
        return "no signal could be tested (no collapsed run in the fit half, or none in the test half)"
    best = tested.loc[tested["f1"].idxmax()]
    reference = tested[tested["signal"] == REFERENCE_SIGNAL]
    if reference.empty:
        line = f"best on the test half: {best['signal']} (F1 {best['f1']:.2f}); grad norm was not logged"
    elif best["signal"] == REFERENCE_SIGNAL or best["f1"] <= float(reference["f1"].iloc[0]):
        line = f"no signal beats grad norm on the test half (grad norm F1 {float(reference['f1'].iloc[0]):.2f})"
    else:
        line = (f"best on the test half: {best['signal']} (F1 {best['f1']:.2f}) against grad norm's "
                f"{float(reference['f1'].iloc[0]):.2f}")
    return line + (f"; the learning rate alone: F1 {float(confound['f1'].iloc[0]):.2f}" if len(confound) else "")


# ---------------------------------------------------------------------------------------------------------------------
# The figure


@in_paper_style
def fig_early_warning(metrics: pd.DataFrame, labels: pd.DataFrame, table: pd.DataFrame):
    """Per signal, the per-step peak against rollout steps from the collapse step: the median over collapsed runs
    and over the rest (aligned at the collapsed runs' median collapse step, having none of their own), bands between
    the quartiles, the fitted threshold dashed."""
    n = len(table)
    cols = min(3, n)
    fig, axes = new_figure(math.ceil(n / cols), cols, row_height=2.2)
    origin = labels.loc[labels["collapsed"], "collapse_step"].median()
    for ax, row in zip(axes.flat, table.itertuples()):
        _signal_panel(ax, step_peaks(metrics, row.metric), labels, row, origin)
    for ax in list(axes.flat)[n:]:
        ax.set_visible(False)
    handles, names = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, names, loc="outside lower center", ncols=3)
    return fig


def _signal_panel(ax, peaks: pd.DataFrame, labels: pd.DataFrame, row, origin: float) -> None:
    peaks = peaks.merge(labels[["run", "collapsed", "collapse_step"]], on="run")
    peaks["x"] = peaks["step"] - peaks["collapse_step"].fillna(origin)
    for collapsed, color in ((True, OKABE_ITO[1]), (False, OKABE_ITO[0])):
        runs = int((labels["collapsed"] == collapsed).sum())
        label = f"collapsed ({runs})" if collapsed else f"not collapsed ({runs}; at the median collapse step)"
        _median_band(ax, peaks[peaks["collapsed"] == collapsed], color, label)
    if math.isfinite(row.threshold):
        ax.axhline(row.threshold, color="0.3", linestyle="--", linewidth=0.8, label="fitted threshold")
    ax.axvline(0.0, color="0.6", linewidth=0.7)
    if (peaks["peak"] > 0).all() and log_if_wide(ax, "y", peaks["peak"]):  # grad norm, k3 KL: heavy-tailed
        ax.yaxis.set_major_locator(NarrowLogLocator())
    if row.metric in PERCENT:
        percent_axis(ax.yaxis)
    elif ax.yaxis.get_scale() == "log":
        ax.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    ax.set_title(row.signal)
    ax.set_ylabel(f"{row.metric}\n(peak of the step's updates)")
    ax.set_xlabel("rollout steps from collapse")
    ax.xaxis.set_major_locator(MaxNLocator(nbins=5, integer=True))


def _median_band(ax, peaks: pd.DataFrame, color: str, label: str) -> None:
    if peaks.empty:
        return
    quartiles = peaks.groupby("x")["peak"].quantile([0.25, 0.5, 0.75]).unstack()
    ax.plot(quartiles.index, quartiles[0.5], color=color, label=label)
    ax.fill_between(quartiles.index, quartiles[0.25], quartiles[0.75], color=color, alpha=0.2, linewidth=0)


# ---------------------------------------------------------------------------------------------------------------------
# The command


@dataclass
class EarlyWarningConfig:
    """Which per-update signal warns of a held-out collapse: thresholds fitted on even seeds, tested on odd ones."""

    runs: Annotated[tuple[str, ...], tyro.conf.Positional, tyro.conf.arg(metavar="RUNS [RUNS ...]")] = ()
    """Run directories, folders of runs or sweep directories (read, never written)."""
    out: str = ""
    """Output folder (early_warning.csv, early_warning_runs.csv, figures/early_warning.png); required."""
    first_steps: int = 5
    """K: alarms count only within rollout steps 0 .. K-1 (5: before the first evaluation after the start when
    log.eval_every is 5)."""
    min_lead: int = 1
    """A collapsed run's alarm counts as a hit only this many rollout steps or more before its collapse step."""

    def __post_init__(self) -> None:
        if not self.runs:
            raise ConfigError("give one or more run folders or sweep directories (RUNS)")
        if not self.out.strip():
            raise ConfigError("--out is required: the folder for early_warning.csv and its figure")
        if self.first_steps < 1 or self.min_lead < 0:
            raise ConfigError(f"first_steps={self.first_steps} must be >= 1 and min_lead={self.min_lead} >= 0")


def load_frames(roots: tuple[str, ...]) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """(runs, metrics, steps) of every root (moe_rl.analysis.load), runs named `<root folder>/<run>` when several
    roots are read, so that two sweeps' runs of the same name stay apart."""
    frames: list[list[pd.DataFrame]] = [[], [], []]
    for root in roots:
        data = load_runs(root)
        for i, frame in enumerate((data.runs, data.metrics, data.steps)):
            frame = frame.copy()
            if len(roots) > 1:
                frame["run"] = Path(root).name + "/" + frame["run"].astype(str)
            frames[i].append(frame)
    runs, metrics, steps = (pd.concat(f, ignore_index=True) for f in frames)
    if runs["run"].duplicated().any():
        raise DataError("two run folders share a name: give each sweep once")
    return runs, metrics, steps


def early_warning(cfg: EarlyWarningConfig) -> Path:
    """`moe-rl early-warning`: the two tables and the figure into --out; prints the table and one line of verdict."""
    runs, metrics, steps = load_frames(cfg.runs)
    if "eval/reward" not in steps:
        raise DataError("no run logged a held-out evaluation (eval/reward): run with --log.eval-every")
    labels = collapse_labels(runs, steps)
    table, per_run = early_warning_tables(metrics, labels, cfg.first_steps, cfg.min_lead)
    per_run = per_run.merge(runs[["run", "optim.lr"]], on="run", how="left") if "optim.lr" in runs else per_run
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    table.to_csv(out / "early_warning.csv", index=False)
    per_run.to_csv(out / "early_warning_runs.csv", index=False)
    if len(table) and labels["collapsed"].any():
        save(fig_early_warning(metrics, labels, table), out / "figures", "early_warning")
    print(summary_text(labels, table, cfg))
    return out


def summary_text(labels: pd.DataFrame, table: pd.DataFrame, cfg: EarlyWarningConfig) -> str:
    """What the command prints: the runs by half and label, one line per signal, the verdict."""
    lines = [f"moe-rl early-warning: {len(labels)} judged runs; collapsed "
             f"{int(labels.loc[labels['half'] == 'fit', 'collapsed'].sum())}/{int((labels['half'] == 'fit').sum())} "
             f"(fit, even seeds), {int(labels.loc[labels['half'] == 'test', 'collapsed'].sum())}/"
             f"{int((labels['half'] == 'test').sum())} (test, odd seeds); alarms within the first {cfg.first_steps} "
             f"steps, at least {cfg.min_lead} before the collapse"]
    for r in table.itertuples():
        if not math.isfinite(r.threshold):
            lines.append(f"  {r.signal:<24} no threshold: no collapsed run in the fit half logged it")
            continue
        lines.append(f"  {r.signal:<24} threshold {r.threshold:<10.4g} fit F1 {r.fit_f1:.2f}  test: "
                     f"precision {r.test_hits}/{r.test_alarms} [{r.precision_ci_low:.2f}, {r.precision_ci_high:.2f}]  "
                     f"recall {r.test_hits}/{r.test_collapsed} [{r.recall_ci_low:.2f}, {r.recall_ci_high:.2f}]  "
                     f"median lead {r.lead_median:g} steps")
    test = labels[labels["half"] == "test"]
    collapsed = int(test["collapsed"].sum())
    if collapsed:  # the floor every signal must clear: a signal that never moves alarms on every run
        lines.append(f"  (alarming on every test run: precision {collapsed}/{len(test)}, recall 1, F1 "
                     f"{2 * collapsed / (len(test) + collapsed):.2f})")
    lines.append(verdict(table) + f" -> {cfg.out}")
    return "\n".join(lines)
