"""Aggregation over seeds: means with confidence intervals, final scores, churn tables.

Every function takes the frames of `moe_rl.analysis.load` (with a `group` column from `add_groups`) and returns a tidy
frame. Intervals are Student-t 95% CIs of the mean over runs (`t_ci`: mean +- t(0.975, n-1) s / sqrt(n)). Why not
the percentile bootstrap: with the 3-5 seeds a CPU sweep affords, resampling 3 values cannot reach beyond their
range and its interval is far too narrow (about +-1.2 standard errors at n = 3, where t gives +-4.3; in
results/churn_repro a fresh set of 3 seeds fell outside the bootstrap interval of the committed 3 in 2 of 6
metrics). `bootstrap_ci` stays for larger samples. Conventions for small samples, which sweeps of 1-3 seeds hit:
one value gives ci_low = ci_high = NaN (no spread to resample, and a band of zero width would claim certainty);
identical values give ci_low = ci_high = the value. Non-finite values (a diverged run's last step) are left out
and `n` counts what remains.

    keys = group_keys(data)                               # config fields that vary, seeds and paths excluded
    data = add_groups(data, keys)                         # a `group` label column on every frame
    curve = mean_ci(data.steps, "reward", x="step")       # group, step, n, mean, ci_low, ci_high
    final = final_scores(data, ["reward"], last_k=5)      # group, metric, n_runs, n_diverged, mean, iqm, ...
    cells = churn_vs_lr_depth(data)                       # moe_rl.analysis.cells: per cell, both churn readings
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence

import numpy as np
import pandas as pd
from scipy import stats

from moe_rl.analysis.load import RunSet
from moe_rl.errors import ConfigError

CONFIDENCE = 0.95
N_RESAMPLES = 2000
BOOTSTRAP_SEED = 0
# Config fields that never define a group: where and how a run was executed, not what was run.
# init_from is a path that changes with whatever made the checkpoint (e.g. one warm start per architecture);
# the architecture fields themselves name the group.
BOOKKEEPING = ("out_dir", "resume", "device", "threads", "checkpoint_every", "keep_every", "total_steps", "init_from")
BOOKKEEPING_PREFIXES = ("log.",)
# Group keys come in this order ("grpo R2 lr=0.001"); other keys follow in config order.
KEY_ORDER = ("objective.name", "routing_mode", "optim.lr", "model.n_layers", "model.n_experts", "model.top_k")
# Short names for group labels; any other key is labelled by its last component.
SHORT_NAMES = {"objective.name": "", "routing_mode": "", "optim.lr": "lr", "model.n_layers": "layers",
               "model.n_experts": "experts", "model.top_k": "top-k"}


# ---------------------------------------------------------------------------------------------------------------------
# Groups


def group_keys(data: RunSet, requested: Sequence[str] | None = None) -> list[str]:
    """The config fields that define groups: `requested` (checked), or every field that varies across runs
    except bookkeeping (BOOKKEEPING, log.*), seeds (any field named seed) and fields that change only with the
    seed (a per-seed warm-start checkpoint, for instance)."""
    if requested:
        unknown = [key for key in requested if key not in data.runs.columns]
        if unknown:
            raise ConfigError(f"group_by={list(requested)}: no config field {', '.join(unknown)}; fields that vary "
                              f"across these runs: {', '.join(data.varying()) or 'none'}")
        return list(requested)
    keys = [key for key in data.varying() if not _is_bookkeeping(key) and not _follows_seed(data.runs, key)]
    return sorted(keys, key=lambda k: KEY_ORDER.index(k) if k in KEY_ORDER else len(KEY_ORDER))


def _is_bookkeeping(key: str) -> bool:
    return key in BOOKKEEPING or key.startswith(BOOKKEEPING_PREFIXES) or key.rsplit(".", 1)[-1] == "seed"


def _follows_seed(runs: pd.DataFrame, key: str) -> bool:
    """Whether `key` and the seed determine each other across several seeds."""
    pairs = runs[["seed", key]].astype(str).drop_duplicates()
    return (runs["seed"].nunique() > 1 and not pairs["seed"].duplicated().any()
            and not pairs[key].duplicated().any())


def _label_part(key: str, value) -> str:
    name = SHORT_NAMES.get(key, key.rsplit(".", 1)[-1])
    if isinstance(value, float):
        value = f"{value:g}"
    return f"{name}={value}" if name else str(value)


def group_label(row: pd.Series | dict, keys: Sequence[str]) -> str:
    """'grpo R2', 'gspo native lr=0.001', or 'all runs' when no key is given; a key whose value is missing in this
    row (a correction's cap in a run with a band) is left out of its label."""
    if not keys:
        return "all runs"
    return " ".join(_label_part(key, row[key]) for key in keys if not _missing(row[key])) or "defaults"


def _missing(value) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def add_groups(data: RunSet, keys: Sequence[str]) -> RunSet:
    """A copy of `data` whose frames carry the group keys and a `group` label column; groups are ordered by
    their key values, and `data.groups` lists them in that order."""
    keys = list(keys)
    runs = data.runs.copy()
    runs["group"] = [group_label(row, keys) for _, row in runs.iterrows()]
    labels = runs[["run", "group"]]

    def label(frame: pd.DataFrame) -> pd.DataFrame:
        frame = data.with_config(frame.drop(columns="group", errors="ignore"), keys)
        return frame.merge(labels, on="run", how="left")

    return RunSet(data.root, runs, label(data.metrics), label(data.steps), label(data.routing), data.sweep,
                  data.skipped, missing=data.missing, group_by=keys, groups=_group_order(runs, keys))


def _group_order(runs: pd.DataFrame, keys: list[str]) -> list[str]:
    """Group labels sorted by their key values (numbers as numbers where the column allows it)."""
    try:
        ordered = runs.sort_values([*keys, "run"])
    except TypeError:  # a column mixing types (None and text): order it as text
        ordered = runs.sort_values([*keys, "run"], key=lambda column: column.astype(str))
    return ordered["group"].drop_duplicates().tolist()


# ---------------------------------------------------------------------------------------------------------------------
# Intervals


def _finite(values) -> np.ndarray:
    x = np.asarray(values, dtype=float)
    return x[np.isfinite(x)]


def _degenerate_interval(x: np.ndarray) -> tuple[float, float] | None:
    """The module's small-sample conventions: (NaN, NaN) for fewer than 2 values, (v, v) for identical ones; None
    when there is a spread to build an interval from."""
    if len(x) < 2:
        return float("nan"), float("nan")
    if np.ptp(x) == 0:
        return float(x[0]), float(x[0])
    return None


def bootstrap_ci(values, *, confidence: float = CONFIDENCE, n_resamples: int = N_RESAMPLES,
                 seed: int = BOOTSTRAP_SEED) -> tuple[float, float]:
    """Percentile bootstrap CI of the mean of the finite `values` (see the module docstring for n <= 1)."""
    x = _finite(values)
    if (degenerate := _degenerate_interval(x)) is not None:
        return degenerate
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", stats.DegenerateDataWarning)
        result = stats.bootstrap((x,), np.mean, n_resamples=n_resamples, confidence_level=confidence,
                                 method="percentile", rng=np.random.default_rng(seed))
    return float(result.confidence_interval.low), float(result.confidence_interval.high)


def t_ci(values, *, confidence: float = CONFIDENCE) -> tuple[float, float]:
    """Student-t CI of the mean of the finite `values`: mean +- t((1 + confidence) / 2, n - 1) * s / sqrt(n), s the
    sample standard deviation (see the module docstring for n <= 1 and identical values)."""
    x = _finite(values)
    if (degenerate := _degenerate_interval(x)) is not None:
        return degenerate
    half_width = stats.t.ppf((1 + confidence) / 2, df=len(x) - 1) * x.std(ddof=1) / np.sqrt(len(x))
    return float(x.mean() - half_width), float(x.mean() + half_width)


def iqm(values) -> float:
    """Interquartile mean of the finite values: the mean of the middle 50% (robust to one outlying seed)."""
    x = _finite(values)
    return float(stats.trim_mean(x, 0.25)) if len(x) else float("nan")


def summarize(values) -> dict[str, float]:
    """n, mean, ci_low, ci_high of the finite values."""
    x = _finite(values)
    low, high = t_ci(x)
    return {"n": len(x), "mean": float(x.mean()) if len(x) else float("nan"), "ci_low": low, "ci_high": high}


def mean_ci(frame: pd.DataFrame, metric: str, x: str = "step", by: Sequence[str] = ("group",)) -> pd.DataFrame:
    """Mean over runs and 95% CI of `metric` at each `x` (one value per run and x), per group.

    Columns: *by, x, n, mean, ci_low, ci_high. Runs that did not log the metric at an x do not count there."""
    columns = [*by, x, "n", "mean", "ci_low", "ci_high"]
    if metric not in frame.columns:
        return pd.DataFrame(columns=columns)
    per_run = frame.groupby([*by, "run", x], sort=False)[metric].mean().dropna().reset_index()
    rows = [{**dict(zip([*by, x], key)), **summarize(values)}
            for key, values in per_run.groupby([*by, x], sort=True)[metric]]
    return pd.DataFrame(rows, columns=columns)


# ---------------------------------------------------------------------------------------------------------------------
# Tables


EVAL_PREFIX = "eval/"


def run_finals(steps: pd.DataFrame, metric: str, last_k: int) -> pd.Series:
    """Each run's final value of `metric`, at the end of training.

    Training metrics: the mean over the run's last `last_k` rollout steps that logged it (a diverged or killed
    run: the last steps it reached). Evaluation metrics (`eval/*`): the mean of the evaluations logged at steps
    after the first step of that training window, i.e. of the last `last_k` rollout steps that made an optimizer
    update. An evaluation logged at step s measures the policy before step s's updates, so these are the
    evaluations of the policy trained through the window, including the one after training (step total_steps);
    the pre-RL evaluation at step 0 never counts unless the window starts before it. A run with no such
    evaluation (killed before its next evaluation) gives NaN."""
    if metric.startswith(EVAL_PREFIX):
        return _eval_finals(steps, metric, last_k)
    logged = steps.dropna(subset=[metric]).sort_values(["run", "step"])
    return logged.groupby("run")[metric].apply(lambda s: s.tail(last_k).mean())


def _eval_finals(steps: pd.DataFrame, metric: str, last_k: int) -> pd.Series:
    trained = steps[steps["n_updates"] > 0].sort_values(["run", "step"])
    window_start = trained.groupby("run")["step"].apply(lambda s: s.tail(last_k).min())
    logged = steps.dropna(subset=[metric]).merge(window_start.rename("window_start"), left_on="run", right_index=True)
    after = logged[logged["step"] > logged["window_start"]]
    finals = after.groupby("run")[metric].mean()
    return finals.reindex(window_start.index)


def run_initials(steps: pd.DataFrame, metric: str, first_k: int) -> pd.Series:
    """Each run's starting value of `metric`: evaluations (`eval/*`) at the first step that logged one (the
    pre-RL evaluation at step 0); training metrics the mean over the first `first_k` steps that logged them."""
    logged = steps.dropna(subset=[metric]).sort_values(["run", "step"])
    k = 1 if metric.startswith(EVAL_PREFIX) else first_k
    return logged.groupby("run")[metric].apply(lambda s: s.head(k).mean())


def final_scores(data: RunSet, metrics: Sequence[str], last_k: int = 5) -> pd.DataFrame:
    """Per group and metric: the final score of each run (`run_finals`: training metrics over the last `last_k`
    rollout steps, evaluations after the first of them) summarised over runs.

    Columns: group, metric, n_runs, n_diverged, mean, iqm, std, ci_low, ci_high."""
    rows = []
    for metric in (m for m in metrics if m in data.steps.columns):
        finals = data.runs[["run", "group", "status"]].merge(
            run_finals(data.steps, metric, last_k).rename("final"), left_on="run", right_index=True)
        for group in data.groups:
            runs = finals[finals["group"] == group]
            if not len(runs):
                continue
            summary = summarize(runs["final"])
            rows.append({"group": group, "metric": metric, "n_runs": summary["n"],
                         "n_diverged": int((runs["status"] == "diverged").sum()), "mean": summary["mean"],
                         "iqm": iqm(runs["final"]), "std": float(runs["final"].std(ddof=1)),
                         "ci_low": summary["ci_low"], "ci_high": summary["ci_high"]})
    return pd.DataFrame(rows, columns=["group", "metric", "n_runs", "n_diverged", "mean", "iqm", "std", "ci_low",
                                       "ci_high"])


def layer_churn(routing: pd.DataFrame, probes: Sequence[str] | None = None) -> pd.DataFrame:
    """Churn per MoE layer in both readings: each run's mean over all its comparisons of a probe, then mean and
    95% CI over runs of slot churn (`mean`, `ci_low`, `ci_high`) and of set change (`set_change`, ...).

    Columns: group, probe, layer, n_runs, mean, ci_low, ci_high, set_change, set_change_ci_low,
    set_change_ci_high."""
    columns = ["group", "probe", "layer", "n_runs", "mean", "ci_low", "ci_high", "set_change", "set_change_ci_low",
               "set_change_ci_high"]
    if probes is not None:
        routing = routing[routing["probe"].isin(probes)]
    per_run = routing.groupby(["group", "probe", "layer", "run"])[["churn", "set_change"]].mean().reset_index()
    rows = []
    for (group, probe, layer), runs in per_run.groupby(["group", "probe", "layer"], sort=True):
        slots, sets = summarize(runs["churn"]), summarize(runs["set_change"])
        rows.append({"group": group, "probe": probe, "layer": layer, "n_runs": slots["n"], "mean": slots["mean"],
                     "ci_low": slots["ci_low"], "ci_high": slots["ci_high"], "set_change": sets["mean"],
                     "set_change_ci_low": sets["ci_low"], "set_change_ci_high": sets["ci_high"]})
    return pd.DataFrame(rows, columns=columns)
