"""Tables and figures of results/dense_twin's second sitting (PROTOCOL.md, "Second sitting"), from its sweep folders:

    python results/dense_twin/make_second.py sweeps

reads every run under the sweeps the protocol names (below, SWEEPS) and the first sitting's committed per-run table,
and writes tables/second/*.csv and three figures. Each run's held-out change is the project's (moe_rl.analysis.
stability.run_changes: the mean of the last three evaluations minus the start, sampled at T = 1); every other
per-run value is a mean over the run's updates read from its metrics.jsonl."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import pandas as pd
from scipy import stats

from moe_rl.analysis.stability import run_changes
from moe_rl.analysis.stats import (
    cluster_resamples,
    critical_point,
    holm,
    mdd_paired,
    paired_t,
    t_difference,
    tost_p,
    welch,
    zero_crossing,
)
from moe_rl.analysis.style import in_paper_style, new_figure, save

HERE = Path(__file__).resolve().parent
OUT = HERE / "tables" / "second"
# Sweep folder (under the sweeps root) -> the protocol item it serves.
SWEEPS = {
    "stability,axes=lr,methods=grpo,warm_starts=3,seeds=6": "warm starts",
    "stability,axes=lr,methods=grpo,dense_twin=true,warm_starts=3,seeds=6": "warm starts",
    "stability,axes=lr,methods=grpo,warm_starts=4,seeds=8": "warm starts",  # SFT seed 3 (the floor addendum)
    "stability,axes=lr,methods=grpo,dense_twin=true,warm_starts=4,seeds=8": "warm starts",
    "routers/scale=0": "routers", "routers/scale=0.1": "routers", "routers/scale=1": "routers",
    "routers/scale=10": "routers",
    "gspo_matched/grpo": "gspo matched", "gspo_matched/gspo": "gspo matched",
    "gspo_matched/gspo_4e-4": "gspo matched",  # added post hoc (PROTOCOL.md, "no GSPO cell matched")
    "fp8/arms": "fp8", "fp8/tis_c": "fp8",
    "frontier/ws0": "frontier", "frontier/ws1": "frontier", "frontier/ws3": "frontier",  # the third sitting
}
FRONTIER_LR = 8e-4
LRS = (1e-4, 2e-4, 4e-4, 8e-4, 1.6e-3)  # the second sitting's lr axis (the first sitting's upper five cells)
FIRST_UPDATES = 20  # the step size is the mean update/kl over a run's first 20 updates (rollout steps 1-5)
MARGIN = 0.03  # TOST margin on held-out change, fixed in the protocol
TIS_C = "TIS cap 1.25"  # item 5's acting cap, fixed by the pilot (PROTOCOL.md)
LEARNABLE = 0.005  # a warm start scoring less at step 0 (5 of 1,024) sits at the floor (PROTOCOL.md, floor addendum)
RATIO_MARGIN = math.log(1.5)  # P1's margin: a factor 1.5 in critical lr
MOE, TWIN = "MoE (64 experts, top-8)", "dense twin (one expert of width 256)"
UPDATE_MEANS = {  # per-run column -> the metric averaged over the run's updates
    "set_change": "routing/update/set_change", "token_any": "routing/update/token_any", "kl_mean": "update/kl",
    "routing_share": "split/routing_share", "clip_frac": "split/clip_frac",
    "clip_from_routing": "split/clip_from_routing", "routing_abs": "split/routing_abs_mean",
    "weights_abs": "split/weights_abs_mean", "rollout_kl": "rollout/kl", "truncated_frac": "correction/truncated_frac",
    "zeroed_frac": "correction/zeroed_frac", "correction_ess": "correction/ess",
    **{f"routing_abs_L{layer}": f"split/routing_abs_mean/L{layer}" for layer in range(4)},
}


# --- reading runs ----------------------------------------------------------------------------------------------------


def read_run(run_dir: Path) -> tuple[dict, pd.DataFrame]:
    """One run's descriptive row (config and per-update means) and its evaluations (for run_changes)."""
    config = json.loads((run_dir / "config.json").read_text())
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    updates = pd.DataFrame([line for line in lines if line.get("minibatch", -1) >= 0])
    evals = pd.DataFrame([line for line in lines if "eval/reward" in line])
    warm = json.loads((Path(config["init_from"]).parents[1] / "config.json").read_text())
    correction = config["correction"]
    row = {
        "run": run_dir.name, "optim.lr": config["optim"]["lr"], "seed": config["seed"],
        "architecture": TWIN if config["model"]["n_experts"] == 1 else MOE, "warm_start_seed": warm["seed"],
        "router_lr_scale": config["optim"]["router_lr_scale"], "objective": config["objective"]["name"],
        "routing_mode": config["routing_mode"], "precision": config["rollout"]["sampling"]["precision"],
        "correction": correction_name(correction),
        "kl_median": float(updates["update/kl"].median()),
        "step_size": float(updates.sort_values("update")["update/kl"].head(FIRST_UPDATES).mean()),
    }
    for column, metric in UPDATE_MEANS.items():
        row[column] = float(updates[metric].mean()) if metric in updates else math.nan
    evals = evals.assign(run=run_dir.name)[["run", "step", "eval/reward", "eval/reward_se", "eval/greedy",
                                            "eval/greedy_se"]]
    return row, evals


def correction_name(correction: dict) -> str:
    if correction.get("is_level") in (None, "none"):
        return "none"
    if correction.get("is_band"):
        low, high = correction["is_band"]
        return f"IcePop [{low:g}, {high:g}]"
    return f"TIS cap {correction['is_cap']:g}"


def read_sweeps(root: Path) -> pd.DataFrame:
    """Every finished run of the protocol's sweeps, one row each, with its held-out change."""
    rows, evals = [], []
    for folder, item in SWEEPS.items():
        for run_dir in sorted((root / folder / "runs").glob("*")):
            manifest = run_dir / "manifest.json"
            if not manifest.is_file():
                continue
            manifest = json.loads(manifest.read_text())
            if manifest["status"] not in ("finished", "diverged"):
                continue
            row, run_evals = read_run(run_dir)
            name = f"{folder}/{run_dir.name}"
            rows.append({**row, "run": name, "sweep": folder, "item": item, "commit": manifest["git"]["sha"][:7]})
            evals.append(run_evals.assign(run=name))
    runs = pd.DataFrame(rows)
    changes = run_changes(pd.concat(evals, ignore_index=True))[["run", "start", "change", "declined"]]
    return runs.merge(changes, on="run")


def first_sitting() -> pd.DataFrame:
    """The first sitting's runs (warm start SFT seed 0, RL seeds 0-2) on the second sitting's lr axis."""
    runs = pd.read_csv(HERE / "tables" / "per_run.csv")
    runs = runs[np.isin(runs["optim.lr"], LRS)]
    return runs.assign(warm_start_seed=0, item="first sitting", sweep="first sitting")


# --- item 4: warm starts as the unit --------------------------------------------------------------------------------


def warm_start_runs(runs: pd.DataFrame) -> pd.DataFrame:
    second = runs[runs["item"] == "warm starts"]
    columns = ["architecture", "warm_start_seed", "seed", "optim.lr", "start", "change"]
    return pd.concat([first_sitting()[columns], second[columns]], ignore_index=True)


def critical_per_warm_start(runs: pd.DataFrame) -> pd.DataFrame:
    """Per architecture and warm start: its mean step-0 held-out, whether that is off the floor, and its critical
    lr with the CI over its RL seeds (+-inf where its seed-mean curve does not cross 0 inside the grid)."""
    rows = []
    for (architecture, warm), cell in runs.groupby(["architecture", "warm_start_seed"]):
        point = critical_point(cell, "optim.lr", "change")
        start = float(cell["start"].mean())
        rows.append({"architecture": architecture, "warm_start_seed": warm, "start": start,
                     "learnable": start >= LEARNABLE, "n_seeds": point.n_seeds, "critical_lr": point.value,
                     "ci_low": point.ci_low, "ci_high": point.ci_high})
    return pd.DataFrame(rows)


def learnable_runs(runs: pd.DataFrame, per_warm: pd.DataFrame) -> pd.DataFrame:
    keep = per_warm.loc[per_warm["learnable"], ["architecture", "warm_start_seed"]]
    return runs.merge(keep, on=["architecture", "warm_start_seed"])


def hierarchical_critical(runs: pd.DataFrame) -> pd.DataFrame:
    """Per architecture: the critical lr of the mean curve over warm starts (each warm start's seed mean weighted
    alike), with a two-stage cluster-bootstrap CI (warm starts, then seeds within each) and the t interval of the
    mean log critical lr over warm starts."""
    rows = []
    per_warm = critical_per_warm_start(runs)
    for architecture, arch_runs in runs.groupby("architecture"):
        curves = arch_runs.pivot_table(index=["warm_start_seed", "seed"], columns="optim.lr", values="change")
        grid, values = curves.columns.to_numpy(float), curves.to_numpy(float)
        warm_of_curve = curves.index.get_level_values(0).to_numpy()
        point = zero_crossing(grid, warm_mean_curve(values, warm_of_curve), log_axis=True)
        boot = np.array([zero_crossing(grid, warm_mean_curve(values[rows_], warm_of_curve[rows_]), log_axis=True)
                         for rows_ in cluster_resamples(warm_of_curve)])
        logs = np.log(per_warm.loc[per_warm["architecture"] == architecture, "critical_lr"].to_numpy(float))
        t = t_interval(logs)
        rows.append({"architecture": architecture, "n_warm_starts": len(logs), "critical_lr": point,
                     "boot_low": float(np.quantile(boot, 0.025)), "boot_high": float(np.quantile(boot, 0.975)),
                     "geo_mean_critical_lr": math.exp(t.mean_diff), "t_low": math.exp(t.ci_low),
                     "t_high": math.exp(t.ci_high)})
    return pd.DataFrame(rows)


def warm_mean_curve(values: np.ndarray, warm_of_curve: np.ndarray) -> np.ndarray:
    """The mean over warm starts of each warm start's seed-mean curve (values: one row per (warm start, seed))."""
    return np.nanmean([np.nanmean(values[warm_of_curve == w], axis=0) for w in np.unique(warm_of_curve)], axis=0)


def t_interval(values: np.ndarray):
    """The one-sample t interval (and p of mean = 0) as a stats.Difference."""
    values = np.asarray(values, dtype=float)
    return t_difference(float(values.mean()), float(values.std(ddof=1) / math.sqrt(len(values))), len(values) - 1,
                        len(values), len(values))


def with_ratio_as_first_written(per_warm: pd.DataFrame) -> pd.DataFrame:
    """per_warm with P1 as the protocol first wrote it: twin / MoE critical lr of the same SFT seed (pairs by
    name; NaN where either warm start sits at the floor), on both rows of the pair."""
    wide = per_warm.pivot(index="warm_start_seed", columns="architecture", values="critical_lr")
    learnable = per_warm.pivot(index="warm_start_seed", columns="architecture", values="learnable")
    ratio = (wide[TWIN] / wide[MOE]).where(learnable[TWIN].astype(bool) & learnable[MOE].astype(bool))
    return per_warm.assign(twin_over_moe_same_sft_seed=per_warm["warm_start_seed"].map(ratio))


def critical_ratio(per_warm: pd.DataFrame) -> dict:
    """P1 (after the floor addendum): the learnable warm starts' log critical lrs, twin against MoE, Welch t."""
    learnable = per_warm[per_warm["learnable"]]
    twin = np.log(learnable.loc[learnable["architecture"] == TWIN, "critical_lr"].to_numpy(float))
    moe = np.log(learnable.loc[learnable["architecture"] == MOE, "critical_lr"].to_numpy(float))
    diff = welch(twin, moe)
    pooled_sd = math.sqrt((np.var(twin, ddof=1) + np.var(moe, ddof=1)) / 2)
    return {"test": "P1", "claim": "MoE and dense twin collapse at the same lr (post-hoc statistic: floor addendum)",
            "n": f"{len(moe)} MoE, {len(twin)} twin warm starts", "estimate": math.exp(diff.mean_diff),
            "ci_low": math.exp(diff.ci_low), "ci_high": math.exp(diff.ci_high), "units": "twin / MoE critical lr",
            "p": diff.p, "tost_p": tost_p(diff, RATIO_MARGIN), "margin": "factor 1.5",
            "mdd": math.exp(mdd_two_sample(len(moe), len(twin), pooled_sd)),
            "per_pair": "MoE " + ", ".join(f"{v:.2e}" for v in np.exp(moe))
                        + "; twin " + ", ".join(f"{v:.2e}" for v in np.exp(twin))}


def mdd_two_sample(n_a: int, n_b: int, sd: float, alpha: float = 0.05, power: float = 0.8) -> float:
    """The normal-approximation minimum detectable difference of two independent means (small samples make it an
    underestimate; stated as such)."""
    z = stats.norm.ppf(1 - alpha / 2) + stats.norm.ppf(power)
    return float(z * sd * math.sqrt(1 / n_a + 1 / n_b))


# --- item 2 and 3: the routers' freedom, the split -------------------------------------------------------------------


def router_runs(runs: pd.DataFrame) -> pd.DataFrame:
    return runs[runs["item"] == "routers"]


def router_cells(runs: pd.DataFrame) -> pd.DataFrame:
    """Per router lr scale and lr: mean change and its difference from scale 1, paired by RL seed."""
    rows = []
    free = runs[runs["router_lr_scale"] == 1].set_index(["optim.lr", "seed"])["change"]
    for (scale, lr), cell in runs.groupby(["router_lr_scale", "optim.lr"]):
        mine = cell.set_index("seed")["change"]
        reference = free.xs(lr, level=0).reindex(mine.index) if lr in free.index.get_level_values(0) else mine * np.nan
        diff = paired_t(mine.to_numpy(float), reference.to_numpy(float))
        rows.append({"router_lr_scale": scale, "optim.lr": lr, "n_seeds": len(cell), "change": mine.mean(),
                     "diff_vs_free": diff.mean_diff, "diff_ci_low": diff.ci_low, "diff_ci_high": diff.ci_high,
                     "set_change": cell["set_change"].mean(), "kl_median": cell["kl_median"].mean(),
                     "routing_share": cell["routing_share"].mean(),
                     "clip_from_routing": cell["clip_from_routing"].mean()})
    return pd.DataFrame(rows)


def router_critical(runs: pd.DataFrame) -> pd.DataFrame:
    rows = []
    for scale, cell in runs.groupby("router_lr_scale"):
        point = critical_point(cell, "optim.lr", "change")
        rows.append({"router_lr_scale": scale, "n_seeds": point.n_seeds, "critical_lr": point.value,
                     "ci_low": point.ci_low, "ci_high": point.ci_high})
    return pd.DataFrame(rows)


def churn_at_matched_kl(runs: pd.DataFrame, n_resamples: int = 2000) -> pd.DataFrame:
    """Per router lr scale: the set change per update read at scale 1's median per-run KL from a least-squares line
    of log set change on log KL over the scale's runs, as a ratio to scale 1's; CI by resampling runs."""
    kl_star = float(runs.loc[runs["router_lr_scale"] == 1, "kl_median"].median())
    rng = np.random.default_rng(0)

    def at_kl(frame: pd.DataFrame) -> float:
        slope, intercept = np.polyfit(np.log(frame["kl_median"]), np.log(frame["set_change"]), 1)
        return float(math.exp(intercept + slope * math.log(kl_star)))

    free = runs[runs["router_lr_scale"] == 1]
    rows = []
    for scale, frame in runs.groupby("router_lr_scale"):
        ratios = [at_kl(frame.iloc[rng.integers(len(frame), size=len(frame))])
                  / at_kl(free.iloc[rng.integers(len(free), size=len(free))]) for _ in range(n_resamples)]
        slope = np.polyfit(np.log(frame["kl_median"]), np.log(frame["set_change"]), 1)[0]
        rows.append({"router_lr_scale": scale, "kl": kl_star, "set_change_at_kl": at_kl(frame),
                     "ratio_to_free": at_kl(frame) / at_kl(free), "ci_low": float(np.quantile(ratios, 0.025)),
                     "ci_high": float(np.quantile(ratios, 0.975)), "slope": float(slope), "n_runs": len(frame)})
    return pd.DataFrame(rows)


def frozen_vs_free(runs: pd.DataFrame) -> dict:
    """P2: held-out change, router lr 0 minus 1, at the frontier cells 4e-4 and 8e-4 (pairs: lr and RL seed)."""
    frontier = runs[np.isin(runs["optim.lr"], (4e-4, 8e-4))]
    wide = frontier.pivot_table(index=["optim.lr", "seed"], columns="router_lr_scale", values="change").dropna(
        subset=[0.0, 1.0])
    return paired_test("P2", "frozen routers do not move GRPO's frontier", wide[0.0], wide[1.0],
                       "held-out change, router lr 0 minus 1")


def split_by_lr(runs: pd.DataFrame) -> pd.DataFrame:
    """Item 3: the split of the scale-1 runs per lr (means over runs of per-run means over updates)."""
    free = runs[runs["router_lr_scale"] == 1]
    columns = ["routing_share", "clip_frac", "clip_from_routing", "routing_abs", "weights_abs", "set_change",
               "kl_mean", *[f"routing_abs_L{layer}" for layer in range(4)]]
    table = free.groupby("optim.lr")[columns].agg(["mean", "min", "max"])
    table.columns = [f"{c}_{s}" if s != "mean" else c for c, s in table.columns]
    return table.reset_index()


def repeat_of_first_sitting(runs: pd.DataFrame) -> pd.DataFrame:
    """The scale-1 runs repeat the first sitting's RL seeds 0 and 1 (at commit 1451839) with the split probe added:
    their held-out start and change beside the committed ones (the protocol predicts equality to the digit)."""
    free = runs[(runs["item"] == "routers") & (runs["router_lr_scale"] == 1)]
    first = first_sitting()
    first = first[first["architecture"] == MOE]
    both = free.merge(first, on=["optim.lr", "seed"], suffixes=("", "_first_sitting"))
    both["equal"] = (both["start"] == both["start_first_sitting"]) & (both["change"] == both["change_first_sitting"])
    return both[["optim.lr", "seed", "start", "start_first_sitting", "change", "change_first_sitting", "equal"]]


# --- item 5: corrections where they act --------------------------------------------------------------------------


def fp8_arms(runs: pd.DataFrame) -> pd.DataFrame:
    fp8 = runs[runs["item"] == "fp8"].assign(arm=lambda f: [arm_name(r) for r in f.itertuples()])
    native = fp8[fp8["arm"] == "native"].set_index("seed")["change"]
    rows = []
    for arm, cell in fp8.groupby("arm", sort=False):
        mine = cell.set_index("seed")["change"]
        diff = paired_t(mine.to_numpy(float), native.reindex(mine.index).to_numpy(float))
        rows.append({"arm": arm, "n_seeds": len(cell), "change": mine.mean(), "diff_vs_native": diff.mean_diff,
                     "diff_ci_low": diff.ci_low, "diff_ci_high": diff.ci_high, "p": diff.p,
                     "truncated_frac": cell["truncated_frac"].mean(), "zeroed_frac": cell["zeroed_frac"].mean(),
                     "correction_ess": cell["correction_ess"].mean(), "rollout_kl": cell["rollout_kl"].mean()})
    return pd.DataFrame(rows)


def arm_name(row) -> str:
    if row.routing_mode == "R3":
        return "R3"
    return "native" if row.correction == "none" else row.correction


def fp8_tests(runs: pd.DataFrame, tis_c: str = TIS_C) -> list[dict]:
    """P3 (TIS at the cap that acts on >= 1% of tokens) and P4 (R3), each against native, paired by seed."""
    fp8 = runs[runs["item"] == "fp8"].assign(arm=lambda f: [arm_name(r) for r in f.itertuples()])
    wide = fp8.pivot_table(index="seed", columns="arm", values="change")
    return [paired_test("P3", f"a correction that acts ({tis_c}) changes learning", wide[tis_c], wide["native"],
                        f"held-out change, {tis_c} minus native, fp8 arm"),
            paired_test("P4", "R3 changes learning under the fp8 arm", wide["R3"], wide["native"],
                        "held-out change, R3 minus native, fp8 arm")]


# --- item 6: GSPO at a matched step ------------------------------------------------------------------------------


def gspo_runs(runs: pd.DataFrame) -> pd.DataFrame:
    """Item 6's runs: its two sweeps, and GRPO's RL seeds 0 and 1 at 4e-4 and 8e-4 from the scale-1 router runs (the
    same config plus the split probe; PROTOCOL.md, "Cut for time")."""
    free = runs[(runs["item"] == "routers") & (runs["router_lr_scale"] == 1) & np.isin(runs["optim.lr"], (4e-4, 8e-4))
                & np.isin(runs["seed"], (0, 1))]
    return pd.concat([runs[runs["item"] == "gspo matched"], free], ignore_index=True)


def gspo_cells(runs: pd.DataFrame) -> pd.DataFrame:
    matched = gspo_runs(runs)
    return (matched.groupby(["objective", "optim.lr"])
            .agg(n_seeds=("seed", "size"), step_size=("step_size", "mean"), change=("change", "mean"),
                 n_declined=("declined", "sum"))
            .reset_index())


def gspo_matches(runs: pd.DataFrame) -> pd.DataFrame:
    """The protocol's rule: per GRPO cell the GSPO cell of nearest seed-mean step size (in log), kept only within a
    factor 1.5; then GSPO minus GRPO paired by seed, with TOST at MARGIN."""
    matched = gspo_runs(runs)
    cells = gspo_cells(runs)
    grpo, gspo = cells[cells["objective"] == "grpo"], cells[cells["objective"] == "gspo"]
    rows = []
    for _, cell in grpo.iterrows():
        distance = np.abs(np.log(gspo["step_size"].to_numpy() / cell["step_size"]))
        partner = gspo.iloc[int(np.argmin(distance))]
        a = matched[(matched["objective"] == "gspo") & (matched["optim.lr"] == partner["optim.lr"])]
        b = matched[(matched["objective"] == "grpo") & (matched["optim.lr"] == cell["optim.lr"])]
        pair = a.set_index("seed")["change"].to_frame("gspo").join(b.set_index("seed")["change"].to_frame("grpo"),
                                                                     how="inner")
        diff = paired_t(pair["gspo"].to_numpy(float), pair["grpo"].to_numpy(float))
        finals = pd.concat([a, b])["start"] + pd.concat([a, b])["change"]
        rows.append({"grpo_lr": cell["optim.lr"], "gspo_lr": partner["optim.lr"], "grpo_step": cell["step_size"],
                     "gspo_step": partner["step_size"], "step_ratio": partner["step_size"] / cell["step_size"],
                     "matched": bool(distance.min() <= math.log(1.5)), "n_pairs": len(pair),
                     "gspo_minus_grpo": diff.mean_diff, "ci_low": diff.ci_low, "ci_high": diff.ci_high, "p": diff.p,
                     "tost_p": tost_p(diff, MARGIN) if (finals >= 0.01).any() else math.nan,
                     "mdd": mdd_paired(len(pair), float((pair["gspo"] - pair["grpo"]).std(ddof=1)))})
    return pd.DataFrame(rows)


# --- the third sitting: native vs R3 vs GSPO at the frontier over warm starts ------------------------------------


def frontier(runs: pd.DataFrame) -> pd.DataFrame:
    """At FRONTIER_LR on the MoE: R3 and GSPO minus native, paired by (warm start, RL seed); per warm start the
    mean of its pairs, then over warm starts the mean with a t interval (warm starts the unit)."""
    natives = warm_start_runs(runs)
    natives = natives[(natives["architecture"] == MOE) & (natives["optim.lr"] == FRONTIER_LR)]
    native = natives.set_index(["warm_start_seed", "seed"])["change"]
    arms = runs[runs["item"] == "frontier"].assign(
        method=lambda f: np.where(f["routing_mode"] == "R3", "GRPO+R3", "GSPO"))
    rows = []
    for method, cell in arms.groupby("method"):
        paired = cell.set_index(["warm_start_seed", "seed"])["change"]
        diffs = (paired - native.reindex(paired.index)).dropna()
        per_warm = diffs.groupby(level=0).mean()
        for warm, value in per_warm.items():
            rows.append({"method": method, "warm_start_seed": warm, "n_pairs": int((diffs.index.get_level_values(0)
                         == warm).sum()), "minus_native": value, "ci_low": math.nan, "ci_high": math.nan})
        t = t_interval(per_warm.to_numpy(float))
        rows.append({"method": method, "warm_start_seed": "mean over warm starts", "n_pairs": len(diffs),
                     "minus_native": t.mean_diff, "ci_low": t.ci_low, "ci_high": t.ci_high, "p": t.p,
                     "tost_p": tost_p(t, MARGIN),
                     "native_change": float(native.reindex(paired.index).mean()), "change": float(paired.mean())})
    return pd.DataFrame(rows)


# --- the primary family --------------------------------------------------------------------------------------------


def paired_test(name: str, claim: str, a: pd.Series, b: pd.Series, units: str) -> dict:
    diff = paired_t(a.to_numpy(float), b.to_numpy(float))
    d = (a - b).dropna().to_numpy(float)
    return {"test": name, "claim": claim, "n": diff.n_a, "estimate": diff.mean_diff, "ci_low": diff.ci_low,
            "ci_high": diff.ci_high, "units": units, "p": diff.p, "tost_p": tost_p(diff, MARGIN),
            "margin": f"{MARGIN:g} held-out", "mdd": mdd_paired(len(d), float(np.std(d, ddof=1))),
            "per_pair": ", ".join(f"{v:+.3f}" for v in d)}


def primary(tests: list[dict]) -> pd.DataFrame:
    table = pd.DataFrame(tests)
    table["p_holm"] = holm(table["p"].to_numpy(float))
    table["tost_p_holm"] = holm(table["tost_p"].to_numpy(float))
    return table


# --- figures -------------------------------------------------------------------------------------------------------


@in_paper_style
def figure_warm_starts(runs: pd.DataFrame):
    fig, axes = new_figure(1, 2, width=9.5, row_height=3.4, sharey=True)
    for ax, (architecture, arch_runs) in zip(axes[0], runs.groupby("architecture", sort=False)):
        for warm, cell in arch_runs.groupby("warm_start_seed"):
            means = cell.groupby("optim.lr")["change"].mean()
            floor = cell["start"].mean() < LEARNABLE
            ax.plot(means.index, means.to_numpy(), marker="o", linestyle="--" if floor else "-",
                    label=f"SFT seed {warm}" + (" (floor: starts at 0)" if floor else ""))
            ax.scatter(cell["optim.lr"], cell["change"], s=8, alpha=0.4)
        ax.axhline(0.0, color="0.4", linewidth=0.7)
        ax.set_xscale("log")
        ax.set_xlabel("learning rate")
        ax.set_title(architecture)
    axes[0][0].set_ylabel("held-out change over RL, T = 1")
    for ax in axes[0]:
        ax.legend(loc="lower left", title="warm start")
    return fig


@in_paper_style
def figure_routers(runs: pd.DataFrame):
    fig, axes = new_figure(1, 2, width=9.5, row_height=3.4)
    for scale, cell in runs.groupby("router_lr_scale"):
        label = "frozen routers" if scale == 0 else f"router lr {scale:g}x"
        means = cell.groupby("optim.lr")["change"].mean()
        axes[0][0].plot(means.index, means.to_numpy(), marker="o", label=label)
        axes[0][1].scatter(cell["kl_median"], cell["set_change"], s=14, label=label)
    axes[0][0].axhline(0.0, color="0.4", linewidth=0.7)
    axes[0][0].set(xscale="log", xlabel="learning rate", ylabel="held-out change over RL, T = 1",
                   title="mean of RL seeds 0 and 1")
    axes[0][1].set(xscale="log", yscale="log", xlabel="median KL per update (update/kl)",
                   ylabel="router set change per update", title="one point per run")
    axes[0][0].legend(loc="lower left")
    return fig


@in_paper_style
def figure_split(table: pd.DataFrame):
    fig, axes = new_figure(1, 2, width=9.5, row_height=3.4)
    ax = axes[0][0]
    ax.plot(table["optim.lr"], table["routing_share"], marker="o", label="routing part's share of |log w|")
    ax.plot(table["optim.lr"], table["clip_from_routing"], marker="s",
            label="share of clipped tokens the routing part pushes out")
    ax.set(xscale="log", xlabel="learning rate", ylabel="share", ylim=(0, 1), title="native GRPO, router lr 1x")
    ax.legend(loc="upper right")
    ax = axes[0][1]
    for layer in range(4):
        ax.plot(table["optim.lr"], table[f"routing_abs_L{layer}"], marker="o", label=f"MoE layer {layer}")
    ax.plot(table["optim.lr"], table["weights_abs"], color="0.3", linestyle="--", label="weight part, all layers")
    ax.set(xscale="log", yscale="log", xlabel="learning rate", ylabel="mean |log-ratio part|",
           title="each layer's routing part")
    ax.legend(loc="upper left")
    return fig


# --- main --------------------------------------------------------------------------------------------------------


def main(root: str) -> None:
    runs = read_sweeps(Path(root))
    OUT.mkdir(parents=True, exist_ok=True)
    runs.sort_values("run").to_csv(OUT / "per_run.csv", index=False)
    warm = warm_start_runs(runs)
    per_warm = critical_per_warm_start(warm)
    # One table: a row per warm start, then per architecture a row over its learnable warm starts (hierarchical).
    pooled = hierarchical_critical(learnable_runs(warm, per_warm)).assign(warm_start_seed="learnable, pooled")
    tables = {"critical_lr": pd.concat([with_ratio_as_first_written(per_warm), pooled], ignore_index=True)}
    tests = [critical_ratio(per_warm)]
    routers = router_runs(runs)
    if (routers["router_lr_scale"] == 1).any():
        split = split_by_lr(routers)
        tables.update(repeat_of_first_sitting=repeat_of_first_sitting(routers),
                      router_cells=router_cells(routers),
                      routers_by_scale=router_critical(routers).merge(churn_at_matched_kl(routers),
                                                                      on="router_lr_scale"),
                      split=split)
        tests.append(frozen_vs_free(routers))
        save(figure_routers(routers), HERE, "routers")
        save(figure_split(split), HERE, "split")
    if (runs["item"] == "fp8").any():
        tables["fp8_arms"] = fp8_arms(runs)
        if {"native", "R3", TIS_C} <= set(tables["fp8_arms"]["arm"]):
            tests += fp8_tests(runs)
    if (runs["objective"] == "gspo").any():
        tables.update(gspo_cells=gspo_cells(runs), gspo_matched=gspo_matches(runs))
        best = tables["gspo_matched"].query("grpo_lr == 4e-4").iloc[0]
        matched = gspo_runs(runs)
        gspo = matched[(matched["objective"] == "gspo") & (matched["optim.lr"] == best["gspo_lr"])].set_index("seed")
        grpo = matched[(matched["objective"] == "grpo") & (matched["optim.lr"] == 4e-4)]
        claim = "GSPO differs from GRPO at a matched step" + ("" if best["matched"] else
                                                              " (nearest cell, not within a factor 1.5)")
        tests.append(paired_test("P5", claim, gspo["change"],
                                 grpo.set_index("seed")["change"].reindex(gspo.index),
                                 f"held-out change, GSPO {best['gspo_lr']:g} minus GRPO 4e-4"))
    if (runs["item"] == "frontier").any():
        tables["frontier"] = frontier(runs)
    tables["primary"] = primary(tests)
    save(figure_warm_starts(warm), HERE, "warm_starts")
    for name, table in tables.items():
        table.to_csv(OUT / f"{name}.csv", index=False)
        print(f"\n{name}\n{table.to_string(index=False)}")


if __name__ == "__main__":
    main(*sys.argv[1:])
