"""The stability map of a `stability` sweep (experiments/stability.py): per method and per cell of one axis (the
learning rate at fixed staleness, or the minibatches per rollout batch at a fixed learning rate), how held-out
accuracy changed, how often it declined, and how far each update moved the policy.

    moe-rl stability sweeps/stability --out results/stability [--baseline .../evaluate]
    moe-rl stability --pool results/stability/lr_1 results/stability/lr_2 --out results/stability

The first writes the generic report (moe_rl.analysis.report, with per-run tables) and, beside it, the map below; the
second makes the map alone from report folders' committed per-run tables (sittings whose sweep folders are gone):

    tables/stability_cells.csv   per axis, method and axis value: n_seeds, change (mean, 95% t CI), n_declined,
                                 n_learned, n_judged, decline_prob, greedy_change (mean, CI), kl_median (mean over
                                 seeds of each run's median update/kl), set_change and churn (routing change per
                                 update)
    tables/critical.csv          per axis and method: the axis value where the mean change turns negative, with
                                 its 95% CI (moe_rl.analysis.stats.critical_point, t inversion over seeds)
    tables/kl_matched.csv        each axis read at matched per-update KL: per axis, method and KL point, the
                                 change (mean, CI over seeds) and its paired difference from the reference method
                                 (GRPO, native routing), with Holm's adjustment within the axis
    tables/paired_cells.csv      every method against GRPO native in every cell, paired by seed, per endpoint
                                 (T = 1 and greedy change): difference, CI, Holm p, TOST p at MARGIN, verdict
    tables/paired_mdd.csv        per axis and endpoint: the minimum detectable paired difference
    figures/stability_map.png/.pdf
    figures/change_vs_step.png/.pdf   the lr axis's runs: held-out change against set change and KL per update
    STABILITY.md                 the tables above in words, with the definitions (analysis/stability_text.py)

Definitions (also in docs/analysis.md, "The stability map"):
- change: the mean of a run's last three held-out evaluations (`eval/reward`, sampled at T = 1) minus its step-0
  evaluation; three points, not one, so that one noisy evaluation neither makes nor hides a decline. greedy
  change: the same of `eval/greedy`.
- declined: that change is below -2 x its noise floor, sqrt(se_0^2 + mean(se_i^2) / 3), with se the logged
  `eval/reward_se` of each evaluation (binomial over prompts): the measured noise of one evaluation, not a fixed
  fraction of the start. A run with fewer than three evaluations after the start is not judged (NaN).
- learned: that change is above +2 x the same noise floor. Near a start at the noise floor (the length
  generalisation regime starts at 0.002-0.009) a collapse to 0 can stay above the decline line; a run that neither
  learned nor declined did nothing measurable (results/stability/PROTOCOL.md, second sitting).
- results only: runs still running, failed or interrupted are left out; a diverged run (non-finite loss or
  gradients, docs/metrics.md) declined, with change = 0 - start.
- critical value: where the seed-mean change crosses zero along the axis (log-linear interpolation), with the
  t-inversion CI; -inf / inf when the crossing lies below / above the grid.
- KL-matched: along each axis, each seed's change is interpolated, in log per-update KL, at KL points inside the
  range every method run at two or more values covers on that axis (a method at one value has no curve and takes
  no part); a method "more stable" at matched KL gains more for the same step in policy
  space, which "takes smaller steps" cannot explain.
- paired: a method and GRPO native with the same seed share the warm start and the step-0 evaluation, so their
  difference is taken per seed (paired t), Holm-adjusted across the pairs of one axis and endpoint; "equivalent"
  only from TOST at +-MARGIN, fixed before the runs (results/stability/PROTOCOL.md). A verdict needs 3 seeds or
  more: with 2, the pair's p-values are reported and its verdict is "too few seeds".
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import numpy as np
import pandas as pd
import tyro
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

from moe_rl.analysis.aggregate import summarize
from moe_rl.analysis.sittings import source_name, source_table
from moe_rl.analysis.stability_terms import AXES, MARGIN, REFERENCE
from moe_rl.analysis.stats import ALPHA, critical_point, holm, mdd_paired, paired_t, tost_p
from moe_rl.analysis.style import group_looks, in_paper_style, new_figure, save
from moe_rl.errors import ConfigError, DataError

METHOD_COLUMNS = ("objective.name", "routing_mode", "correction.is_level", "correction.is_cap", "correction.is_band")
LAST_EVALUATIONS = 3
FLOOR_SIGMAS = 2.0
# A verdict (better, worse, equivalent) rests on at least 3 seeds. With 2 the paired t has one degree of freedom and
# its sd is one difference of two numbers: accuracies on a finite prompt set are discrete, so two seeds can give the
# same difference by chance, and sd 0 reads as p = 0 (the staleness axis's first 2-seed table had one such "better").
MIN_PAIRS_FOR_VERDICT = 3
RESULT_STATUSES = ("finished", "diverged")  # moe_rl.runs.claim: the ways a run ends as a result
CELL_COLUMNS = ["axis", "method", "value", "n_seeds", "change", "change_ci_low", "change_ci_high", "n_declined",
                "n_learned", "n_judged", "decline_prob", "greedy_change", "greedy_change_ci_low",
                "greedy_change_ci_high",
                "kl_median", "set_change", "churn", "reward_gain"]
PAIRED_COLUMNS = ["axis", "endpoint", "value", "method", "n_pairs", "diff", "diff_ci_low", "diff_ci_high", "p",
                  "p_holm", "tost_p", "tost_p_holm", "verdict", "reference_ci_high", "rescue"]


def method_name(row) -> str:
    """'grpo native', 'grpo R2', 'gspo native', 'grpo native TIS cap 2', 'grpo native IcePop [0.5, 2]'."""
    name = f"{row.get('objective.name', 'grpo')} {row.get('routing_mode', 'native')}"
    level = row.get("correction.is_level")
    if isinstance(level, str) and level != "none":
        band, cap = row.get("correction.is_band"), row.get("correction.is_cap")
        if _present(band):
            low, high = band if not isinstance(band, str) else band.strip("[]()").split(",")
            name += f" IcePop [{float(low):g}, {float(high):g}]"
        elif _present(cap):
            name += f" TIS cap {float(cap):g}"
        if level != "token":
            name += f" ({level})"
    return name


def _present(value) -> bool:
    if value is None:
        return False
    if isinstance(value, float):
        return math.isfinite(value)
    return not (isinstance(value, str) and value in ("", "None", "nan"))


ENDPOINTS = {"change": ("eval/reward", "eval/reward_se"), "greedy_change": ("eval/greedy", "eval/greedy_se")}
"""Per-run change columns and the evaluation metric (with its standard error) each is read from: sampled at T = 1
(the primary endpoint) and greedy."""
CHANGE_COLUMNS = ["run", "n_after", "start", "change", "floor", "declined", "learned", "greedy_start",
                  "greedy_change", "greedy_floor", "greedy_declined", "greedy_learned"]


def run_changes(per_eval: pd.DataFrame) -> pd.DataFrame:
    """One row per run: run, n_after (evaluations after step 0), then per endpoint of ENDPOINTS (the greedy one's
    columns prefixed `greedy_`) start, change, floor, declined and learned: NaN where a run has fewer than
    LAST_EVALUATIONS evaluations of that metric after the start. `per_eval`: moe_rl.analysis.per_run.per_run_eval."""
    rows = []
    for run, evals in per_eval.sort_values("step").groupby("run", sort=False):
        primary = evals.dropna(subset=["eval/reward"]) if "eval/reward" in evals else evals.iloc[:0]
        row = {"run": run, "n_after": int((primary["step"] > 0).sum())}
        for endpoint, (metric, se_metric) in ENDPOINTS.items():
            prefix = endpoint.removesuffix("change")
            row.update({prefix + key: value for key, value in _endpoint_change(evals, metric, se_metric).items()})
        rows.append(row)
    return pd.DataFrame(rows, columns=CHANGE_COLUMNS)


def _endpoint_change(evals: pd.DataFrame, metric: str, se_metric: str) -> dict:
    """start, change, floor, declined and learned of one run's evaluations of `metric` (see the module docstring);
    start wherever the run has its step-0 evaluation."""
    out = {"start": math.nan, "change": math.nan, "floor": math.nan, "declined": math.nan, "learned": math.nan}
    if metric not in evals:
        return out
    evals = evals.dropna(subset=[metric])
    start, after = evals[evals["step"] == 0], evals[evals["step"] > 0]
    if len(start):
        out["start"] = float(start[metric].iloc[0])
    if not len(start) or len(after) < LAST_EVALUATIONS:
        return out
    last = after.tail(LAST_EVALUATIONS)
    se = evals[se_metric] if se_metric in evals else pd.Series(math.nan, index=evals.index)
    floor = math.sqrt(float(se.loc[start.index[0]]) ** 2 + float((se.loc[last.index] ** 2).mean()) / LAST_EVALUATIONS)
    change = float(last[metric].mean() - start[metric].iloc[0])
    judged = math.isfinite(floor)
    out.update(change=change, floor=floor, declined=float(change < -FLOOR_SIGMAS * floor) if judged else math.nan,
               learned=float(change > FLOOR_SIGMAS * floor) if judged else math.nan)
    return out


def with_configs(per_run: pd.DataFrame, runs: pd.DataFrame) -> pd.DataFrame:
    """per_run with the method and axis fields of each run's config (the report's runs.csv) in place of its own: the
    generic report keeps only the fields that vary among the runs it grouped, which leaves out a field that one
    method sets (the corrections) while only some runs have finished."""
    fields = [c for c in (*METHOD_COLUMNS, *AXES) if c in runs]
    return per_run.drop(columns=[c for c in fields if c in per_run]).merge(runs[["run", *fields]], on="run",
                                                                             how="left")


def with_methods(per_run: pd.DataFrame, per_eval: pd.DataFrame) -> pd.DataFrame:
    """per_run (moe_rl.analysis.per_run.per_run_final) with `method` and run_changes' columns joined on `run`, results
    only: a run still running, failed or interrupted (`status`, where the table has it) is left out. A diverged run is a
    result: it declined (and did not learn), and its changes are 0 minus its start (a policy with non-finite weights
    solves nothing), so that an lr which blows a run up counts against the method instead of leaving the cell."""
    frame = per_run.copy()
    if "status" in frame:
        frame = frame[frame["status"].isin(RESULT_STATUSES)]
    frame["method"] = [method_name(row) for _, row in frame.iterrows()]
    frame = frame.merge(run_changes(per_eval), on="run", how="left")
    if "status" in frame:
        diverged = frame["status"] == "diverged"
        for prefix in ("", "greedy_"):
            frame.loc[diverged, prefix + "change"] = -frame.loc[diverged, prefix + "start"]
            frame.loc[diverged, prefix + "declined"] = 1.0
            frame.loc[diverged, prefix + "learned"] = 0.0
    return frame.reset_index(drop=True)


def drop_repeats(frame: pd.DataFrame) -> tuple[pd.DataFrame, int]:
    """The frame with one run per (method, axis values, seed), the first, and how many repeats were dropped. The
    two axes share a cell, so an lr sweep and a staleness sweep read together hold that cell's runs twice; a repeat
    whose change differs from the kept run's is an error (the two were not the same run)."""
    key = ["method", *[a for a in AXES if a in frame], "seed"]
    repeated = frame.duplicated(subset=key, keep="first")
    if repeated.any():
        kept = frame[~repeated].set_index(key)["change"]
        again = frame[repeated].set_index(key)["change"]
        differs = ~np.isclose(again.to_numpy(float), kept.loc[again.index].to_numpy(float), equal_nan=True)
        if differs.any():
            raise DataError(f"runs repeat a cell with a different held-out change: {list(again.index[differs])}; "
                             "read one sweep at a time, or check what differs between them")
    return frame[~repeated].reset_index(drop=True), int(repeated.sum())


PER_RUN_TABLES = ("per_run_final", "per_run_eval", "runs")
"""The generic report's per-run tables (moe_rl.analysis.report) the map is computed from: what results/ commits."""


def pooled_frame(folders: list[Path | str]) -> tuple[pd.DataFrame, int]:
    """The map's frame (with_methods: one row per run with its method, axis values, seed and changes) from the
    per-run tables of one or more sources: report folders, or sittings of a folded study written
    `<study>@<sitting>` (moe_rl.analysis.sittings), and how many repeats drop_repeats left out. With several
    sources (sittings of one sweep whose sweep folders are gone, or an lr and a staleness sweep) each run is named
    `<folder or sitting>/<run>`, so that runs of the same name in two sittings stay apart; a run of the same method,
    cell and seed in two sources counts once, and only if their held-out changes agree."""
    names = [source_name(folder) for folder in folders]
    if len(set(names)) < len(names):
        raise DataError(f"report folders to pool share a name ({', '.join(names)}): the runs' names would collide")
    per_run, per_eval = [], []
    for folder, name in zip(folders, names):
        final, evals, runs = (source_table(folder, table) for table in PER_RUN_TABLES)
        if len(folders) > 1:
            for table in (final, evals, runs):
                table["run"] = name + "/" + table["run"].astype(str)
        per_run.append(with_configs(final, runs))
        per_eval.append(evals)
    return drop_repeats(with_methods(pd.concat(per_run, ignore_index=True), pd.concat(per_eval, ignore_index=True)))


def axis_runs(frame: pd.DataFrame, axis: str, fixed: dict) -> pd.DataFrame:
    """The runs of one axis: every other key of `fixed` at its fixed value (a key the table lacks did not vary: every
    run has it)."""
    keep = np.ones(len(frame), dtype=bool)
    for key, value in fixed.items():
        if key != axis and key in frame:
            keep &= np.isclose(frame[key].astype(float), float(value))
    return frame[keep]


def swept_axes(frame: pd.DataFrame, fixed: dict) -> list[str]:
    """The keys of `fixed` that take two or more values among their axis's runs. Where none does, a folder of one
    cell off the fixed point (one learning rate at the fixed staleness, a sitting analysed on its own) is read as
    that one cell of its axis; the fixed point's own cell lies on both axes and is read only as part of one."""
    values = {axis: axis_runs(frame, axis, fixed)[axis].astype(float) for axis in fixed if axis in frame}
    swept = [axis for axis, v in values.items() if v.nunique() >= 2]
    if swept:
        return swept
    return [axis for axis, v in values.items() if len(v) and not np.isclose(v, float(fixed[axis])).any()]


def stability_cells(frame: pd.DataFrame, fixed: dict) -> pd.DataFrame:
    """CELL_COLUMNS, per swept axis of `fixed` (its keys), method and axis value. set_change and churn: the seed
    mean of each run's mean routing change per update; reward_gain: of its training reward's gain (the secondary
    endpoint; moe_rl.analysis.cells); NaN where the runs did not log them."""
    rows = []
    for axis in swept_axes(frame, fixed):
        for (method, value), runs in axis_runs(frame, axis, fixed).groupby(["method", axis], sort=True):
            change, greedy = summarize(runs["change"]), summarize(runs.get("greedy_change", pd.Series(dtype=float)))
            judged = runs["declined"].dropna()
            # n_seeds: runs with a change (a run still before its third evaluation after the start has none)
            rows.append({"axis": axis, "method": method, "value": float(value), "n_seeds": change["n"],
                         "change": change["mean"], "change_ci_low": change["ci_low"],
                         "change_ci_high": change["ci_high"], "n_declined": int(judged.sum()),
                         "n_learned": int(runs.loc[judged.index, "learned"].sum()) if "learned" in runs else 0,
                         "n_judged": len(judged), "decline_prob": judged.mean() if len(judged) else math.nan,
                         "greedy_change": greedy["mean"], "greedy_change_ci_low": greedy["ci_low"],
                         "greedy_change_ci_high": greedy["ci_high"],
                         **{column: runs[column].mean() if column in runs else math.nan
                            for column in ("kl_median", "set_change", "churn", "reward_gain")}})
    return pd.DataFrame(rows, columns=CELL_COLUMNS)


def paired_cells(frame: pd.DataFrame, fixed: dict, reference: str = REFERENCE, margin: float = MARGIN) -> pd.DataFrame:
    """Every method against `reference` in every cell of each swept axis, paired by seed, per endpoint (the T = 1
    change and the greedy change): the mean paired difference with its t CI and p, Holm's adjustment across the
    pairs of one axis and endpoint, TOST at +-`margin` (Holm-adjusted the same way), and a verdict: "better" or
    "worse" (Holm p < 0.05), "equivalent" (TOST Holm p < 0.05), else "undecided"; "too few seeds" below
    MIN_PAIRS_FOR_VERDICT pairs, "untested" below 2. `rescue`: the reference's change
    in that cell has a 95% CI below 0 and the method is "better" there (results/stability/PROTOCOL.md)."""
    rows = []
    for axis in swept_axes(frame, fixed):
        runs = axis_runs(frame, axis, fixed)
        for endpoint in ENDPOINTS:
            if endpoint not in runs:
                continue
            block = []
            for value, cell in runs.groupby(axis, sort=True):
                by_method = {m: r.dropna(subset=[endpoint]).set_index("seed")[endpoint]
                             for m, r in cell.groupby("method")}
                base = by_method.get(reference)
                if base is None:
                    continue
                reference_ci_high = summarize(base)["ci_high"]
                for method in sorted(set(by_method) - {reference}):
                    seeds = sorted(set(by_method[method].index) & set(base.index))
                    row = {"axis": axis, "endpoint": endpoint, "value": float(value), "method": method,
                           "n_pairs": len(seeds), "reference_ci_high": reference_ci_high}
                    if len(seeds) >= 2:
                        a, b = by_method[method].loc[seeds].to_numpy(float), base.loc[seeds].to_numpy(float)
                        diff = paired_t(a, b)
                        row.update(diff=diff.mean_diff, diff_ci_low=diff.ci_low, diff_ci_high=diff.ci_high,
                                   p=diff.p, tost_p=tost_p(diff, margin))
                    block.append(row)
            table = pd.DataFrame(block, columns=PAIRED_COLUMNS)
            for column in ("p", "tost_p"):
                tested = table[column].notna()
                table.loc[tested, column + "_holm"] = holm(table.loc[tested, column].to_numpy(dtype=float))
            table["verdict"] = [_verdict(r) for r in table.itertuples()]
            table["rescue"] = (table["verdict"] == "better") & (table["reference_ci_high"] < 0)
            rows.append(table)
    return pd.concat(rows, ignore_index=True) if rows else pd.DataFrame(columns=PAIRED_COLUMNS)


def _verdict(row) -> str:
    if not math.isfinite(row.p_holm):
        return "untested"
    if row.n_pairs < MIN_PAIRS_FOR_VERDICT:
        return "too few seeds"
    if row.p_holm < ALPHA:
        return "better" if row.diff > 0 else "worse"
    if math.isfinite(row.tost_p_holm) and row.tost_p_holm < ALPHA:
        return "equivalent"
    return "undecided"


def paired_mdd(frame: pd.DataFrame, fixed: dict, reference: str = REFERENCE) -> pd.DataFrame:
    """Per axis and endpoint: the minimum detectable paired difference (80% power, alpha 0.05, paired t) at the
    median number of pairs, from the pooled sd of the paired differences over every (cell, method) with >= 2."""
    rows = []
    for axis in swept_axes(frame, fixed):
        runs = axis_runs(frame, axis, fixed)
        for endpoint in (e for e in ENDPOINTS if e in runs):
            variances, weights, pairs = [], [], []
            for _, cell in runs.groupby(axis):
                wide = cell.pivot_table(index="seed", columns="method", values=endpoint)
                if reference not in wide:
                    continue
                for method in (m for m in wide.columns if m != reference):
                    diffs = (wide[method] - wide[reference]).dropna()
                    if len(diffs) >= 2:
                        variances.append(diffs.var(ddof=1))
                        weights.append(len(diffs) - 1)
                        pairs.append(len(diffs))
            if not pairs:
                continue
            sd = math.sqrt(float(np.average(variances, weights=weights)))
            n = int(np.median(pairs))
            rows.append({"axis": axis, "endpoint": endpoint, "n_pairs": n, "sd_diff": sd, "mdd": mdd_paired(n, sd)})
    return pd.DataFrame(rows, columns=["axis", "endpoint", "n_pairs", "sd_diff", "mdd"])


def critical_values(frame: pd.DataFrame, fixed: dict) -> pd.DataFrame:
    """Per axis and method: where the seed-mean change turns negative, with its CI (log axis)."""
    rows = []
    for axis in swept_axes(frame, fixed):
        for method, runs in axis_runs(frame, axis, fixed).groupby("method", sort=True):
            runs = runs.dropna(subset=["change"])
            if runs[axis].nunique() < 2:
                continue
            point = critical_point(runs, axis, "change", log_axis=True)
            rows.append({"axis": axis, "method": method, "n_seeds": point.n_seeds, "critical": point.value,
                         "ci_low": point.ci_low, "ci_high": point.ci_high})
    return pd.DataFrame(rows, columns=["axis", "method", "n_seeds", "critical", "ci_low", "ci_high"])


def kl_matched(frame: pd.DataFrame, fixed: dict, axis: str = "optim.lr", n_points: int = 3,
               reference: str = REFERENCE) -> pd.DataFrame:
    """The `axis` runs read at matched per-update KL (see the module docstring): per KL point and method, the change
    (mean and CI over seeds) and the paired difference from `reference` (paired t over the seeds both have, Holm
    across the table's rows). KL points: n_points log-spaced inside the range that every method measured at two or
    more axis values covers with its seed-mean KL; a method at one axis value has no curve to read, so it takes no
    part (and does not shrink the range to its one point). Empty without GRPO native and one other such method."""
    columns = ["kl", "method", "n_seeds", "change", "ci_low", "ci_high", "diff_vs_reference", "diff_ci_low",
               "diff_ci_high", "p", "p_holm"]
    if axis not in swept_axes(frame, fixed):
        return pd.DataFrame(columns=columns)
    runs = axis_runs(frame, axis, fixed).dropna(subset=["change", "kl_median"])
    runs = runs[runs["kl_median"] > 0]
    if runs.empty:
        return pd.DataFrame(columns=columns)
    n_values = runs.groupby("method")[axis].nunique()
    runs = runs[runs["method"].isin(n_values[n_values >= 2].index)]
    if reference not in set(runs["method"]) or runs["method"].nunique() < 2:
        return pd.DataFrame(columns=columns)
    means = runs.groupby(["method", axis])["kl_median"].mean().groupby("method")
    low, high = np.log(means.min().max()), np.log(means.max().min())
    if not low < high:
        return pd.DataFrame(columns=columns)  # no KL range that every method covers
    points = np.exp(np.linspace(low, high, n_points + 2)[1:-1])
    curves = {}  # (method, seed) -> change at each KL point
    for (method, seed), seed_runs in runs.groupby(["method", "seed"]):
        ordered = seed_runs.sort_values("kl_median")
        if len(ordered) < 2:
            continue
        x = np.log(ordered["kl_median"].to_numpy(dtype=float))
        y = ordered["change"].to_numpy(dtype=float)
        inside = (np.log(points) >= x.min()) & (np.log(points) <= x.max())
        curves[method, seed] = np.where(inside, np.interp(np.log(points), x, y), np.nan)
    rows = []
    methods = sorted({m for m, _ in curves})
    for i, kl in enumerate(points):
        by_seed = {m: {s: c[i] for (mm, s), c in curves.items() if mm == m and np.isfinite(c[i])} for m in methods}
        for method in methods:
            values = pd.Series(by_seed[method], dtype=float)
            summary = summarize(values)
            row = {"kl": float(kl), "method": method, "n_seeds": summary["n"], "change": summary["mean"],
                   "ci_low": summary["ci_low"], "ci_high": summary["ci_high"], "diff_vs_reference": math.nan,
                   "diff_ci_low": math.nan, "diff_ci_high": math.nan, "p": math.nan, "p_holm": math.nan}
            shared = sorted(set(by_seed[method]) & set(by_seed.get(reference, {})))
            if method != reference and len(shared) >= 2:
                diff = paired_t([by_seed[method][s] for s in shared], [by_seed[reference][s] for s in shared])
                row.update(diff_vs_reference=diff.mean_diff, diff_ci_low=diff.ci_low, diff_ci_high=diff.ci_high,
                           p=diff.p)
            rows.append(row)
    table = pd.DataFrame(rows, columns=columns)
    tested = table["p"].notna()
    if tested.any():
        table.loc[tested, "p_holm"] = holm(table.loc[tested, "p"].to_numpy(dtype=float))
    return table


def kl_matched_axes(frame: pd.DataFrame, fixed: dict, n_points: int = 3, reference: str = REFERENCE) -> pd.DataFrame:
    """kl_matched along each swept axis, one table with the axis as its first column (Holm within each axis)."""
    tables = [kl_matched(frame, fixed, axis, n_points, reference).assign(axis=axis)
              for axis in swept_axes(frame, fixed)]
    tables = [table for table in tables if len(table)]
    if not tables:
        return pd.DataFrame(columns=["axis", *kl_matched(frame, {}, "optim.lr").columns])
    table = pd.concat(tables, ignore_index=True)
    return table[["axis", *[c for c in table.columns if c != "axis"]]]


@in_paper_style
def fig_stability_map(cells: pd.DataFrame):
    """One heat map per axis: methods x axis values, colour = mean held-out change (diverging around 0), each cell
    annotated with the change and the seeds that learned (L) and declined (D) of those judged."""
    axes_present = [a for a in AXES if a in set(cells["axis"])]
    fig, axes = new_figure(1, len(axes_present), row_height=2.8)
    limit = float(np.nanmax(np.abs(cells["change"]))) if cells["change"].notna().any() else 1.0
    image = None
    for ax, axis in zip(axes[0], axes_present):
        block = cells[cells["axis"] == axis]
        table = block.pivot(index="method", columns="value", values="change")
        image = ax.imshow(table.to_numpy(dtype=float), cmap="RdBu", vmin=-limit, vmax=limit, aspect="auto")
        ax.grid(False)  # the style's grid would cross the cells' labels
        declined = block.pivot(index="method", columns="value", values="n_declined")
        learned = block.pivot(index="method", columns="value", values="n_learned")
        judged = block.pivot(index="method", columns="value", values="n_judged")
        for (i, method), (j, value) in itertools.product(enumerate(table.index), enumerate(table.columns)):
            change = table.loc[method, value]
            if math.isfinite(change):
                counts = f"L{int(learned.loc[method, value])} D{int(declined.loc[method, value])}"
                # White on the darkest third of the diverging scale, where black text would not read.
                ink = "white" if abs(change) > 0.6 * limit else "black"
                ax.text(j, i, f"{change:+.2f}\n{counts}/{int(judged.loc[method, value])}", ha="center", va="center",
                        fontsize=6, color=ink)
        ax.set_xticks(range(len(table.columns)), [f"{v:g}" for v in table.columns])
        ax.set_yticks(range(len(table.index)), table.index)
        ax.set_xlabel(AXES[axis])
    if image is not None:
        fig.colorbar(image, ax=axes[0].tolist(), label="held-out change (last 3 evaluations - start)")
    return fig


@in_paper_style
def fig_change_vs_step(frame: pd.DataFrame, fixed: dict, axis: str = "optim.lr"):
    """The `axis` runs, one point each: held-out change (T = 1) against the run's per-update set change (left) and
    median per-update KL (right), one look per method. Whether declines follow the routing change or the policy
    change is read here: at a given KL, a method whose points sit higher is more stable for the same step."""
    runs = axis_runs(frame, axis, fixed).dropna(subset=["change"])
    fig, axes = new_figure(1, 2, row_height=2.8)
    methods = sorted(runs["method"].unique())
    looks = group_looks(methods)
    for ax, (column, label) in zip(axes[0], (("set_change", "set change per update"),
                                            ("kl_median", "median KL per update (nats)"))):
        for method in methods:
            points = runs[(runs["method"] == method) & (runs[column] > 0)] if column in runs else runs.iloc[:0]
            look = looks[method]
            ax.scatter(points[column], points["change"], s=14, color=look.color, marker=look.marker, label=method)
        ax.axhline(0.0, color="0.4", linewidth=0.7)
        if column in runs and (runs[column] > 0).any():
            positive = runs.loc[runs[column] > 0, column]
            _log_axis(ax.xaxis, percent=column == "set_change", decades=np.log10(positive.max() / positive.min()))
        ax.set_xlabel(label)
        ax.set_ylabel("held-out change, T = 1")
    # Below the panels: inside them the legend covers points (162 runs fill the lr axis's panels).
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncols=min(3, len(labels)))
    return fig


def _log_axis(axis, percent: bool, decades: float = 1.0) -> None:
    """A log scale labelled at 1, 2 and 5 of each decade when the values span under two decades (where the default
    labels none or overlapping minor ones), at each decade otherwise (1, 2, 5 over three decades collide), in
    percent or plain numbers."""
    axis.axes.set_xscale("log")
    axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0) if decades < 2 else (1.0,)))
    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{100 * v:g}%" if percent else f"{v:g}"))
    axis.set_minor_formatter(NullFormatter())


@dataclass
class StabilityConfig:
    """The stability map of a `stability` sweep, of report folders' per-run tables (--pool), or of both."""

    runs: Annotated[str | None, tyro.conf.Positional, tyro.conf.arg(metavar="RUNS")] = None
    """The stability sweep directory, or a folder holding several (an lr sweep and a staleness sweep: their shared
    cell's repeats are dropped); its generic report goes to --out."""
    out: str = ""
    """Output folder (README.md of the generic report, STABILITY.md); required."""
    pool: Annotated[tuple[str, ...], tyro.conf.arg(metavar="REPORT [REPORT ...]")] = ()
    """Report folders whose per-run tables (tables/per_run_final.csv, per_run_eval.csv, runs.csv) join the map, or
    sittings of a folded study written STUDY@SITTING (results/stability@lr_1: rows of
    results/stability/tables/*.parquet), e.g. earlier sittings whose sweep folders are gone; without RUNS the map is
    made from these alone and no generic report is written."""
    baseline: str | None = None
    """The warm start's moe-rl evaluate output (see moe-rl report)."""
    confirm_seeds: str | None = None
    """Comma-separated seeds for a second, confirmatory paired table (tables/paired_cells_confirm.csv): the seeds
    that did not suggest the hypothesis under test (results/stability/PROTOCOL.md)."""
    fixed_lr: float | None = None
    """The learning rate of the staleness axis; None = the stability experiment's (experiments/stability.py)."""
    fixed_minibatches: int | None = None
    """The minibatches per rollout batch of the learning-rate axis; None = the stability experiment's."""

    def check(self) -> None:
        """One ConfigError line for a missing --out, no input, a --baseline without RUNS or a bad seed list."""
        if not self.out.strip():
            raise ConfigError("--out is required: the map's folder (e.g. --out results/stability)")
        if self.runs is None and not self.pool:
            raise ConfigError("give a sweep directory (RUNS), report folders to pool (--pool), or both")
        if self.runs is None and self.baseline:
            raise ConfigError("--baseline belongs to the generic report of RUNS; without RUNS none is written")
        self.confirmation_seeds()  # a bad seed list is refused before anything is read

    def confirmation_seeds(self) -> list[int]:
        try:
            return [int(v) for v in (self.confirm_seeds or "").split(",") if v.strip()]
        except ValueError:
            raise ConfigError(f"confirm_seeds={self.confirm_seeds!r}: give comma-separated seeds, e.g. 1,2,3,4") \
                from None


def stability_map(cfg: StabilityConfig) -> Path:
    """`moe-rl stability`: the generic report of RUNS (if given) into --out, then the map from it and the --pool
    folders: tables/, figures/ and STABILITY.md. Returns the output folder."""
    from moe_rl.analysis.report import ReportConfig, report
    from moe_rl.analysis.stability_text import sources_line, stability_markdown
    from moe_rl.experiments.stability import FIXED_LR, FIXED_MINIBATCHES

    cfg.check()
    folders: list[Path | str] = list(cfg.pool)
    if cfg.runs is not None:
        folders.insert(0, report(ReportConfig(cfg.runs, out=cfg.out, baseline=cfg.baseline,
                                              equivalence_margin=MARGIN)))
    out = Path(cfg.out)
    (out / "tables").mkdir(parents=True, exist_ok=True)
    # From the reports' own per-run tables (what results/ commits), so that the map is recomputable from them.
    frame, repeats = pooled_frame(folders)
    fixed = {"optim.lr": FIXED_LR if cfg.fixed_lr is None else cfg.fixed_lr,
             "minibatches": FIXED_MINIBATCHES if cfg.fixed_minibatches is None else cfg.fixed_minibatches}
    cells, critical = stability_cells(frame, fixed), critical_values(frame, fixed)
    matched, paired, mdd = kl_matched_axes(frame, fixed), paired_cells(frame, fixed), paired_mdd(frame, fixed)
    tables = (("stability_cells", cells), ("critical", critical), ("kl_matched", matched), ("paired_cells", paired),
              ("paired_mdd", mdd))
    confirm = None
    seeds = cfg.confirmation_seeds()
    if seeds:
        chosen = frame[frame["seed"].isin(seeds)]
        confirm = (seeds, paired_cells(chosen, fixed), paired_mdd(chosen, fixed))
        tables += (("paired_cells_confirm", confirm[1]), ("paired_mdd_confirm", confirm[2]))
    for name, table in tables:
        table.to_csv(out / "tables" / f"{name}.csv", index=False)
    if len(cells):  # no axis has two values yet (a sweep's first runs)
        save(fig_stability_map(cells), out / "figures", "stability_map")
    if "optim.lr" in swept_axes(frame, fixed):
        save(fig_change_vs_step(frame, fixed), out / "figures", "change_vs_step")
    sources = sources_line(folders, frame, repeats, out)
    text = stability_markdown(cells, critical, matched, fixed, paired, mdd, confirm, sources)
    (out / "STABILITY.md").write_text(text, encoding="utf-8")
    print(f"moe-rl stability: {len(frame)} runs from {len(folders)} report folder(s) ({repeats} repeats dropped), "
          f"{len(cells)} cells, {len(critical)} critical values -> {out}/STABILITY.md")
    return out


if __name__ == "__main__":  # the spelling before `moe-rl stability`: the same parser, the same one-line errors
    import sys

    try:
        stability_map(tyro.cli(StabilityConfig, prog="moe-rl stability", description=__doc__))
    except (ConfigError, DataError) as err:
        print(f"moe-rl stability: error: {err}", file=sys.stderr)
        sys.exit(2)
