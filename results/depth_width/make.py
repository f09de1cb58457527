"""Tables and figure of results/depth_width (PROTOCOL.md and its addenda), from the committed per-run tables:

    python results/depth_width/make.py                                   # width.png, and the tables in --out
    python results/depth_width/make.py --fold long_d128=REPORT ...       # first fold reports in as sittings
    python results/depth_width/make.py --floors sweeps/width             # the 8-term arm's step-0 table

A REPORT is what `moe-rl report <sweep> --out REPORT --last-k 5` wrote (churn_law's setting); its per-run tables
(per_run_final, per_run_eval, runs) become the sitting of that name in tables/*.parquet (moe_rl.analysis.sittings).
The d_model 64 side is results/churn_law's committed `report` (per_run_final.csv). Slot churn, set change and KL
per update are the report's per-run values (moe_rl.analysis.cells.run_summary: means over the last 5 rollout steps,
the KL a median over updates). The summary tables (width_cell, width_matched_kl, width_critical, law_held_out,
law_with_width, law_extrapolation, depth48_pilot) are derived, so they go to `--out` (default outputs/depth_width,
not committed) and to the screen; results/ keeps the per-run tables they come from."""

from __future__ import annotations

import argparse
import json
import math
import tempfile
from pathlib import Path

import numpy as np
import pandas as pd

from moe_rl.analysis.aggregate import t_ci
from moe_rl.analysis.scaling import (
    TARGET,
    WIDTH,
    bootstrap_laws,
    fit_power_law,
    held_out_check,
    percentile_interval,
    split_target,
    warm_start_cluster,
)
from moe_rl.analysis.sittings import fold_sittings, sitting_table, sittings
from moe_rl.analysis.stability import PER_RUN_TABLES, method_name, run_changes
from moe_rl.analysis.stats import critical_point, mdd_paired, paired_t, tost_p, welch, zero_crossing
from moe_rl.analysis.style import in_paper_style, new_figure, save

HERE = Path(__file__).resolve().parent
RESULTS = HERE.parent
CHURN_LAW = RESULTS / "churn_law" / "report" / "tables" / "per_run_final.csv"
# Each side of the width contrast: its sittings here (churn_law's committed cell has none) and its d_model.
SIDES = {"d64 churn_law": ((), 64), "d64": (("long_d64_axis",), 64),
         "d128": (("long_d128", "long_d128_axis", "long_d128_r3", "long_d128_r3b"), 128)}
LAW_SIDE, WIDE_SIDE = "d64 churn_law", "d128"  # the law's runs and its held-out cells (PROTOCOL.md, addendum 2)
CELL = {"model.n_layers": 8, "model.n_experts": 64, "model.top_k": 8}  # the cell both widths share
PAPER_WIDTH = 2048  # Qwen3-30B-A3B's hidden size
READINGS = ("churn", "set_change")
# The 48-block sittings (the pilot's runs are native seed 0 at 1e-4 and 2e-4; axis_b holds native seeds 1-2 at
# 4e-4, run in a folder of their own beside the locked main one; axis6 and axis6_c are addendum 6's R2, R3 at 4e-4
# and native GRPO, GSPO at 1.6e-3, from a rebuild of the same warm start), their methods' labels, and the
# equivalence margin on held-out fixed in addendum 5 (dense_twin's).
DEPTH48 = ("depth48_pilot", "depth48_axis", "depth48_axis_b", "depth48_axis6", "depth48_axis6_c")
DEPTH48_METHODS = {"grpo native": "GRPO", "grpo R2": "GRPO + R2", "grpo R3": "GRPO + R3", "gspo native": "GSPO"}
METHOD_FIELDS = ("routing_mode", "objective.name")
RESCUE_MARGIN = 0.03
N_BOOT = 2000
RNG_SEED = 0


# --- the runs --------------------------------------------------------------------------------------------------------


def fold(reports: dict[str, Path]) -> None:
    """Each report's per-run tables as the sitting of its name (every sitting already folded is kept)."""
    with tempfile.TemporaryDirectory() as tmp:
        folders = {}
        for sitting in _folded_sittings():
            if sitting not in reports:
                folders[sitting] = Path(tmp) / sitting
                folders[sitting].mkdir()
                for table in PER_RUN_TABLES:
                    sitting_table(HERE, table, sitting).to_csv(folders[sitting] / f"{table}.csv", index=False)
        for sitting, report in reports.items():
            folders[sitting] = Path(tmp) / sitting
            folders[sitting].mkdir()
            for table in PER_RUN_TABLES:
                frame = pd.read_csv(report / "tables" / f"{table}.csv", dtype=str, keep_default_na=False)
                frame.to_csv(folders[sitting] / f"{table}.csv", index=False)
        for folder in folders.values():  # run and warm-start paths from the repository root, not this machine's
            runs = pd.read_csv(folder / "runs.csv", dtype=str, keep_default_na=False)
            runs.apply(_from_sweeps).to_csv(folder / "runs.csv", index=False)
        for path in fold_sittings(folders, HERE / "tables"):
            print(f"folded {', '.join(folders)} -> {path.relative_to(RESULTS.parent)}")


def _from_sweeps(column: pd.Series) -> pd.Series:
    """A path written relative to another folder (../../<checkout>/sweeps/width/...) as sweeps/width/...; other values
    unchanged."""
    return column.str.replace(r"^[^,]*?(?=sweeps/)", "", regex=True)


def _folded_sittings() -> list[str]:
    return sittings(HERE, "runs") if (HERE / "tables" / "runs.parquet").is_file() else []


def width_runs() -> pd.DataFrame:
    """One row per finished run: churn_law's report runs (every architecture, the 48-block arm included) and the
    runs of each side's sittings, with `side`, `model.d_model`, `routing_mode` and the held-out `change` (mean of
    the last three evaluations minus step 0, at T = 1: moe_rl.analysis.stability.run_changes)."""
    law = pd.read_csv(CHURN_LAW)
    law = law.merge(run_changes(pd.read_csv(CHURN_LAW.with_name("per_run_eval.csv")))[["run", "change"]], on="run")
    frames = [law.assign(side=LAW_SIDE, routing_mode="native", **{WIDTH: 64})]
    for side, (names, width) in SIDES.items():
        for sitting in (n for n in names if n in _folded_sittings()):
            final = sitting_table(HERE, "per_run_final", sitting)
            config = sitting_table(HERE, "runs", sitting)[["run", "routing_mode"]]
            changes = run_changes(sitting_table(HERE, "per_run_eval", sitting))[["run", "change"]]
            final = final.drop(columns=[c for c in ("routing_mode",) if c in final]).merge(config, on="run")
            final = final.merge(changes, on="run").assign(side=side, **{WIDTH: width})
            final["run"] = sitting + "/" + final["run"]
            frames.append(final.assign(**{key: value for key, value in CELL.items() if key not in final}))
    frame = pd.concat(frames, ignore_index=True)
    frame["model.init_depth"] = frame["model.init_depth"].fillna(0)
    return frame[frame["status"] == "finished"].reset_index(drop=True)


def _in_cell(frame: pd.DataFrame) -> pd.Series:
    return np.logical_and.reduce([frame[key] == value for key, value in CELL.items()])


# --- the shared cell at two widths ----------------------------------------------------------------------------------


def cell_table(frame: pd.DataFrame) -> pd.DataFrame:
    """Per width and lr in the shared cell: runs, warm starts, KL per update, both readings, held-out start and gain
    change (mean and sd over runs); then per d64 side and lr the ratios d128 / d64 at the same lr of KL, set change
    and slot churn, native GRPO (Welch on the logs, 95% CI)."""
    cell = frame[_in_cell(frame)]
    rows = []
    for (side, mode, lr), runs in cell.groupby(["side", "routing_mode", "optim.lr"]):
        row = {"side": side, "routing_mode": mode, "optim.lr": lr, "n_runs": len(runs),
               "warm_starts": runs["init_from"].nunique()}
        for column in ("kl_median", *READINGS, "token_any", "entropy", "eval_start", "change"):
            values = runs[column].to_numpy(float)
            row[column] = values.mean()
            row[f"{column}_sd"] = values.std(ddof=1) if len(values) > 1 else math.nan
        rows.append(row)
    table = pd.DataFrame(rows)
    native = cell[cell["routing_mode"] == "native"]
    ratios = []
    for narrow in (s for s in SIDES if s != WIDE_SIDE):
        for lr, runs in native.groupby("optim.lr"):
            sides = {side: g for side, g in runs.groupby("side")}
            if narrow not in sides or WIDE_SIDE not in sides:
                continue
            row = {"side": f"{WIDE_SIDE} / {narrow}", "routing_mode": "native", "optim.lr": lr}
            for column in ("kl_median", "set_change", "churn"):
                diff = welch(np.log(sides[WIDE_SIDE][column].to_numpy(float)),
                             np.log(sides[narrow][column].to_numpy(float)))
                row.update(dict(zip([f"{column}_ratio", f"{column}_ratio_ci_low", f"{column}_ratio_ci_high"],
                                    np.exp([diff.mean_diff, diff.ci_low, diff.ci_high]))))
            ratios.append(row)
    return pd.concat([table, pd.DataFrame(ratios)], ignore_index=True)


def matched_table(frame: pd.DataFrame) -> pd.DataFrame:
    """Per d64 side and reading, native GRPO in the shared cell: per width a line of log reading on log KL (one point
    per run), read at the geometric mean of the two widths' median KLs; the ratio d128 / d64 with a bootstrap over
    runs within each width, its log2 (the width exponent of the two-point trend) and that trend carried to d_model
    2048."""
    cell = frame[_in_cell(frame) & (frame["routing_mode"] == "native")]
    rng = np.random.default_rng(RNG_SEED)
    rows = []
    for narrow, reading in ((n, r) for n in SIDES if n != WIDE_SIDE for r in READINGS):
        groups = {64: cell[cell["side"] == narrow], 128: cell[cell["side"] == WIDE_SIDE]}
        if min(len(g) for g in groups.values()) < 2:
            continue
        matched_kl = float(np.exp(np.mean([np.log(g["kl_median"].median()) for g in groups.values()])))
        at = {w: _line_at(g, reading, matched_kl) for w, g in groups.items()}
        boots = [_line_at(_draw(groups[128], rng), reading, matched_kl)
                 / _line_at(_draw(groups[64], rng), reading, matched_kl) for _ in range(N_BOOT)]
        low, high = percentile_interval(boots)
        ratio = at[128] / at[64]
        rows.append({"d64_side": narrow, "reading": reading, "matched_kl": matched_kl,
                     "d64_kl_range": f"{groups[64]['kl_median'].min():.2g}-{groups[64]['kl_median'].max():.2g}",
                     "d128_kl_range": f"{groups[128]['kl_median'].min():.2g}-{groups[128]['kl_median'].max():.2g}",
                     "at_d64": at[64], "at_d128": at[128],
                     "ratio": ratio, "ci_low": low, "ci_high": high, "width_exponent": math.log2(ratio),
                     "exponent_ci_low": math.log2(low), "exponent_ci_high": math.log2(high),
                     f"ratio_at_d{PAPER_WIDTH}": ratio ** math.log2(PAPER_WIDTH / 64),
                     f"ratio_at_d{PAPER_WIDTH}_ci_low": low ** math.log2(PAPER_WIDTH / 64),
                     f"ratio_at_d{PAPER_WIDTH}_ci_high": high ** math.log2(PAPER_WIDTH / 64)})
    return pd.DataFrame(rows)


def _draw(runs: pd.DataFrame, rng: np.random.Generator) -> pd.DataFrame:
    return runs.iloc[rng.integers(len(runs), size=len(runs))]


def _line_at(runs: pd.DataFrame, reading: str, kl: float) -> float:
    x, y = np.log(runs["kl_median"].to_numpy(float)), np.log(runs[reading].to_numpy(float))
    if np.ptp(x) == 0:
        return float(np.exp(y.mean()))  # a resample of one KL: its level
    slope, intercept = np.polyfit(x, y, 1)
    return float(np.exp(intercept + slope * math.log(kl)))


# --- the critical lr per side and method, and the ratio d128 / d64 (PROTOCOL.md, addendum 3) ------------------------


def critical_table(frame: pd.DataFrame) -> pd.DataFrame:
    """Per side with an lr axis (three or more lrs) and routing mode: where the seed-mean held-out change crosses 0
    (log-linear between grid points) with its 95% t-inversion CI over seeds; then per mode the ratio d128 / d64
    (this machine's builds) with a bootstrap that draws seeds within each width, its log2 (the width exponent) and
    the two-point trend carried to d_model 2048."""
    cell = frame[_in_cell(frame)]
    rows, axes = [], {}
    for (side, mode), runs in cell.groupby(["side", "routing_mode"]):
        if runs["optim.lr"].nunique() < 3:
            continue
        point = critical_point(runs, "optim.lr", "change")
        axes[side, mode] = runs
        rows.append({"side": side, "routing_mode": mode, "n_seeds": point.n_seeds,
                     "lrs": ",".join(f"{v:g}" for v in sorted(runs["optim.lr"].unique())),
                     "critical": point.value, "ci_low": point.ci_low, "ci_high": point.ci_high})
    for mode in ("native", "R3"):
        if ("d64", "native") in axes and (WIDE_SIDE, mode) in axes:
            ratio, low, high, unbracketed = _critical_ratio(axes["d64", "native"], axes[WIDE_SIDE, mode])
            narrow = next(r["critical"] for r in rows if r["side"] == "d64" and r["routing_mode"] == "native")
            rows.append({"side": f"{WIDE_SIDE} {mode} / d64 native", "routing_mode": mode, "critical": ratio,
                         "ci_low": low, "ci_high": high, "width_exponent": _log2(ratio),
                         "exponent_ci_low": _log2(low), "exponent_ci_high": _log2(high),
                         f"at_d{PAPER_WIDTH}": narrow * ratio ** math.log2(PAPER_WIDTH / 64)
                         if 0 < ratio < math.inf else math.nan,
                         "boot_share_unbracketed": unbracketed})
    return pd.DataFrame(rows)


def _critical_ratio(narrow: pd.DataFrame, wide: pd.DataFrame) -> tuple[float, float, float, float]:
    """crit(wide) / crit(narrow), and a percentile bootstrap CI that draws whole seeds within each width (the widths'
    seeds are independent); the last value is the share of resamples whose crossing lies off either grid."""
    tables = [runs.pivot_table(index="seed", columns="optim.lr", values="change") for runs in (narrow, wide)]
    point = _crossing(tables[1].mean()) / _crossing(tables[0].mean())
    rng = np.random.default_rng(RNG_SEED)
    ratios = np.array([_crossing(t1.mean()) / _crossing(t0.mean()) for t0, t1 in
                       ((_draw(tables[0], rng), _draw(tables[1], rng)) for _ in range(N_BOOT))])
    on_grid = np.isfinite(ratios) & (ratios > 0)
    low, high = np.nanpercentile(ratios, [2.5, 97.5]) if on_grid.any() else (math.nan, math.nan)
    return float(point), float(low), float(high), float(1 - on_grid.mean())


def _crossing(mean_by_lr: pd.Series) -> float:
    return zero_crossing(mean_by_lr.index.to_numpy(float), mean_by_lr.to_numpy(float))


def _log2(x: float) -> float:
    return math.log2(x) if 0 < x < math.inf else math.nan


# --- the law: d64's law on the held-out d128 cells, then the law with width ------------------------------------------


def law_tables(frame: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """(held-out check, the law with width, its extrapolation). The check: churn_law's law (d64 runs without the
    48-block arm, as committed) against each d128 cell at its own KL. The law with width: the same runs and every
    d128 run, with a width term; its coefficients with bootstrap CIs over runs, and its prediction at the paper's
    shape (48 / 128 / 8) at d_model 64, 128 and 2048, at the d64 law's reference KL (churn_law's `driver_ref`, the
    median KL of its learning cells, 3.6e-4)."""
    narrow = frame[frame["side"] == LAW_SIDE]
    wide = frame[(frame["side"] == WIDE_SIDE) & (frame["routing_mode"] == "native")]  # the law is native GRPO's
    fit_narrow, paper = split_target(narrow.drop(columns=[WIDTH]))
    check = held_out_check(fit_narrow, wide, cluster=warm_start_cluster(fit_narrow))  # as churn_law resampled
    # Post hoc (README, "Churn follows the lr"): the same check with the learning rate as the law's driver.
    by_lr = held_out_check(fit_narrow, wide, driver="lr", cluster=warm_start_cluster(fit_narrow))
    check = pd.concat([check.assign(driver_name="kl_median (fixed in addendum 2)"),
                       by_lr.assign(driver_name="optim.lr (post hoc)")], ignore_index=True)
    check["log_gap"] = np.log(check["measured"] / check["predicted"])
    check["useful"] = check["agrees"] & (check["log_gap"].abs() <= math.log(1.25))

    fit_all = pd.concat([narrow[~narrow["run"].isin(paper["run"])], wide], ignore_index=True)
    rows, extrapolation = [], []
    reference_kl = float(pd.read_csv(CHURN_LAW.with_name("scaling_extrapolation.csv"))["driver_ref"].iloc[0])
    for reading in READINGS:
        law, boots = fit_power_law(fit_all, reading), bootstrap_laws(fit_all, reading, n_boot=N_BOOT)
        for i, term in enumerate(["intercept", *law.predictors]):
            samples = [b.intercept if i == 0 else b.coef[i - 1] for b in boots]
            low, high = percentile_interval(samples)
            rows.append({"reading": reading, "term": term, "estimate": law.intercept if i == 0 else law.coef[i - 1],
                         "ci_low": low, "ci_high": high, "r2": law.r2, "n_runs": law.n, "n_boot": len(boots)})
        for width in (64, 128, PAPER_WIDTH):
            settings = {"kl_median": reference_kl, **TARGET, WIDTH: width}
            low, high = percentile_interval([b.predict(settings) for b in boots])
            extrapolation.append({"reading": reading, "kl_median": reference_kl, "n_layers": 48, "n_experts": 128,
                                  "top_k": 8, "d_model": width, "predicted": law.predict(settings),
                                  "ci_low": low, "ci_high": high})
    return check, pd.DataFrame(rows), pd.DataFrame(extrapolation)


# --- the 48-block pilot (PROTOCOL.md, addendum 1) ------------------------------------------------------------------

PILOT = "depth48_pilot"


def pilot_table() -> pd.DataFrame:
    """One row per run of the 48-block pilot: held-out at T = 1 and greedy at each evaluation, the change (as the
    stability map reads it), both churn readings, tokens re-routed in any layer and KL per update."""
    if PILOT not in _folded_sittings():
        return pd.DataFrame()
    final = sitting_table(HERE, "per_run_final", PILOT)
    evals = sitting_table(HERE, "per_run_eval", PILOT)
    table = final.merge(run_changes(evals), on="run")
    curve = evals.pivot_table(index="run", columns="step", values="eval/reward")
    curve.columns = [f"heldout_T1_step{int(c)}" for c in curve.columns]
    greedy = evals.pivot_table(index="run", columns="step", values="eval/greedy")
    greedy.columns = [f"heldout_greedy_step{int(c)}" for c in greedy.columns]
    columns = ["run", "optim.lr", "seed", "status", "change", "greedy_change", "set_change", "churn", "token_any",
               "kl_median"]
    return table[[c for c in columns if c in table]].merge(curve, on="run").merge(greedy, on="run")


# --- 48 blocks: the lr axis of four methods (PROTOCOL.md, addendum 5) ----------------------------------------------


def best_temperature() -> float:
    """The 48-block warm start's held-out reward at T = 1's rival: its best temperature, chosen on validation
    (`moe-rl evaluate`, tables/depth48_warm_start_evaluate.csv)."""
    table = pd.read_csv(HERE / "tables" / "depth48_warm_start_evaluate.csv")
    chosen = table[(table["split"] == "heldout") & (table["decoding"] == "sampled") & table["chosen"]]
    return float(chosen["mean"].iloc[0])


def depth48_runs() -> pd.DataFrame:
    """One row per 48-block run with a result (the pilot's two count as native seed 0 at 1e-4 and 2e-4): method,
    lr, seed, `heldout` (mean of the last three evaluations at T = 1), its `gain` over the warm start at its best
    temperature, `failed` (gain <= 0: addendum 5's endpoint), the map's `change` (minus step 0), both churn
    readings, tokens re-routed somewhere and KL per update. A diverged run solves nothing: held-out 0."""
    frames = []
    for sitting in (s for s in DEPTH48 if s in _folded_sittings()):
        final = sitting_table(HERE, "per_run_final", sitting)
        config = sitting_table(HERE, "runs", sitting)[["run", *METHOD_FIELDS]]
        changes = run_changes(sitting_table(HERE, "per_run_eval", sitting))[["run", "start", "change"]]
        frame = final.drop(columns=[c for c in METHOD_FIELDS if c in final]).merge(config, on="run")
        frame = frame.merge(changes, on="run", how="left")
        frame["method"] = [DEPTH48_METHODS[method_name(row)] for _, row in frame.iterrows()]
        frames.append(frame.assign(run=sitting + "/" + frame["run"]))
    if not frames:
        return pd.DataFrame()
    frame = pd.concat(frames, ignore_index=True)
    frame = frame[frame["status"].isin(("finished", "diverged"))].copy()
    frame["heldout"] = np.where(frame["status"] == "diverged", 0.0, frame["start"] + frame["change"])
    frame["change"] = frame["heldout"] - frame["start"]
    frame["gain"] = frame["heldout"] - best_temperature()
    frame["failed"] = frame["gain"] <= 0
    columns = ["run", "method", "optim.lr", "seed", "status", "start", "heldout", "gain", "failed", "change",
               "set_change", "churn", "token_any", "kl_median"]
    return frame[columns].sort_values(["method", "optim.lr", "seed"]).reset_index(drop=True)


def depth48_cells(runs: pd.DataFrame) -> pd.DataFrame:
    """Per method and lr: seeds, failed seeds, held-out and its gain (mean, 95% t CI over seeds), the map's change,
    and the means of both churn readings, tokens re-routed and KL per update."""
    rows = []
    for (method, lr), cell in runs.groupby(["method", "optim.lr"]):
        low, high = t_ci(cell["gain"])
        rows.append({"method": method, "optim.lr": lr, "n_seeds": len(cell), "n_failed": int(cell["failed"].sum()),
                     "heldout": cell["heldout"].mean(), "gain": cell["gain"].mean(), "gain_ci_low": low,
                     "gain_ci_high": high, "change": cell["change"].mean(),
                     **{column: cell[column].mean() for column in ("set_change", "churn", "token_any", "kl_median")}})
    return pd.DataFrame(rows)


def depth48_critical(runs: pd.DataFrame) -> pd.DataFrame:
    """Per method with two or more lrs: where its seed-mean gain over the best temperature crosses 0 (log-linear
    between grid points), with the 95% t-inversion CI over seeds (an edge of the grid reads -inf / inf)."""
    rows = []
    for method, axis in runs.groupby("method"):
        if axis["optim.lr"].nunique() < 2:
            continue
        point = critical_point(axis, "optim.lr", "gain")
        rows.append({"method": method, "lrs": ",".join(f"{v:g}" for v in sorted(axis["optim.lr"].unique())),
                     "n_seeds": point.n_seeds, "critical": point.value, "ci_low": point.ci_low,
                     "ci_high": point.ci_high})
    return pd.DataFrame(rows)


def depth48_rescue(runs: pd.DataFrame) -> pd.DataFrame:
    """Each method minus native GRPO in held-out, paired by RL seed, at every lr where they share two or more seeds:
    mean, 95% t CI, p, TOST p at RESCUE_MARGIN, the paired minimum detectable difference (80% power), and each
    side's failed seeds."""
    native = runs[runs["method"] == "GRPO"].set_index(["optim.lr", "seed"])
    rows = []
    for (method, lr), cell in runs[runs["method"] != "GRPO"].groupby(["method", "optim.lr"]):
        pairs = cell.set_index(["optim.lr", "seed"]).join(native, rsuffix="_native", how="inner")
        if len(pairs) < 2:
            continue
        diff = paired_t(pairs["heldout"].to_numpy(float), pairs["heldout_native"].to_numpy(float))
        sd = float((pairs["heldout"] - pairs["heldout_native"]).std(ddof=1))
        rows.append({"method": method, "optim.lr": lr, "n_pairs": len(pairs), "difference": diff.mean_diff,
                     "ci_low": diff.ci_low, "ci_high": diff.ci_high, "p": diff.p,
                     "tost_p": tost_p(diff, RESCUE_MARGIN), "margin": RESCUE_MARGIN, "mdd": mdd_paired(len(pairs), sd),
                     "failed": int(pairs["failed"].sum()), "failed_native": int(pairs["failed_native"].sum())})
    return pd.DataFrame(rows)


# --- the 8-term arm's step 0 at d_model 128 (PROTOCOL.md, addendum 2) ------------------------------------------------


def floors_table(sweeps: Path) -> pd.DataFrame:
    """Per warm start of the 8-term arm's sweeps under `sweeps` (width/d128, width/d128_ws, width/d64_check): its
    SFT seed, own-task reward at the end of SFT, and per RL run its step 0 (held-out at T = 1 and greedy, training
    reward), how far it ran, its last evaluation and its best training reward."""
    rows = []
    for sweep in ("d128", "d128_ws", "d64_check"):
        for run in sorted((sweeps / sweep / "runs").glob("*/")):
            config = json.loads((run / "config.json").read_text())
            lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
            evals = [line for line in lines if "eval/reward" in line]
            step0 = next((line for line in evals if line["step"] == 0), None)
            if step0 is None:
                continue
            warm = Path(config["init_from"]).parents[1]
            sft = [json.loads(line) for line in (warm / "metrics.jsonl").read_text().splitlines() if line.strip()]
            sft_config = json.loads((warm / "config.json").read_text())
            rows.append({"sweep": f"width/{sweep}", "warm_start": warm.name, "d_model": config["model"]["d_model"],
                         "sft_seed": sft_config["seed"], "sft_own_task_reward": sft[-1].get("eval/reward"),
                         "run": run.name, "heldout_T1_step0": step0["eval/reward"],
                         "heldout_greedy_step0": step0.get("eval/greedy"),
                         "train_reward_step0": next(line["reward"] for line in lines if "reward" in line),
                         "rollout_steps": max(line["step"] for line in lines),
                         "heldout_T1_last": evals[-1]["eval/reward"],
                         "heldout_greedy_last": evals[-1].get("eval/greedy"),
                         "last_eval_step": evals[-1]["step"],
                         "train_reward_max": max(line["reward"] for line in lines if "reward" in line)})
    return pd.DataFrame(rows).drop_duplicates(subset=["sweep", "warm_start", "run"])


# --- the figure ------------------------------------------------------------------------------------------------------


@in_paper_style
def fig_width(frame: pd.DataFrame):
    """Three panels against the learning rate, in the shared cell (8 blocks, 64 experts, top-8): set change per
    update, KL per update, and held-out change; one colour per side, native GRPO solid, R3 dashed; each run a
    point, the line through the means over seeds (2-3 seeds: an interval would say little)."""
    fig, axes = new_figure(1, 3, row_height=2.5)
    cell = frame[_in_cell(frame)]
    colours = {"d64 churn_law": "#99bbdd", "d64": "#4477aa", "d128": "#ee6677"}
    panels = (("set_change", "set change per update", "log"), ("kl_median", "KL per update (run median)", "log"),
              ("change", "held-out change (T = 1)", "linear"))
    lrs = sorted(cell["optim.lr"].unique())
    for ax, (column, label, scale) in zip(axes[0], panels):
        for (side, mode), runs in cell.groupby(["side", "routing_mode"]):
            style = "-" if mode == "native" else "--"
            means = runs.groupby("optim.lr")[column].mean()
            ax.plot(means.index, means.to_numpy(), color=colours[side], linestyle=style,
                    label=f"{side}{'' if mode == 'native' else ', R3'}")
            ax.scatter(runs["optim.lr"], runs[column], color=colours[side], s=8,
                       marker="o" if mode == "native" else "x")
        ax.set(xscale="log", yscale=scale, xlabel="learning rate", ylabel=label)
        ax.set_xticks(lrs, [f"{lr:g}" for lr in lrs], minor=False)
        ax.set_xticks([], minor=True)
    axes[0][2].axhline(0, color="0.5", linewidth=0.6)
    axes[0][0].legend(fontsize=6)
    return fig


@in_paper_style
def fig_depth48(runs: pd.DataFrame):
    """Two panels against the learning rate at 48 MoE blocks (128 experts, top-8): held-out accuracy at T = 1 after
    RL (mean of the last three evaluations) with the warm start at its best temperature as a line, and set change
    per update; one colour per method, set a little apart along the axis so that the methods at one lr do not hide
    each other; each run a point, the line through the means over seeds."""
    fig, axes = new_figure(1, 2, row_height=2.6)
    colours = {"GRPO": "#4477aa", "GRPO + R2": "#ccbb44", "GRPO + R3": "#ee6677", "GSPO": "#228833"}
    lrs = sorted(runs["optim.lr"].unique())
    panels = (("heldout", "held-out accuracy, T = 1 (last 3 evaluations)"), ("set_change", "set change per update"))
    for ax, (column, label) in zip(axes[0], panels):
        for offset, (method, colour) in enumerate(colours.items()):
            cell = runs[runs["method"] == method]
            if cell.empty:
                continue
            apart = 1.06 ** (offset - 1.5)
            means = cell.groupby("optim.lr")[column].mean()
            ax.plot(means.index * apart, means.to_numpy(), color=colour, marker="o", markersize=3, label=method)
            ax.scatter(cell["optim.lr"] * apart, cell[column], color=colour, s=7, alpha=0.6)
        ax.set(xscale="log", xlabel="learning rate", ylabel=label)
        ax.set_xticks(lrs, [_lr_label(lr) for lr in lrs], minor=False)
        ax.set_xticks([], minor=True)
    axes[0][0].axhline(best_temperature(), color="0.4", linestyle=":", linewidth=0.8)
    axes[0][0].annotate("warm start, best temperature", (lrs[0], best_temperature()), fontsize=6,
                        xytext=(0, 3), textcoords="offset points")
    axes[0][0].legend(fontsize=6)
    return fig


def _lr_label(lr: float) -> str:
    """1e-4, 1.6e-3."""
    mantissa, exponent = f"{lr:.1e}".split("e")
    return f"{float(mantissa):g}e{int(exponent)}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fold", nargs="*", default=[], metavar="SITTING=REPORT",
                        help="fold report folders in as sittings (e.g. long_d128=outputs/long_d128)")
    parser.add_argument("--floors", type=Path, help="the sweeps folder holding width/d128, d128_ws, d64_check")
    parser.add_argument("--out", type=Path, default=RESULTS.parent / "outputs" / "depth_width",
                        help="where the derived summary tables go")
    args = parser.parse_args()
    if args.fold:
        fold({name: Path(path) for name, path in (item.split("=", 1) for item in args.fold)})
    if args.floors:
        floors_table(args.floors).to_csv(HERE / "tables" / "eight_term_step0.csv", index=False)
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    frame = width_runs()
    check, law, extrapolation = law_tables(frame)
    tables = {"width_cell": cell_table(frame), "width_matched_kl": matched_table(frame),
              "width_critical": critical_table(frame), "law_held_out": check,
              "law_with_width": law, "law_extrapolation": extrapolation, "depth48_pilot": pilot_table()}
    depth48 = depth48_runs()
    if not depth48.empty:
        tables.update({"depth48_runs": depth48, "depth48_cells": depth48_cells(depth48),
                       "depth48_critical": depth48_critical(depth48), "depth48_rescue": depth48_rescue(depth48)})
    for name, table in tables.items():
        if table.empty:
            continue
        table.to_csv(out / f"{name}.csv", index=False)
        print(f"\n{name}\n{table.to_string(index=False)}")
    save(fig_width(frame), HERE, "width", formats=("png",))
    if not depth48.empty and "depth48_axis" in _folded_sittings():
        save(fig_depth48(depth48), HERE, "depth48", formats=("png",))


if __name__ == "__main__":
    main()
