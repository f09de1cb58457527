"""A churn scaling law: how each reading of churn grows with the policy change per update, depth, E and K.

Model (fit per reading: slot churn and set change), by least squares over runs:

    log(churn) = a + b log(x) + c log(n_layers) + d log(n_experts) + e log(top_k) [+ f log(init_layers)]
                 [+ w log(d_model)]

x is the driver: the run's median per-update KL (`kl_median`, the default: churn is a response to how far the
policy moves, whatever lr moved it) or the learning rate. Across widths the KL misleads: a twice-as-wide model
churned as much at the same lr while moving 0.07-0.13x as far in KL (results/depth_width), so compare widths and
warm starts at the same lr too. Why a power law: over the swept range each reading
rises as a straight line on log-log axes in every variable (results/churn_repro), and a power law is the
simplest form whose coefficients read as elasticities ("doubling the KL multiplies churn by 2^b"). Both readings
are bounded by 1, so predictions are capped at 1; near that bound the law overstates (set change saturates as
1 - (1 - per-slot churn)^K would). A predictor that does not vary across the runs, or that the others already
determine (E and K swept together), is left out and its coefficient reported as NaN: the law then says nothing
about it and an extrapolation along it rests on the others alone (`dropped` says which).

Uncertainty: a bootstrap (the law refit N_BOOT times, a fixed generator), percentile 95% intervals for every
coefficient and every prediction. Over runs (resampled with replacement), or, where every architecture has two or
more warm starts (`warm_start_cluster`), in two stages: the warm starts of each architecture, then the runs of each
drawn warm start, so that runs sharing a warm start do not count as independent evidence. Runs whose reading or driver
is 0 or missing cannot enter a log-log fit; `n_excluded` counts them.

    per_run = run_summary(data)                 # moe_rl.analysis.cells
    fit_runs, paper_runs = split_target(per_run)   # runs of the 48 / 128 / top-8 arm are held out of the fit
    law = fit_power_law(fit_runs, "set_change")    # PowerLaw: predictors, coef, r2, predict(), driver_for()
    table = extrapolation_table(fit_runs)       # the reading at 48 layers / 128 experts / top-8, and the KL
                                                #   that would give 10% there, with bootstrap CIs
    held_out_check(fit_runs, paper_runs)        # the prediction beside what the held-out paper-shaped runs measured
    set_change_check(fit_runs)                  # per top-k: measured set change / slot churn against 1-(1-c)^K / c

Set change is bounded by its own definition: a top-K set that changed has at least one changed slot, so set change
<= K x slot churn. A power law fitted to set change directly does not know that, and when E and K move together
in the runs (8/2 and 64/8), its E exponent carries the K change, so an extrapolation along E alone can break the
bound (the committed churn_repro fit predicted 1.28% set change beside 0.10% slot churn at top-8, 12.5x). So the
extrapolation table also derives set change from the slot-churn law, set_change = 1 - (1 - c)^K (the K slots of a
decision changing independently with probability c), which never exceeds K c: the row `set_change_from_churn`.
`set_change_check` says how well that form holds on the runs themselves (measured ratio set change / slot churn
beside the form's (1 - (1 - c)^K) / c, per top-k).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from moe_rl.analysis.aggregate import summarize
from moe_rl.analysis.stats import cluster_resamples
from moe_rl.errors import ConfigError

FITTED_READINGS = ("churn", "set_change")
DRIVERS = {"kl": "kl_median", "lr": "optim.lr"}
ARCHITECTURE = ("model.n_layers", "model.n_experts", "model.top_k")
INIT_DEPTH = "model.init_depth"  # the depth whose 1/sqrt(2 L) residual init a model took (0: its own)
# The law's init predictor: the depth of the residual init each run took (init_depth, or its own depth). It
# equals the depth, and adds no rank, unless some runs held the init fixed (churn_repro fixed_init=true); then the
# depth exponent is depth's at a fixed init and this one the init's at a fixed depth.
INIT_LAYERS = "init_layers"
# The law's width predictor, where runs carry it and it varies (results/depth_width): runs without the column, or all
# of one width, fit the law without it, as before widths were swept.
WIDTH = "model.d_model"
# The GSPO paper's model (Qwen3-30B-A3B): 48 MoE layers, 128 experts, top-8.
TARGET = {"model.n_layers": 48, "model.n_experts": 128, "model.top_k": 8}
PAPER_CHURN = 0.10
N_BOOT = 1000
BOOT_SEED = 0


@dataclass
class PowerLaw:
    """log(reading) = intercept + sum_i coef[i] log(predictors[i]), fit on n runs."""

    reading: str
    predictors: list[str]
    intercept: float
    coef: list[float]
    r2: float
    n: int
    n_excluded: int = 0
    dropped: list[str] = field(default_factory=list)

    def predict(self, settings: dict[str, float]) -> float:
        """The reading at `settings` (one value per predictor; init_layers defaults to the depth), capped at 1."""
        terms = (c * math.log(_setting(settings, p)) for p, c in zip(self.predictors, self.coef))
        log_value = self.intercept + sum(terms)
        return min(1.0, math.exp(log_value))

    def driver_for(self, level: float, settings: dict[str, float]) -> float:
        """The driver value (first predictor) at which the reading reaches `level` at `settings`."""
        rest = sum(c * math.log(_setting(settings, p)) for p, c in zip(self.predictors[1:], self.coef[1:]))
        b = self.coef[0]
        if not b > 0:
            return float("nan")
        # a nearly flat fit (the runs of one sitting at two lrs) puts the level beyond any float: say so, not crash
        exponent = (math.log(level) - self.intercept - rest) / b
        return math.exp(exponent) if exponent < 700 else math.inf


def _setting(settings: dict[str, float], predictor: str) -> float:
    if predictor == INIT_LAYERS and INIT_LAYERS not in settings:
        return settings["model.n_layers"]  # a model with its own depth's init
    if predictor not in settings:
        raise ConfigError(f"the law has a {predictor} term (its runs varied it): give {predictor} with the driver and "
                          f"the architecture, e.g. {{{predictor!r}: 2048}} for the width; got {sorted(settings)}")
    return settings[predictor]


def with_init_layers(per_run: pd.DataFrame) -> pd.DataFrame:
    """per_run with INIT_LAYERS: each run's init_depth where it set one (> 0), else its depth."""
    depth = pd.to_numeric(per_run["model.n_layers"], errors="coerce")
    if INIT_DEPTH not in per_run:
        return per_run.assign(**{INIT_LAYERS: depth})
    init = pd.to_numeric(per_run[INIT_DEPTH], errors="coerce").fillna(0)
    return per_run.assign(**{INIT_LAYERS: depth.where(init <= 0, init)})


def _usable(per_run: pd.DataFrame, reading: str, driver: str) -> pd.DataFrame:
    per_run = with_init_layers(per_run)
    columns = [reading, driver, *ARCHITECTURE, INIT_LAYERS, *([WIDTH] if WIDTH in per_run else [])]
    values = per_run[columns].apply(pd.to_numeric, errors="coerce")
    return per_run[(values > 0).all(axis=1) & np.isfinite(values).all(axis=1)]


def _design(frame: pd.DataFrame, driver: str) -> tuple[np.ndarray, list[str], list[str]]:
    """Columns [1, log driver, log depth, log E, log K, log init_layers, log d_model], keeping only those that add
    rank (in that order)."""
    X = np.ones((len(frame), 1))
    kept, dropped = [], []
    init_held = bool((frame[INIT_LAYERS] != frame["model.n_layers"]).any())  # else the law has no init term at all
    width_swept = WIDTH in frame and frame[WIDTH].nunique() > 1  # else the law has no width term at all
    for name in (driver, *ARCHITECTURE, *([INIT_LAYERS] if init_held else []), *([WIDTH] if width_swept else [])):
        column = np.log(frame[name].to_numpy(dtype=float))[:, None]
        candidate = np.hstack([X, column])
        if np.linalg.matrix_rank(candidate, tol=1e-8) > X.shape[1]:
            X, kept = candidate, [*kept, name]
        else:
            dropped.append(name)
    return X, kept, dropped


def fit_power_law(per_run: pd.DataFrame, reading: str = "churn", driver: str = "kl") -> PowerLaw:
    """Least-squares fit of the law for `reading` ("churn" | "set_change" | "token_any") on per-run rows
    (moe_rl.analysis.cells.run_summary). Raises ConfigError when the driver does not vary (nothing to fit)."""
    if driver not in DRIVERS:
        raise ConfigError(f"driver={driver!r}: use one of {', '.join(DRIVERS)}")
    driver_column = DRIVERS[driver]
    frame = _usable(per_run, reading, driver_column)
    X, kept, dropped = _design(frame, driver_column)
    if driver_column not in kept:
        raise ConfigError(f"scaling fit of {reading}: {driver_column} does not vary over the {len(frame)} usable "
                          "runs; sweep the learning rate")
    y = np.log(frame[reading].to_numpy(dtype=float))
    beta, *_ = np.linalg.lstsq(X, y, rcond=None)
    residual = y - X @ beta
    total = ((y - y.mean()) ** 2).sum()
    r2 = float(1 - (residual**2).sum() / total) if total > 0 else float("nan")
    return PowerLaw(reading, kept, float(beta[0]), [float(b) for b in beta[1:]], r2, len(frame),
                    len(per_run) - len(frame), dropped)


def bootstrap_laws(per_run: pd.DataFrame, reading: str, driver: str = "kl", n_boot: int = N_BOOT,
                   seed: int = BOOT_SEED, cluster: str | None = None) -> list[PowerLaw]:
    """The law refit on `n_boot` resamples (with replacement) of the runs that enter the fit, with the full
    fit's predictors; resamples in which they are no longer of full rank are skipped. `cluster` (a column such
    as `init_from`, the warm start): resample clusters, then runs within them (moe_rl.analysis.stats.cluster_resamples),
    so that runs sharing a warm start do not count as independent; the warm starts are drawn within each
    architecture (`strata`), which every resample keeps as the sweep designed it."""
    full = fit_power_law(per_run, reading, driver)
    frame = _usable(per_run, reading, DRIVERS[driver])
    X = np.column_stack([np.ones(len(frame)), *[np.log(frame[p].to_numpy(dtype=float)) for p in full.predictors]])
    y = np.log(frame[reading].to_numpy(dtype=float))
    if cluster is None:
        rng = np.random.default_rng(seed)
        resamples = (rng.integers(0, len(frame), len(frame)) for _ in range(n_boot))
    else:
        architecture = frame[[c for c in (*ARCHITECTURE, INIT_DEPTH) if c in frame]].astype(str).agg("/".join, axis=1)
        resamples = cluster_resamples(frame[cluster].to_numpy(), n_boot, seed, strata=architecture.to_numpy())
    laws = []
    for rows in resamples:
        beta, _, rank, _ = np.linalg.lstsq(X[rows], y[rows], rcond=None)
        if rank == X.shape[1]:
            laws.append(PowerLaw(reading, full.predictors, float(beta[0]), [float(b) for b in beta[1:]],
                                 math.nan, len(rows), 0, full.dropped))
    return laws


def percentile_interval(values) -> tuple[float, float]:
    """The 2.5th and 97.5th percentiles of the finite values (a bootstrap's 95% interval); NaNs if none is finite."""
    x = np.asarray([v for v in values if np.isfinite(v)], dtype=float)
    return (float(np.percentile(x, 2.5)), float(np.percentile(x, 97.5))) if len(x) else (math.nan, math.nan)


def _ci_columns(name: str, samples) -> dict:
    low, high = percentile_interval(samples)
    return {f"{name}_ci_low": low, f"{name}_ci_high": high}


def coefficient_table(per_run: pd.DataFrame, driver: str = "kl", readings=FITTED_READINGS,
                      cluster: str | None = None) -> pd.DataFrame:
    """One row per reading and term: reading, term, estimate, ci_low, ci_high, r2, n_runs, n_excluded (dropped
    predictors appear with NaN estimates); `cluster` as in bootstrap_laws."""
    rows = []
    for reading in readings:
        law, boots = fit_power_law(per_run, reading, driver), bootstrap_laws(per_run, reading, driver, cluster=cluster)
        terms = [("intercept", law.intercept, [b.intercept for b in boots])]
        terms += [(p, c, [b.coef[i] for b in boots]) for i, (p, c) in enumerate(zip(law.predictors, law.coef))]
        terms += [(p, math.nan, []) for p in law.dropped]
        for term, estimate, samples in terms:
            low, high = percentile_interval(samples)
            rows.append({"reading": reading, "term": term, "estimate": estimate, "ci_low": low, "ci_high": high,
                         "r2": law.r2, "n_runs": law.n, "n_excluded": law.n_excluded, "n_boot": len(boots)})
    return pd.DataFrame(rows)


def reference_driver(per_run: pd.DataFrame, driver: str = "kl") -> float:
    """The driver value where RL learns: the median over runs of cells whose held-out gain CI lies above 0
    (moe_rl.analysis.cells `learns`, passed in as a `learns` column), or over all runs if none learns."""
    column = DRIVERS[driver]
    learning = per_run[per_run["learns"]] if "learns" in per_run and per_run["learns"].any() else per_run
    return float(learning[column].median())


def extrapolation_table(per_run: pd.DataFrame, driver: str = "kl", target: dict | None = None,
                        readings=FITTED_READINGS, level: float = PAPER_CHURN,
                        cluster: str | None = None) -> pd.DataFrame:
    """Per reading: the reading predicted at `target` (default TARGET: 48 layers, 128 experts, top-8) at the
    reference driver value (`reference_driver`), and the driver value at which it reaches `level` (10%), each
    with a bootstrap 95% CI (`cluster` as in bootstrap_laws)."""
    target = {**TARGET, **(target or {})}
    ref = reference_driver(per_run, driver)
    rows = []
    for reading in readings:
        law, boots = fit_power_law(per_run, reading, driver), bootstrap_laws(per_run, reading, driver, cluster=cluster)
        settings = {DRIVERS[driver]: ref, **target}
        predicted = [b.predict(settings) for b in boots]
        needed = [b.driver_for(level, settings) for b in boots]
        rows.append({"reading": reading, "driver": DRIVERS[driver], "driver_ref": ref,
                     **{k.split(".")[-1]: v for k, v in target.items()},
                     "predicted": law.predict(settings), **_ci_columns("predicted", predicted),
                     f"driver_for_{level:g}": law.driver_for(level, settings), **_ci_columns("driver_for", needed),
                     "dropped": ",".join(law.dropped)})
    if "churn" in readings and "set_change" in readings:
        settings = {DRIVERS[driver]: ref, **target}
        common = {"driver": DRIVERS[driver], "driver_ref": ref, **{k.split(".")[-1]: v for k, v in target.items()}}
        rows.append({**common, **derived_set_change_row(per_run, settings, driver, level, cluster)})
        slot = next(r["predicted"] for r in rows if r["reading"] == "churn")
        for row in rows:  # set change <= K x slot churn, by definition: does each set-change row respect it?
            if row["reading"].startswith("set_change"):
                row["within_k_slot_bound"] = bool(row["predicted"] <= target["model.top_k"] * slot * (1 + 1e-9))
    return pd.DataFrame(rows)


def set_change_from_slot(slot_churn: float, top_k: float) -> float:
    """1 - (1 - c)^K: the share of top-K decisions with at least one changed slot when each of the K slots changes
    independently with probability c; at most K c, and about K c (1 - (K - 1) c / 2) for small c."""
    return 1.0 - (1.0 - min(max(slot_churn, 0.0), 1.0)) ** top_k


def slot_for_set_change(level: float, top_k: float) -> float:
    """The slot churn c at which 1 - (1 - c)^K reaches `level`."""
    return 1.0 - (1.0 - level) ** (1.0 / top_k)


def derived_set_change_row(per_run: pd.DataFrame, settings: dict, driver: str, level: float,
                           cluster: str | None = None) -> dict:
    """The extrapolation row `set_change_from_churn`: set change from the slot-churn law at `settings`, with the
    slot law's bootstrap for its CI (see the module docstring)."""
    law, boots = fit_power_law(per_run, "churn", driver), bootstrap_laws(per_run, "churn", driver, cluster=cluster)
    k = settings["model.top_k"]
    predicted = [set_change_from_slot(b.predict(settings), k) for b in boots]
    needed = [b.driver_for(slot_for_set_change(level, k), settings) for b in boots]
    return {"reading": "set_change_from_churn", "predicted": set_change_from_slot(law.predict(settings), k),
            **_ci_columns("predicted", predicted),
            f"driver_for_{level:g}": law.driver_for(slot_for_set_change(level, k), settings),
            **_ci_columns("driver_for", needed),
            "dropped": ",".join(law.dropped)}


def set_change_check(per_run: pd.DataFrame) -> pd.DataFrame:
    """Per top-k over the runs with both readings > 0: the measured ratio set change / slot churn (mean and t CI
    over runs) beside the ratio 1 - (1 - c)^K over c at each run's own c (mean over runs), and K, the bound."""
    frame = _usable(per_run, "set_change", "churn")
    rows = []
    for k, runs in frame.groupby("model.top_k"):
        ratio = summarize(runs["set_change"] / runs["churn"])
        model = [set_change_from_slot(c, k) / c for c in runs["churn"]]
        rows.append({"top_k": int(k), "n_runs": ratio["n"], "measured_ratio": ratio["mean"],
                     "ratio_ci_low": ratio["ci_low"], "ratio_ci_high": ratio["ci_high"],
                     "independent_slots_ratio": float(np.mean(model)), "bound": int(k)})
    return pd.DataFrame(rows, columns=["top_k", "n_runs", "measured_ratio", "ratio_ci_low", "ratio_ci_high",
                                       "independent_slots_ratio", "bound"])


def warm_start_cluster(per_run: pd.DataFrame) -> str | None:
    """"init_from" where every architecture of the runs has two or more warm starts (the intervals can then resample
    warm starts, then runs within them); None otherwise (a warm start per architecture would make architectures
    the clusters, and a resample of them could not fit the architecture terms)."""
    if "init_from" not in per_run or per_run["init_from"].isna().any():
        return None
    per_arch = per_run.groupby(list(ARCHITECTURE))["init_from"].nunique()
    return "init_from" if len(per_arch) and (per_arch >= 2).all() else None


def split_target(per_run: pd.DataFrame, target: dict | None = None) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(runs to fit, runs of the target architecture): runs of the paper-shaped arm (TARGET's depth, E and K)
    are held out of the fit, so that the extrapolation can be checked against them."""
    target = {**TARGET, **(target or {})}
    is_target = np.logical_and.reduce([per_run[k] == v for k, v in target.items()])
    return per_run[~is_target], per_run[is_target]


def held_out_check(fit_runs: pd.DataFrame, held_out: pd.DataFrame, driver: str = "kl",
                   readings=FITTED_READINGS, cluster: str | None = None) -> pd.DataFrame:
    """Per reading, architecture and learning rate of the held-out runs: their measured reading (mean and t CI over
    runs) beside the law's prediction at their median driver value (with its bootstrap CI), and whether the two
    agree (`agrees`). Readings: those of `readings`, and `set_change_from_churn` (1 - (1 - c)^K from the slot-churn
    law) where both churn and set_change are among them."""
    laws = {reading: (fit_power_law(fit_runs, reading, driver), bootstrap_laws(fit_runs, reading, driver,
                                                                                cluster=cluster))
            for reading in readings}
    derived = "churn" in laws and "set_change" in laws
    rows = []
    shape = [*ARCHITECTURE, *([WIDTH] if WIDTH in held_out else [])]
    for keys, runs in with_init_layers(held_out).groupby([*shape, "optim.lr"]):
        settings = {DRIVERS[driver]: float(runs[DRIVERS[driver]].median()),
                    **dict(zip(shape, map(float, keys[:-1]))), INIT_LAYERS: float(runs[INIT_LAYERS].iloc[0])}
        for reading in (*readings, *(["set_change_from_churn"] if derived else [])):
            if reading == "set_change_from_churn":
                (law, boots), k = laws["churn"], settings["model.top_k"]
                point, predicted = set_change_from_slot(law.predict(settings), k), [
                    set_change_from_slot(b.predict(settings), k) for b in boots]
                values = runs["set_change"]
            else:
                law, boots = laws[reading]
                point, predicted = law.predict(settings), [b.predict(settings) for b in boots]
                values = runs[reading]
            measured = summarize(values)
            low, high = percentile_interval(predicted)
            rows.append({"reading": reading, **{k.split(".")[-1]: int(v) for k, v in zip(shape, keys[:-1])},
                         "optim.lr": keys[-1], "n_runs": measured["n"], "driver": settings[DRIVERS[driver]],
                         "measured": measured["mean"], "measured_ci_low": measured["ci_low"],
                         "measured_ci_high": measured["ci_high"], "predicted": point, "predicted_ci_low": low,
                         "predicted_ci_high": high,
                         "agrees": agrees(values.dropna(), point, low, high)})
    return pd.DataFrame(rows)


def agrees(measured_runs, predicted: float, predicted_low: float, predicted_high: float) -> bool:
    """Whether the runs' mean reading and a prediction agree, on the log scale: the log of the runs' geometric mean
    and the log prediction differ by at most 1.96 x sqrt(se_m^2 + se_p^2), se_m the t interval's half-width of the
    runs' log readings / 1.96 and se_p the prediction's 95% interval's half-width in log units / 1.96 (the
    pre-registered test of results/churn_paper/PREDICTION.md and results/churn_law/PREDICTION.md). One run has no
    spread; it is judged by the prediction's interval alone."""
    logs = np.log(np.asarray([v for v in measured_runs if v > 0], dtype=float))
    if not len(logs) or not predicted > 0:
        return False
    spread = summarize(pd.Series(logs))
    half_m = (spread["ci_high"] - spread["ci_low"]) / 2 if len(logs) > 1 else 0.0
    half_p = (math.log(predicted_high) - math.log(predicted_low)) / 2 if predicted_low > 0 else math.inf
    return bool(abs(logs.mean() - math.log(predicted)) <= math.hypot(half_m, half_p))


def near_level_cells(cells: pd.DataFrame, level: float = PAPER_CHURN, factor: float = 2.0) -> pd.DataFrame:
    """Cells (moe_rl.analysis.cells.churn_vs_lr_depth rows) where a reading lies within `factor` of `level` (5-20% for
    10%), with whether RL learned there; one row per (cell, reading)."""
    rows = []
    for reading in FITTED_READINGS + ("token_any",):
        column = f"{reading}_mean"
        if column not in cells:
            continue
        near = cells[(cells[column] >= level / factor) & (cells[column] <= level * factor)]
        rows += [{"group": r["group"], "reading": reading, "value": r[column], "ci_low": r[f"{reading}_ci_low"],
                  "ci_high": r[f"{reading}_ci_high"], "n_runs": r["n_runs"], "eval_gain": r["eval_gain_mean"],
                  "learns": r["learns"]} for _, r in near.iterrows()]
    return pd.DataFrame(rows, columns=["group", "reading", "value", "ci_low", "ci_high", "n_runs", "eval_gain",
                                       "learns"])
