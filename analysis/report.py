"""moe-rl report: figures, CSV tables and a Markdown summary of one run, a folder of runs, or a sweep.

Runs are found by their config.json and manifest.json (searched recursively; SFT runs are skipped) and grouped by
the config fields that vary across them, seeds and bookkeeping excluded, unless --group-by names the fields.
Curves are means over a group's runs with 95% CI bands (Student t over seeds); final scores average each run's last
--last-k rollout steps, then summarise over runs (mean, interquartile mean, CI). Running, killed and diverged runs are
included; their status is in the tables and diverged runs are marked where they stopped.

    <out>/README.md                        the command, the runs, final scores, the config that produced them
    <out>/figures/<name>.png               see moe_rl.analysis.plots.FIGURES and docs/analysis.md
    <out>/tables/runs.csv                  one row per run: group, seed, status, reason, last step, config
    <out>/tables/final_scores.csv          per group and metric: n_runs, n_diverged, mean, iqm, std, ci_low, ci_high
    <out>/tables/layer_churn.csv           per group, probe and layer: churn mean and 95% CI over runs
    <out>/tables/churn_vs_lr_depth.csv     per group, learning rate and depth: update churn and policy change
    <out>/tables/learning.csv              per group: held-out reward before/after RL, gain with CI, collapses
    <out>/tables/curves.csv                per group, metric and rollout step: mean and 95% CI over runs of the
                                           raw values (the figures smooth long runs; this table never does)
    <out>/tables/per_run_final.csv         per run: the values every table above summarises (moe_rl.analysis.per_run)
    <out>/tables/per_run_eval.csv          per run and evaluation step: the held-out curves
    <out>/tables/paired_comparisons.csv    sweeps of several methods with seeds: paired differences, Holm, TOST
    <out>/tables/scaling_set_change_check.csv  lr sweeps: per top-k, set change / slot churn against 1-(1-c)^K / c
    <out>/tables/against_baseline.csv      with --baseline: each group's final held-out minus the warm start's best

    moe-rl report runs/ --out results/churn
    moe-rl report sweeps/objectives --out results/objectives --group-by objective.name routing_mode --last-k 10
    moe-rl report sweeps/correction --out results/correction --baseline sweeps/correction/warmstart/<key>/evaluate
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import shlex
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import pandas as pd
import tyro

from moe_rl.analysis.aggregate import add_groups, final_scores, group_keys, layer_churn, mean_ci, run_finals
from moe_rl.analysis.baseline import against_baseline, read_baseline, with_baseline
from moe_rl.analysis.cells import churn_vs_lr_depth, run_summary
from moe_rl.analysis.comparisons import paired_comparisons
from moe_rl.analysis.learning import learning_table
from moe_rl.analysis.load import INFO_COLUMNS, RunSet, distinct_values, load_runs
from moe_rl.analysis.panels import SMOOTH_MIN_WINDOWS, facet_groups, slug, words
from moe_rl.analysis.per_run import per_run_eval, per_run_final, warm_start_name
from moe_rl.analysis.plots import FIGURES, SMOOTH_STEPS, looks_for
from moe_rl.analysis.report_text import (
    baseline_section,
    learning_markdown,
    no_rl_signal_markdown,
    no_rl_signal_runs,
    paired_markdown,
    scaling_markdown,
    skipped_markdown,
)
from moe_rl.analysis.scaling import (
    coefficient_table,
    extrapolation_table,
    held_out_check,
    near_level_cells,
    set_change_check,
    split_target,
    warm_start_cluster,
)
from moe_rl.analysis.style import FORMATS, save
from moe_rl.errors import ConfigError, check_positive
from moe_rl.runs.claim import check_out_dir
from moe_rl.runs.provenance import git_state, utc_now

FINAL_METRICS = ("reward", "eval/reward", "eval/greedy", "completions/mean_length", "routing/update/churn",
                 "routing/update/set_change", "routing/update/token_any", "routing/rollout/set_change",
                 "routing/rollout/token_any", "update/kl",
                 "update/log_ratio_abs_mean", "clip_ratio/region_mean", "ratio/extreme_frac", "entropy",
                 # sampler vs trainer (docs/metrics.md, "Train-inference mismatch"), where a run logs them
                 "rollout/kl", "rollout/k1", "rollout/chi2_token", "rollout/ppl_ratio", "rollout/extreme_frac",
                 "routing/rollout/churn", "routing/replay/replace_rate", "correction/ess",
                 "correction/truncated_frac", "correction/zeroed_frac", "correction/masked_frac")
CURVE_METRICS = ("reward", "eval/reward", "eval/greedy", "completions/mean_length", "routing/update/churn",
                 "routing/update/set_change",
                 "routing/update/token_any", "routing/staleness/churn",
                 "routing/rollout/churn", "update/kl", "clip_ratio/region_mean", "ratio/log_std",
                 "ratio/extreme_frac")


@dataclass
class ReportConfig:
    """What to report on and where to write it."""

    runs: Annotated[str, tyro.conf.Positional, tyro.conf.arg(metavar="RUNS")]
    """A run directory, a folder of runs, or a sweep directory (searched recursively)."""
    out: str | None = None
    """Output folder for README.md, figures/ and tables/ (created; a report replaces its own earlier report there,
    refuses a README.md, figures/ or tables/ it did not write, and leaves other files alone). None: RUNS/report,
    next to the runs it describes (never into the committed results/ unless asked for)."""
    group_by: Annotated[tuple[str, ...], tyro.conf.arg(metavar="KEY [KEY ...]")] = ()
    """Config fields that define groups, e.g. `objective.name routing_mode`; none given: every field that varies
    across the runs, except seeds and bookkeeping (out_dir, device, log.*, ...)."""
    last_k: int = 5
    """Final scores average each run's last k rollout steps."""
    baseline: str | None = None
    """The warm start's `moe-rl evaluate` output (evaluate.json, or the folder holding it): the baseline row of the
    learning table (held-out at its best temperature on validation, and greedy) and each group's final held-out
    against it (tables/against_baseline.csv). None: no baseline row."""
    equivalence_margin: float = 0.05
    """Margin of the TOST equivalence test in tables/paired_comparisons.csv, in the metrics' units (held-out and
    training reward, both in [0, 1]): two methods are called equivalent only when their paired difference lies
    within +-margin at level 0.05. State it before the runs; written into the command line above the report."""

    def __post_init__(self) -> None:
        self.runs = os.path.expanduser(self.runs)  # a shell leaves `--out=~/...` as it is
        if self.out is None:
            self.out = str(Path(self.runs) / "report")
        self.out = os.path.expanduser(self.out)
        check_positive("last_k", self.last_k)
        if self.baseline is not None:
            path = Path(self.baseline)
            if not (path.is_file() or (path / "evaluate.json").is_file()):
                raise ConfigError(f"baseline={self.baseline!r}: no evaluate.json there; give the file "
                                  "`moe-rl evaluate` wrote, or the folder holding it (by default "
                                  "<warm start>/evaluate)")
        check_positive("equivalence_margin", self.equivalence_margin)


def command_line(cfg: ReportConfig) -> str:
    """The `moe-rl report` command that makes this report, every option spelled out."""
    parts = ["moe-rl", "report", cfg.runs, "--out", cfg.out]
    if cfg.group_by:
        parts += ["--group-by", *cfg.group_by]
    parts += ["--last-k", str(cfg.last_k), "--equivalence-margin", f"{cfg.equivalence_margin:g}"]
    if cfg.baseline:
        parts += ["--baseline", cfg.baseline]
    return shlex.join(parts)


REPORT_FILES = ("README.md", "figures", "tables")  # what a report writes into --out (and replaces there)


def report(cfg: ReportConfig) -> Path:
    """Write the report of `cfg.runs` into `cfg.out`; returns the output folder.

    The report owns README.md, figures/ and tables/ in --out (anything else there is left alone): a README.md it
    did not write, or figures/ or tables/ beside no report README, is refused before anything is written. The
    report is made in a temporary folder inside --out and moved into place under a lock on the folder, so two
    reports into one --out at once leave one whole report (the last), never a README from one and tables from
    the other."""
    if not cfg.out.strip():
        raise ConfigError("--out is empty: give the report's folder (e.g. --out results/<name>)")
    check_out_dir(cfg.out, "--out")
    out = Path(cfg.out)
    check_report_folder(out)
    data = load_runs(cfg.runs)
    data = add_groups(data, group_keys(data, cfg.group_by))
    data.runs = relative_paths(data.runs, out)
    baseline = read_baseline(cfg.baseline) if cfg.baseline else None
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(dir=out, prefix=".report-"))
    try:
        tables = write_tables(data, work / "tables", cfg.last_k, cfg.equivalence_margin, baseline)
        figures, skipped = write_figures(data, work / "figures")
        (work / "figures").mkdir(exist_ok=True)
        paired = paired_markdown(tables.get("paired_comparisons"), cfg.equivalence_margin)
        learning = learning_markdown(tables["learning"]) + baseline_section(baseline, tables.get("against_baseline"))
        dropped = dropped_runs(data, FINAL_METRICS, cfg.last_k)
        text = summary_markdown(data, cfg, tables["final_scores"], figures,
                                learning + (paired + "\n" if paired else ""), dropped)
        no_signal = no_rl_signal_runs(data.metrics)
        text += no_rl_signal_markdown(no_signal) + scaling_markdown(tables) + skipped_markdown(skipped)
        (work / "README.md").write_text(text, encoding="utf-8")
        move_into_place(work, out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    notes = [f"{len(data.missing)} planned run(s) of the sweep have no run directory ({_listed(data.missing)})"
             ] if data.missing else []
    notes += [f"{metric} has no finite value in {_listed(runs)}, left out of its scores"
              for metric, runs in dropped.items()]
    if not no_signal.empty:
        notes.append(f"churn without RL signal (all advantages zero) in {_listed(list(no_signal['run']))}: the "
                     "README's 'Churn without RL signal' section")
    print(f"moe-rl report: {len(data.runs)} runs in {len(data.groups)} groups -> {out}/README.md, "
          f"{len(figures)} figures, {len(tables)} tables" + "".join(f"; note: {n}" for n in notes))
    return out


def _listed(names: list[str], limit: int = 5) -> str:
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")


def is_report_readme(path: Path) -> bool:
    """A README.md written by `moe-rl report`: its title line, then "Made by"."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()[:3]
    except (OSError, UnicodeDecodeError):
        return False
    return len(lines) == 3 and lines[0].startswith("# Report: ") and lines[2] == "Made by"


def check_report_folder(out: Path) -> None:
    """Refuse an --out whose README.md, figures/ or tables/ the report did not write (ConfigError, one line)."""
    readme = out / "README.md"
    if readme.exists():
        if not is_report_readme(readme):
            raise ConfigError(f"--out {out}: {readme} was not written by moe-rl report, which would replace it; "
                              "nothing was written: choose another --out, or move the file")
        return
    held = [name for name in REPORT_FILES[1:] if (out / name).exists()
            and (not (out / name).is_dir() or any((out / name).iterdir()))]
    if held:
        raise ConfigError(f"--out {out} holds {' and '.join(f'{n}/' for n in held)} but no report README.md: they "
                          "were not written by moe-rl report, which would replace them; nothing was written: choose "
                          "another --out")


def move_into_place(work: Path, out: Path) -> None:
    """Replace README.md, figures/ and tables/ of `out` by those made in `work`, under an exclusive lock on `out`
    (one report at a time; checked again under it). What is replaced goes into `work`, removed by the caller."""
    handle = os.open(out, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(handle, fcntl.LOCK_EX)
        check_report_folder(out)
        old = work / ".replaced"
        old.mkdir()
        for name in REPORT_FILES:
            if (out / name).exists():
                os.replace(out / name, old / name)
            os.replace(work / name, out / name)
    finally:
        os.close(handle)  # releases the lock


def dropped_runs(data: RunSet, metrics, last_k: int) -> dict[str, list[str]]:
    """{metric: runs} of the runs whose final value of a metric is missing (never finite) while another run of their
    group has one: final_scores leaves them out, and the README says so."""
    dropped: dict[str, list[str]] = {}
    for metric in (m for m in metrics if m in data.steps.columns):
        finals = run_finals(data.steps, metric, last_k).dropna()
        have = set(data.runs.loc[data.runs["run"].isin(finals.index), "group"])
        runs = data.runs[~data.runs["run"].isin(finals.index) & data.runs["group"].isin(have)]["run"].tolist()
        if runs:
            dropped[metric] = sorted(runs)
    return dropped


def relative_paths(frame: pd.DataFrame, base: Path) -> pd.DataFrame:
    """`frame` with every absolute path (a text value starting with the root) written relative to `base`, the
    report folder: committed tables must not name the machine they were made on."""
    base = Path(base).absolute()

    def relative(value):
        if isinstance(value, str) and os.path.isabs(value):
            return os.path.relpath(value, base)
        return value

    text = [c for c in frame.columns if frame[c].dtype == object or pd.api.types.is_string_dtype(frame[c])]
    return frame.assign(**{c: frame[c].map(relative) for c in text})


def relative_json(value, base: Path):
    """A JSON value (sweep.json, a config) with its absolute paths written relative to `base`."""
    if isinstance(value, dict):
        return {key: relative_json(item, base) for key, item in value.items()}
    if isinstance(value, list):
        return [relative_json(item, base) for item in value]
    if isinstance(value, str) and os.path.isabs(value):
        return os.path.relpath(value, Path(base).absolute())
    return value


def write_tables(data: RunSet, folder: Path, last_k: int, margin: float = 0.05,
                 baseline: dict | None = None) -> dict[str, pd.DataFrame]:
    cells = churn_vs_lr_depth(data, last_k)
    summary = run_summary(data, last_k)
    per_run = per_run_final(data, FINAL_METRICS, last_k, summary)
    tables = {
        "runs": data.runs[["run", "group", *[c for c in data.runs.columns if c not in ("run", "group")]]],
        "final_scores": final_scores(data, FINAL_METRICS, last_k),
        "layer_churn": layer_churn(data.routing) if len(data.routing) else pd.DataFrame(),
        "churn_vs_lr_depth": cells,
        "learning": learning_table(data, last_k),
        "curves": pd.concat([mean_ci(data.steps, m, x="step").assign(metric=m) for m in CURVE_METRICS
                             if m in data.steps.columns] or [pd.DataFrame()], ignore_index=True),
        "per_run_final": per_run,
        "per_run_eval": per_run_eval(data),
    }
    if baseline is not None:
        tables["learning"] = with_baseline(tables["learning"], baseline)
        tables["against_baseline"] = against_baseline(per_run, baseline)
    paired = paired_comparisons(per_run, data.group_by, margin=margin)
    if (paired["n_pairs"] >= 2).any():  # more than one method, and seeds to pair
        tables["paired_comparisons"] = paired
    tables.update(scaling_tables(data, cells, summary))
    folder.mkdir(parents=True, exist_ok=True)
    for name, table in tables.items():
        table.to_csv(folder / f"{name}.csv", index=False)
    return tables


def scaling_tables(data: RunSet, cells: pd.DataFrame, summary: pd.DataFrame) -> dict[str, pd.DataFrame]:
    """The churn scaling fit (moe_rl.analysis.scaling), for sweeps of the learning rate that log both readings;
    `summary` is run_summary(data, last_k)."""
    per_run = summary[summary["run"].map(data.runs.set_index("run")["status"]) != "diverged"].copy()
    if per_run["optim.lr"].nunique() < 2 or per_run[["churn", "set_change", "kl_median"]].isna().all().any():
        return {}
    per_run["learns"] = per_run["group"].map(cells.set_index("group")["learns"]).fillna(False).astype(bool)
    if "init_from" in data.runs:
        per_run["init_from"] = per_run["run"].map(data.runs.set_index("run")["init_from"].map(warm_start_name))
    fit_runs, paper_runs = split_target(per_run)
    # A log-log law needs runs whose routing moved: a dense twin's (one expert) never does, and has no law to fit.
    moved = fit_runs[(fit_runs["churn"] > 0) & (fit_runs["set_change"] > 0)]
    if fit_runs["optim.lr"].nunique() < 2 or moved["optim.lr"].nunique() < 2:
        return {}
    cluster = warm_start_cluster(fit_runs)
    tables = {"scaling_fit": coefficient_table(fit_runs, cluster=cluster),
              "scaling_extrapolation": extrapolation_table(fit_runs, cluster=cluster),
              "scaling_set_change_check": set_change_check(fit_runs), "near_10pct": near_level_cells(cells)}
    tables["scaling_fit"]["bootstrap"] = "warm starts within architectures, then runs" if cluster else "runs"
    if len(paper_runs):
        tables["scaling_check"] = held_out_check(fit_runs, paper_runs, cluster=cluster)
    return tables


SPLIT_FIGURES = ("update_churn", "layer_churn_depth", "reward", "stability")  # one line per group: facets beyond 8


def write_figures(data: RunSet, folder: Path) -> tuple[list[str], list[str]]:
    """Every figure of FIGURES that applies to these runs; returns the files written (stems: `reward`, or
    `reward_<facet>` for each facet of a figure of one line per group when there are more than MAX_GROUPS groups)
    and the panels left out (all zero or not logged), as "figure: panel (why)"."""
    written, skipped = [], []
    for name, (make, _) in FIGURES.items():
        facets = facet_groups(data.groups) if name in SPLIT_FIGURES else [("", data.groups)]
        for facet, groups in facets:
            part = data if not facet else subset_groups(data, groups)
            fig = make(part, looks_for(part))
            if fig is None:
                continue
            if facet:
                fig.suptitle(words(facet), fontsize=8)
            stem = f"{name}_{slug(facet)}" if facet else name
            skipped += [f"{stem}: {panel}" for panel in getattr(fig, "skipped_panels", [])]
            save(fig, folder, stem, FORMATS)
            written.append(stem)
    return written, skipped


def subset_groups(data: RunSet, groups: list[str]) -> RunSet:
    """`data` restricted to the runs of `groups` (a facet of a figure)."""
    def keep(frame: pd.DataFrame) -> pd.DataFrame:
        return frame[frame["group"].isin(groups)] if "group" in frame else frame

    return dataclasses.replace(data, runs=keep(data.runs), metrics=keep(data.metrics), steps=keep(data.steps),
                               routing=keep(data.routing), groups=list(groups))


def figure_of(stem: str) -> str:
    """The FIGURES name a written file stem belongs to ('reward_bf16_sampler' -> 'reward')."""
    return stem if stem in FIGURES else next(n for n in SPLIT_FIGURES if stem.startswith(f"{n}_"))


# ---------------------------------------------------------------------------------------------------------------------
# README.md


def markdown_table(frame: pd.DataFrame) -> str:
    """A GitHub-flavoured Markdown table; floats to 4 significant digits, missing values blank."""
    def cell(value) -> str:
        if value is None or (isinstance(value, float) and pd.isna(value)):
            return ""
        text = f"{value:.4g}" if isinstance(value, float) else str(value)
        return text.replace("|", "\\|").replace("\n", " ")

    header = "| " + " | ".join(map(str, frame.columns)) + " |"
    rule = "|" + "---|" * len(frame.columns)
    rows = ["| " + " | ".join(cell(v) for v in row) + " |" for row in frame.itertuples(index=False)]
    return "\n".join([header, rule, *rows])


def _shared_config(data: RunSet) -> dict:
    """Config fields with one value across all runs (the fixed part of the experiment)."""
    fields = [c for c in data.runs.columns if c not in INFO_COLUMNS and c != "group"]
    shared = {key: data.runs[key].iloc[0] for key in fields if distinct_values(data.runs[key]) == 1}
    return {key: value.item() if hasattr(value, "item") else value for key, value in shared.items()}


def summary_markdown(data: RunSet, cfg: ReportConfig, finals: pd.DataFrame, figures: list[str],
                     learning: str = "", dropped: dict[str, list[str]] | None = None) -> str:
    status = data.runs["status"].value_counts().to_dict()
    varying = [k for k in data.varying() if k != "out_dir"]
    runs = data.runs[["run", "group", "seed", "status", "last_step", "reason", *varying]]
    shas = sorted({sha for sha in data.runs["git_sha"] if sha})
    code = git_state(Path(__file__).parent, ignore=("results",))  # the report's own output is not code
    code_version = f"{code['sha']}{' (uncommitted changes)' if code['dirty'] else ''}" if code["sha"] else "unknown"
    finals = finals.assign(ci=[f"[{lo:.4g}, {hi:.4g}]" if pd.notna(lo) else "" for lo, hi in
                               zip(finals["ci_low"], finals["ci_high"])])
    lines = [
        f"# Report: {Path(cfg.runs).name or cfg.runs}",
        "",
        "Made by", "", "```", command_line(cfg), "```", "",
        f"on {utc_now()} (analysis code git {code_version}). "
        f"Source: `{cfg.runs}`; runs' code git: {', '.join(shas) or 'unknown'}. Paths in the tables are relative "
        "to this folder.",
        "",
        f"{len(data.runs)} runs ({', '.join(f'{n} {s}' for s, n in status.items())}) in {len(data.groups)} "
        f"groups by {', '.join(f'`{k}`' for k in data.group_by) or 'nothing (one group)'}."
        + (f" Skipped (not RL runs): {', '.join(data.skipped)}." if data.skipped else "")
        + (f" Missing: {len(data.missing)} run(s) that sweep.json plans have no run directory under runs/ (not "
           f"started, or deleted): {', '.join(data.missing)}." if data.missing else ""),
        "",
        learning + "## Final scores",
        "",
        f"Training metrics: each run's mean over its last {cfg.last_k} rollout steps; held-out metrics (`eval/*`): "
        f"the evaluations after the first of those steps (the policy after training, never the pre-RL step-0 "
        "evaluation). Then mean, interquartile mean (IQM) and 95% CI of the mean over the runs of a group (Student t) "
        "(no CI from a single run). Diverged runs count with the steps they reached. Churn is shown in both "
        "readings: `routing/update/churn` is slot churn (share of a token's K experts that change per update), "
        "`routing/update/set_change` the share of (token, layer) decisions whose top-K set changed, "
        "`routing/update/token_any` the share of tokens whose path changed in any layer. `update/kl` is "
        "heavy-tailed: read its IQM, or the per-run medians in `tables/churn_vs_lr_depth.csv`.",
        "",
        markdown_table(finals[["group", "metric", "n_runs", "n_diverged", "mean", "iqm", "ci"]]),
        "",
        *[f"Left out of `{metric}` (no finite value in the window; n_runs counts the others): "
          f"{', '.join(runs)}.\n" for metric, runs in (dropped or {}).items()],
        "## Figures",
        "",
        *[f"- `figures/{stem}.png`: {FIGURES[figure_of(stem)][1]}." for stem in figures],
        "",
        f"Time series are rolling means over {SMOOTH_STEPS} rollout steps per run for runs of at least "
        f"{SMOOTH_MIN_WINDOWS * SMOOTH_STEPS} steps (shorter runs are drawn raw), then mean and 95% CI over "
        "seeds; tables/curves.csv holds the mean and CI of the raw values. How to read each figure: "
        "docs/analysis.md. Tables (CSV) are in `tables/`: runs, final_scores, "
        "layer_churn, churn_vs_lr_depth (one row per cell: both churn readings, median KL, held-out reward before "
        "and after RL, with CIs over seeds), curves, per_run_final and per_run_eval (the per-run values every "
        "other table summarises, and each run's held-out evaluations), for sweeps of several methods with seeds "
        "paired_comparisons, and for learning-rate sweeps scaling_fit, scaling_extrapolation and near_10pct.",
        "",
        "## Runs",
        "",
        markdown_table(runs),
        "",
        "## Config",
        "",
        "Fields shared by every run (flattened config.json; the fields that differ are columns of the runs "
        "table above and of `tables/runs.csv`):",
        "",
        "```json", json.dumps(_shared_config(data), indent=1, default=str), "```",
    ]
    if data.sweep is not None:
        sweep_json = json.dumps(relative_json(data.sweep, Path(cfg.out)), indent=1, default=str)
        lines += ["", "sweep.json:", "", "```json", sweep_json, "```"]
    return "\n".join(lines) + "\n"
