"""A report's curve figures redrawn from its committed tables, for studies whose run folders are gone.

`moe-rl report` draws from run folders. results/ keeps only the tables (tables/curves.csv: per group, metric and
rollout step, the mean and 95% CI over runs of the raw values; tables/layer_churn.csv: per group, probe and MoE
layer), so this module redraws the figures those tables hold, to the same print rules as the report (at most
MAX_GROUPS groups per panel: more are split into one file per facet, named by what the facet shares; legends in
words; a band only where a group has two runs or more). Curves are the raw means: these tables carry no per-run
series to smooth, and the caption says so.

    python -m moe_rl.analysis.rebuild results/correction            # rewrites results/correction/figures/...
    python -m moe_rl.analysis.rebuild results/churn_law/report --dry-run

Writes figures/<name>.png, or figures/<name>_<facet>.png for each facet, for the names of REBUILT, and removes the
old figures of those names; where the per-run table is committed (tables/per_run_final.csv) also the figures of
PER_RUN_FIGURES (moe_rl.analysis.churn_figures). Prints each file with its caption. Figures that need the runs'
per-step routing tables (layer_churn_heatmap, churn_layer_profile) cannot be redrawn from results/.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from moe_rl.analysis.churn_figures import fig_churn_scaling_of, fig_churn_vs_policy_change_of, fig_scaling_fit_of
from moe_rl.analysis.panels import (
    LABELS,
    PERCENT,
    facet_groups,
    floor_zeros,
    label_axes,
    label_parts,
    log_if_wide,
    no_data,
    note,
    present,
    slug,
    words,
)
from moe_rl.analysis.style import (
    MARKERS,
    OKABE_ITO,
    ROUTING_LINESTYLES,
    Look,
    in_paper_style,
    keyed_looks,
    new_figure,
    save,
)

STEP = "step"
STABILITY_PANELS = (("clip_ratio/region_mean", True), ("ratio/log_std", False), ("ratio/extreme_frac", True),
                    ("routing/staleness/churn", False), ("routing/rollout/churn", False))
UPDATE_PANELS = ("routing/update/churn", "routing/update/set_change", "routing/update/token_any")
# name -> (what it shows, for the caption)
REBUILT = {
    "reward": "training reward and held-out reward per rollout step",
    "update_churn": "slot churn, set change and tokens re-routed in any layer, per rollout step (mean over the "
                    "step's updates)",
    "stability": "clip fraction, token log-ratio std, extreme-token fraction F(2), staleness and rollout churn per "
                 "rollout step, where not 0 throughout",
    "layer_churn_depth": "update slot churn, update set change and staleness churn per MoE layer (each run's mean "
                         "over its updates, then mean over runs)",
}
# name -> (figure function of the per-run table, caption): drawn where tables/per_run_final.csv is committed; the
# scaling figures only for learning-rate sweeps, as in the report.
PER_RUN_FIGURES = {
    "churn_vs_policy_change": (fig_churn_vs_policy_change_of, "each run's slot churn, set change and tokens "
                               "re-routed against its median KL per update; colour = learning rate, marker = depth"),
    "churn_scaling": (fig_churn_scaling_of, "slot churn (top) and set change (bottom) against learning rate, one "
                      "line per depth, one panel per (experts, top-k), with the GSPO paper's ~10%; bands: 95% CI "
                      "over seeds"),
    "churn_scaling_fit": (fig_scaling_fit_of, "slot churn and set change against the median KL per update, the "
                          "fitted power law per architecture, its extrapolation to 48 layers / 128 experts / top-8 "
                          "with a bootstrap 95% band, and the 10% line"),
}
CAPTION_TAIL = "raw means over runs (no smoothing); bands: 95% CI over seeds where a group has 2+ runs"

def looks_of(groups: list[str]) -> dict[str, Look]:
    """A colour and marker of its own for each group (a facet holds at most MAX_GROUPS, as many as OKABE_ITO's
    colours), and the line style of the first label part that varies inside `groups` (a routing mode's as
    everywhere: native solid, R2 dashed, R3 dotted)."""
    parts = [label_parts(g) for g in groups]
    keys = [k for k in dict.fromkeys(k for p in parts for k in p) if len({p.get(k, "") for p in parts}) > 1]
    first = [p.get(keys[0], "") for p in parts] if keys else [""] * len(groups)
    ranked = keyed_looks(groups, [(0, _sortable(v)) for v in first])  # line style by the value's rank
    return {g: Look(OKABE_ITO[i % len(OKABE_ITO)], ROUTING_LINESTYLES.get(v, ranked[g].linestyle),
                    MARKERS[i % len(MARKERS)]) for i, (g, v) in enumerate(zip(groups, first))}

def _sortable(value: str):
    try:
        return float(value)
    except ValueError:
        return value

def _draw_curves(ax, curves: pd.DataFrame, groups: list[str], looks, metric: str) -> bool:
    """One line per group (raw mean per rollout step), a band where the group has 2+ runs; returns whether any
    band was drawn."""
    rows = curves[(curves["metric"] == metric) & curves["group"].isin(groups)]
    if rows.empty or not present(rows.rename(columns={"mean": metric}), metric):
        no_data(ax, metric)
        return False
    banded, floor = False, None
    if ax.get_yscale() == "log":  # a log axis drops zeros and bands reaching 0: draw them at a floor, and say so
        rows, zeros, floor = _floored(rows)
        if zeros:
            note(ax, f"{zeros} zero means drawn at {100 * floor:.2g}%" if metric in PERCENT else
                 f"{zeros} zero means drawn at {floor:.2g}")
    for group in groups:
        curve = rows[rows["group"] == group].sort_values(STEP)
        look = looks[group]
        ax.plot(curve[STEP], curve["mean"], color=look.color, linestyle=look.linestyle, marker=look.marker,
                markevery=max(1, len(curve) // 8), markersize=3)
        band = curve["n"] > 1
        if band.any():
            ax.fill_between(curve[STEP], curve["ci_low"].where(band), curve["ci_high"].where(band), color=look.color,
                            alpha=0.12, linewidth=0)
            banded = True
    label_axes(ax, STEP, metric, rows[["mean"]].to_numpy().ravel())
    return banded

def _floored(rows: pd.DataFrame) -> tuple[pd.DataFrame, int, float]:
    """Means and CI bounds raised to half the smallest positive mean (for a log axis); the count of zero means."""
    values, zeros, floor = floor_zeros(rows["mean"])
    return rows.assign(mean=values, ci_low=rows["ci_low"].clip(lower=floor),
                       ci_high=rows["ci_high"].clip(lower=floor)), zeros, floor

def _draw_layers(ax, layers: pd.DataFrame, groups: list[str], looks, probe: str, reading: str) -> bool:
    column, low, high = ("mean", "ci_low", "ci_high") if reading == "churn" else (
        "set_change", "set_change_ci_low", "set_change_ci_high")
    rows = layers[(layers["probe"] == probe) & layers["group"].isin(groups)]
    metric = f"routing/{probe}/{reading}"
    if rows.empty or not present(rows.rename(columns={column: metric}), metric):
        no_data(ax, f"routing/ tables of the {probe} probe")
        return False
    for group in groups:
        row = rows[rows["group"] == group].sort_values("layer")
        look = looks[group]
        err = np.vstack([row[column] - row[low], row[high] - row[column]])
        ax.errorbar(row["layer"], row[column], yerr=np.nan_to_num(err), color=look.color, ls=look.linestyle,
                    marker=look.marker, capsize=2, markersize=3)
    label_axes(ax, "layer", metric, rows[low].fillna(rows[column]))
    return bool((rows["n_runs"] > 1).any())

def coinciding(table: pd.DataFrame, groups: list[str], value: str = "mean") -> dict[str, str]:
    """group -> the earlier group whose rows of `table` (every metric, step or layer) it equals: runs that are the
    same by design (native, +TIS and +IcePop under the exact sampler) draw one line, and the legend says so."""
    keys = [c for c in ("metric", "probe", STEP, "layer") if c in table]
    series = {g: table[table["group"] == g].sort_values(keys)[value].to_numpy() for g in groups}
    twins = {}
    for i, group in enumerate(groups):
        twin = next((g for g in groups[:i] if g not in twins and len(series[g]) == len(series[group]) and
                     np.allclose(series[g], series[group], rtol=0, atol=1e-12, equal_nan=True)), None)
        if twin is not None and len(series[group]):
            twins[group] = twin
    return twins

def _legend(fig: Figure, groups: list[str], looks, banded: bool, facet: str, twins: dict[str, str],
            spread: str = "bands") -> None:
    handles = [Line2D([], [], color=looks[g].color, linestyle=looks[g].linestyle, marker=looks[g].marker,
                      label=words(g, drop=facet) + (f" (coincides with {words(twins[g], drop=facet)})"
                                                    if g in twins else "")) for g in groups]
    longest = max(len(h.get_label()) for h in handles)
    ncols = max(1, min(len(handles), int(fig.get_figwidth() // (0.06 * longest + 0.5))))
    fig.set_figheight(fig.get_figheight() + 0.16 * -(-len(handles) // ncols) + (0.25 if facet else 0))  # room below
    title = "raw means over runs" + (f"; {spread}: 95% CI over seeds" if banded else "")
    fig.legend(handles=handles, loc="outside lower center", ncols=ncols, title=title, title_fontsize=6)
    if facet:
        fig.suptitle(words(facet), fontsize=8)

@in_paper_style
def fig_from_tables(name: str, curves: pd.DataFrame, layers: pd.DataFrame, groups: list[str],
                    facet: str = "") -> Figure | None:
    """Figure `name` of REBUILT for `groups` (at most MAX_GROUPS), from a report's curves and layer tables."""
    looks = looks_of(groups)
    if name == "reward":
        metrics = [m for m in ("reward", "eval/reward") if (curves["metric"] == m).any()]
        fig, axes = new_figure(1, len(metrics), width=7.0 if len(metrics) > 1 else 4.0)
        banded = [_draw_curves(ax, curves, groups, looks, m) for ax, m in zip(axes.flat, metrics)]
    elif name in ("update_churn", "stability"):
        specs = [(m, False) for m in UPDATE_PANELS] if name == "update_churn" else list(STABILITY_PANELS)
        mine = curves[curves["group"].isin(groups)]  # a panel all 0 in this facet (rollout churn at exact) is left out
        kept = [(m, log) for m, log in specs if present(_as_metric(mine, m), m)]
        if not kept:
            return None
        cols = min(3, len(kept))
        fig, axes = new_figure(-(-len(kept) // cols), cols, row_height=2.2)
        banded = []
        for ax, (metric, log) in zip(axes.flat, kept):
            if log:
                log_if_wide(ax, "y", curves.loc[curves["metric"] == metric, "mean"])
            banded.append(_draw_curves(ax, curves, groups, looks, metric))
        for ax in list(axes.flat)[len(kept):]:
            ax.set_axis_off()
    elif name == "layer_churn_depth":
        if layers.empty:
            return None
        fig, axes = new_figure(1, 3)
        banded = [_draw_layers(axes[0, 0], layers, groups, looks, "update", "churn"),
                  _draw_layers(axes[0, 1], layers, groups, looks, "update", "set_change"),
                  _draw_layers(axes[0, 2], layers, groups, looks, "staleness", "churn")]
        axes[0, 2].set_ylabel(LABELS["routing/staleness/churn"])
    else:
        raise ValueError(f"figure {name!r}: rebuild draws {', '.join(REBUILT)}")
    table = layers if name == "layer_churn_depth" else curves
    _legend(fig, groups, looks, any(banded), facet, coinciding(table[table["group"].isin(groups)], groups),
            "error bars" if name == "layer_churn_depth" else "bands")
    return fig

def _as_metric(curves: pd.DataFrame, metric: str) -> pd.DataFrame:
    return curves[curves["metric"] == metric].rename(columns={"mean": metric})

def rebuild(folder: Path, dry_run: bool = False) -> list[tuple[Path, str]]:
    """Redraw REBUILT's figures of the report in `folder` from its tables; returns (file, caption) per figure."""
    tables = folder / "tables"
    curves = pd.read_csv(tables / "curves.csv")
    layers = pd.read_csv(tables / "layer_churn.csv") if (tables / "layer_churn.csv").is_file() else pd.DataFrame()
    groups = list(dict.fromkeys(pd.read_csv(tables / "runs.csv")["group"]))
    written = _per_run_figures(folder, dry_run)
    for name, what in REBUILT.items():
        facets = facet_groups(groups)
        if not dry_run:
            for old in (folder / "figures").glob(f"{name}*.png"):
                if old.stem == name or old.stem.startswith(f"{name}_"):
                    old.unlink()
        for facet, chunk in facets:
            fig = fig_from_tables(name, curves, layers, chunk, facet)
            if fig is None:
                continue
            stem = name if len(facets) == 1 else f"{name}_{slug(facet)}"
            path = folder / "figures" / f"{stem}.png"
            if not dry_run:
                save(fig, folder / "figures", stem)
            tail = CAPTION_TAIL.replace("bands", "error bars") if name == "layer_churn_depth" else CAPTION_TAIL
            caption = f"{what}" + (f"; {words(facet)}" if facet else "") + f"; {tail}"
            written.append((path, caption))
    return written

def _per_run_figures(folder: Path, dry_run: bool) -> list[tuple[Path, str]]:
    """PER_RUN_FIGURES from tables/per_run_final.csv, where it is committed (else the figures stay as they are)."""
    path = folder / "tables" / "per_run_final.csv"
    if not path.is_file():
        return []
    per_run = pd.read_csv(path)
    sweeps_lr = per_run["optim.lr"].nunique() > 1
    written = []
    for name, (make, caption) in PER_RUN_FIGURES.items():
        if name != "churn_vs_policy_change" and not sweeps_lr:
            continue
        fig = make(per_run)
        if fig is None:
            continue
        if not dry_run:
            save(fig, folder / "figures", name)
        written.append((folder / "figures" / f"{name}.png", caption))
    return written

def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m moe_rl.analysis.rebuild", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folders", nargs="+", help="report folders holding tables/curves.csv and tables/runs.csv")
    parser.add_argument("--dry-run", action="store_true", help="list the figures and captions, write nothing")
    args = parser.parse_args(argv)
    for folder in map(Path, args.folders):
        for path, caption in rebuild(folder, args.dry_run):
            print(f"{path}: {caption}")

if __name__ == "__main__":
    main()
