"""Tables and figure of results/depth_width (PROTOCOL.md), from the committed per-run tables:

    python results/depth_width/make.py                      # tables/*.csv and width.png from the committed tables
    python results/depth_width/make.py --fold REPORT        # first fold a sweep's report in as the sitting width_d128

REPORT is what `moe-rl stability sweeps/width/d128 --out REPORT` wrote; its per-run tables (per_run_final,
per_run_eval, runs) become the sitting `width_d128` of tables/*.parquet (moe_rl.analysis.sittings). The d_model 64
side is results/stability's deep arm as committed (the sittings DEEP8). Each run's held-out change is the project's
(moe_rl.analysis.stability: the mean of the last three evaluations minus the start, sampled at T = 1); set change,
slot churn and KL per update are the report's per-run values (moe_rl.analysis.cells.run_summary)."""

from __future__ import annotations

import argparse
import math
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pandas as pd

from moe_rl.analysis.scaling import WIDTH, bootstrap_laws, fit_power_law, held_out_check
from moe_rl.analysis.sittings import fold_sittings
from moe_rl.analysis.stability import PER_RUN_TABLES, pooled_frame
from moe_rl.analysis.stats import critical_point, mdd_paired, paired_t, tost_p, zero_crossing
from moe_rl.analysis.style import in_paper_style, new_figure, save

HERE = Path(__file__).resolve().parent
RESULTS = HERE.parent
STABILITY = RESULTS / "stability"
DEEP8 = ("deep8_8terms_zen4_i", "deep8_8terms_zen4", "deep8_8terms_zen4_r2", "deep8_8terms_zen4_h")  # maps/deep8
WIDE = ("width_d128",)
METHODS = ("grpo native", "grpo R3")
HELD_OUT_LR = 8e-4  # the law's held-out cell: d_model 128 at this lr (PROTOCOL.md, item L)
PAPER_WIDTH = 2048  # Qwen3-30B-A3B's hidden size
MARGIN = 0.03  # TOST margin on held-out change (PROTOCOL.md, W2)
N_BOOT = 2000
RNG_SEED = 0


# --- the runs --------------------------------------------------------------------------------------------------------


def fold(report: Path) -> None:
    """The report's per-run tables as the sitting width_d128 of tables/*.parquet."""
    with tempfile.TemporaryDirectory() as tmp:
        for table in PER_RUN_TABLES:
            shutil.copy(report / "tables" / f"{table}.csv", Path(tmp) / f"{table}.csv")
        for path in fold_sittings({WIDE[0]: Path(tmp)}, HERE / "tables"):
            print(f"folded {report} -> {path.relative_to(RESULTS.parent)}")


def width_runs() -> pd.DataFrame:
    """One row per run of native GRPO and R3 at both widths: method, optim.lr, seed, change, KL, set change, churn,
    model.d_model."""
    narrow, _ = pooled_frame([f"{STABILITY}@{s}" for s in DEEP8])
    wide, _ = pooled_frame([f"{HERE}@{s}" for s in WIDE])
    frame = pd.concat([narrow.assign(**{WIDTH: 64}), wide.assign(**{WIDTH: 128})], ignore_index=True)
    frame = frame[frame["method"].isin(METHODS) & np.isclose(frame["minibatches"].astype(float), 4)]
    return frame.reset_index(drop=True)


# --- W1: the critical lr per width and method, and the ratio ------------------------------------------------------


def critical_table(frame: pd.DataFrame) -> pd.DataFrame:
    rows = []
    for method in METHODS:
        points = {}
        for width, runs in frame[frame["method"] == method].groupby(WIDTH):
            point = critical_point(runs, "optim.lr", "change")
            points[width] = runs
            rows.append({"method": method, "d_model": width, "n_seeds": point.n_seeds,
                         "lrs": ",".join(f"{v:g}" for v in sorted(runs["optim.lr"].unique())),
                         "critical": point.value, "ci_low": point.low, "ci_high": point.high})
        if len(points) == 2:
            ratio, low, high, beyond = _critical_ratio(points[64], points[128])
            rows.append({"method": method, "d_model": "128/64", "critical": ratio, "ci_low": low, "ci_high": high,
                         "width_exponent": math.log2(ratio) if 0 < ratio < math.inf else math.nan,
                         "exponent_ci_low": _log2(low), "exponent_ci_high": _log2(high),
                         f"at_d{PAPER_WIDTH}": _extrapolate(rows, method, ratio),
                         "boot_share_unbracketed": beyond})
    return pd.DataFrame(rows)


def _critical_ratio(narrow: pd.DataFrame, wide: pd.DataFrame) -> tuple[float, float, float, float]:
    """crit(wide) / crit(narrow), with a percentile bootstrap that draws whole seeds within each width (the widths'
    seeds are independent). A resample whose crossing lies beyond either grid is counted in the last value."""
    tables = [runs.pivot_table(index="seed", columns="optim.lr", values="change") for runs in (narrow, wide)]
    point = _crossing(tables[1].mean()) / _crossing(tables[0].mean())
    rng = np.random.default_rng(RNG_SEED)
    ratios = []
    for _ in range(N_BOOT):
        means = [t.iloc[rng.integers(len(t), size=len(t))].mean() for t in tables]
        ratios.append(_crossing(means[1]) / _crossing(means[0]))
    ratios = np.asarray(ratios)
    finite = ratios[np.isfinite(ratios) & (ratios > 0)]
    low, high = np.nanpercentile(ratios, [2.5, 97.5]) if len(finite) else (math.nan, math.nan)
    return float(point), float(low), float(high), float(1 - len(finite) / len(ratios))


def _crossing(mean_by_lr: pd.Series) -> float:
    return zero_crossing(mean_by_lr.index.to_numpy(float), mean_by_lr.to_numpy(float))


def _log2(x: float) -> float:
    return math.log2(x) if 0 < x < math.inf else (math.inf if x == math.inf else -math.inf if x == 0 else math.nan)


def _extrapolate(rows: list[dict], method: str, ratio: float) -> float:
    """crit(64) x ratio^log2(2048 / 64): the two-point trend carried five doublings out."""
    narrow = next(r["critical"] for r in rows if r["method"] == method and r["d_model"] == 64)
    return narrow * ratio ** math.log2(PAPER_WIDTH / 64) if 0 < ratio < math.inf else math.nan


# --- W2: R3 minus native, paired by seed -----------------------------------------------------------------------------


def paired_table(frame: pd.DataFrame) -> pd.DataFrame:
    rows = []
    for (width, lr), cell in frame.groupby([WIDTH, "optim.lr"]):
        by_seed = cell.pivot_table(index="seed", columns="method", values="change")
        if not set(METHODS) <= set(by_seed):
            continue
        both = by_seed.dropna()
        diff = paired_t(both["grpo R3"], both["grpo native"])
        sd = float((both["grpo R3"] - both["grpo native"]).std(ddof=1)) if len(both) > 1 else math.nan
        rows.append({"d_model": width, "optim.lr": lr, "n_pairs": len(both),
                     "native_change": both["grpo native"].mean(), "r3_change": both["grpo R3"].mean(),
                     "r3_minus_native": diff.mean_diff, "ci_low": diff.ci_low, "ci_high": diff.ci_high, "p": diff.p,
                     "tost_p": tost_p(diff, MARGIN), "margin": MARGIN,
                     "mdd": mdd_paired(len(both), sd) if len(both) > 1 and sd > 0 else math.nan})
    return pd.DataFrame(rows)


# --- W3: set change at matched KL ------------------------------------------------------------------------------------


def matched_table(frame: pd.DataFrame, readings=("set_change", "churn")) -> pd.DataFrame:
    """Per reading: per width a line of log reading on log KL per update (run medians), read at the geometric mean
    of the two widths' median KLs; the ratio wide / narrow with a bootstrap over runs within each width."""
    usable = frame[(frame["kl_median"] > 0)]
    matched_kl = float(np.exp(np.mean([np.log(g["kl_median"].median()) for _, g in usable.groupby(WIDTH)])))
    rows = []
    rng = np.random.default_rng(RNG_SEED)
    for reading in readings:
        groups = {w: g[g[reading] > 0] for w, g in usable.groupby(WIDTH)}
        at = {w: _line_at(g, reading, matched_kl) for w, g in groups.items()}
        for width, g in groups.items():
            rows.append({"reading": reading, "d_model": width, "n_runs": len(g), "matched_kl": matched_kl,
                         "kl_low": g["kl_median"].min(), "kl_high": g["kl_median"].max(), "at_matched_kl": at[width]})
        if len(groups) == 2:
            boots = []
            for _ in range(N_BOOT):
                drawn = {w: g.iloc[rng.integers(len(g), size=len(g))] for w, g in groups.items()}
                boots.append(_line_at(drawn[128], reading, matched_kl) / _line_at(drawn[64], reading, matched_kl))
            low, high = np.nanpercentile(boots, [2.5, 97.5])
            ratio = at[128] / at[64]
            rows.append({"reading": reading, "d_model": "128/64", "matched_kl": matched_kl, "at_matched_kl": ratio,
                         "ci_low": low, "ci_high": high, "width_exponent": math.log2(ratio),
                         "exponent_ci_low": math.log2(low), "exponent_ci_high": math.log2(high),
                         f"ratio_at_d{PAPER_WIDTH}": ratio ** math.log2(PAPER_WIDTH / 64)})
    return pd.DataFrame(rows)


def _line_at(runs: pd.DataFrame, reading: str, kl: float) -> float:
    slope, intercept = np.polyfit(np.log(runs["kl_median"]), np.log(runs[reading]), 1)
    return float(np.exp(intercept + slope * math.log(kl)))


# --- L: the churn law with width, the held-out cell ------------------------------------------------------------------


def law_runs(frame: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(runs to fit, held-out runs): churn_law's report runs (K cells and the 48-block paper shape, the long regime)
    and the width runs, less the held-out cell (d_model 128 at HELD_OUT_LR)."""
    law = pd.read_csv(RESULTS / "churn_law" / "report" / "tables" / "per_run_final.csv")
    law = law.assign(**{WIDTH: 64, "regime": "long (churn_law)"})
    width = frame.assign(**{"model.init_depth": 0, "regime": "8-term deep arm"})
    columns = ["run", "optim.lr", "model.n_layers", "model.n_experts", "model.top_k", "model.init_depth", WIDTH,
               "kl_median", "churn", "set_change", "regime"]
    pooled = pd.concat([law[columns], width[columns]], ignore_index=True)
    held = (pooled[WIDTH] == 128) & np.isclose(pooled["optim.lr"], HELD_OUT_LR)
    return pooled[~held].reset_index(drop=True), pooled[held].reset_index(drop=True)


def law_tables(frame: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    fit_runs, held_out = law_runs(frame)
    rows = []
    for reading in ("churn", "set_change"):
        law, boots = fit_power_law(fit_runs, reading), bootstrap_laws(fit_runs, reading)
        residual = np.log(fit_runs[reading]) - np.log([law.predict(r) for r in fit_runs.to_dict("records")])
        for i, term in enumerate(["intercept", *law.predictors]):
            samples = [b.intercept if i == 0 else b.coef[i - 1] for b in boots]
            low, high = np.percentile(samples, [2.5, 97.5])
            rows.append({"reading": reading, "term": term, "estimate": law.intercept if i == 0 else law.coef[i - 1],
                         "ci_low": low, "ci_high": high, "r2": law.r2, "n_runs": law.n})
        for regime, r in residual.groupby(fit_runs["regime"]):
            rows.append({"reading": reading, "term": f"mean residual, {regime}", "estimate": float(r.mean()),
                         "n_runs": len(r)})
    check = held_out_check(fit_runs, held_out) if len(held_out) else pd.DataFrame()
    if len(check):
        check["log_gap"] = np.log(check["measured"] / check["predicted"])
        check["useful"] = check["agrees"] & (check["log_gap"].abs() <= math.log(1.25))
    return pd.DataFrame(rows), check


# --- the figure ------------------------------------------------------------------------------------------------------


@in_paper_style
def fig_width(frame: pd.DataFrame):
    fig, axes = new_figure(1, 2, row_height=2.6)
    left, right = axes[0]
    colours = {64: "#4477aa", 128: "#ee6677"}
    styles = {"grpo native": ("-", "o"), "grpo R3": ("--", "s")}
    for (width, method), runs in frame.groupby([WIDTH, "method"]):
        cells = runs.groupby("optim.lr")["change"].agg(["mean", "sem", "count"])
        line, marker = styles[method]
        left.errorbar(cells.index, cells["mean"], yerr=1.96 * cells["sem"].fillna(0), color=colours[width],
                      linestyle=line, marker=marker, capsize=2, label=f"d{width}, {method.replace('grpo ', '')}")
        right.scatter(runs["kl_median"], runs["set_change"], color=colours[width], marker=marker, s=12)
    left.axhline(0, color="0.5", linewidth=0.6)
    left.set(xscale="log", xlabel="learning rate", ylabel="held-out change (T = 1)")
    left.legend(fontsize=6)
    right.set(xscale="log", yscale="log", xlabel="KL per update (run median)", ylabel="set change per update")
    return fig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fold", type=Path, help="a `moe-rl stability` report folder of the d_model 128 sweep")
    args = parser.parse_args()
    if args.fold:
        fold(args.fold)
    frame = width_runs()
    out = HERE / "tables"
    tables = {"width_critical": critical_table(frame), "width_paired": paired_table(frame),
              "width_matched_kl": matched_table(frame)}
    tables["law_fit"], tables["law_held_out"] = law_tables(frame)
    for name, table in tables.items():
        table.to_csv(out / f"{name}.csv", index=False)
        print(f"\n{name}\n{table.to_string(index=False)}")
    save(fig_width(frame), HERE, "width", formats=("png",))


if __name__ == "__main__":
    main()
