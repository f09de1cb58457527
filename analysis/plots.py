"""Figures of expert churn, reward and stability, from a grouped RunSet (analysis.aggregate.add_groups).

Every `fig_*` function takes (data, looks) and returns a matplotlib Figure; `draw_*` functions draw one panel on
an Axes, so the comparison figure reuses the panels of the others. Curves are the mean over the runs of a group
with a 95% bootstrap band (analysis.aggregate.mean_ci); a cross marks where a diverged run stopped. FIGURES lists
the report's figures with what each shows (docs/analysis.md explains how to read them).

    data = add_groups(load_runs("runs/"), ["objective.name", "routing_mode"])
    save(fig_update_churn(data, looks_for(data)), "results/x/figures", "update_churn")
"""

from __future__ import annotations

import textwrap
from collections.abc import Callable

import numpy as np
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.colors import LogNorm
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import MaxNLocator, NullFormatter

from analysis.aggregate import layer_churn, mean_ci
from analysis.churn_figures import fig_churn_layer_profile, fig_churn_scaling
from analysis.load import RunSet
from analysis.style import MARKERS, SEQUENTIAL_CMAP, Look, group_looks, in_paper_style, new_figure, percent_formatter

Looks = dict[str, Look]

# Axis labels, with units. Churn-like quantities are fractions shown as percentages.
LABELS = {
    "routing/update/churn": "update churn\n(% of active experts)",
    "routing/update/token_any": "tokens re-routed\nin any layer (%)",
    "routing/staleness/churn": "staleness churn\nvs theta_old (%)",
    "routing/rollout/churn": "rollout churn\nsampler vs trainer (%)",
    "reward": "reward\n(rollout batch mean)",
    "eval/reward": "held-out reward\n(mean)",
    "clip_ratio/region_mean": "clipped tokens (%)",
    "ratio/log_std": "std of token log w\n(nats)",
    "ratio/extreme_frac": "F(2): tokens with\nmax(w, 1/w) > 2 (%)",
    "update/kl": "KL(before || after) per token, per update (nats)",
    "update/log_ratio_abs_mean": "mean |log w| per token, per update (nats)",
}
PERCENT = {"routing/update/churn", "routing/update/token_any", "routing/staleness/churn", "routing/rollout/churn",
           "clip_ratio/region_mean", "ratio/extreme_frac"}
X_LABELS = {"update": "optimizer step", "step": "rollout step", "minibatch": "minibatch j of the rollout step",
            "layer": "MoE layer (0 = nearest the input)"}


def looks_for(data: RunSet) -> Looks:
    """Colours per group (per objective when only objective and routing mode vary); line styles per routing mode
    when the routing mode is a group key."""
    first_run = data.runs.drop_duplicates("group").set_index("group")
    modes = [first_run.loc[g, "routing_mode"] for g in data.groups] if "routing_mode" in data.group_by else None
    by_objective = "objective.name" in data.group_by and set(data.group_by) <= {"objective.name", "routing_mode"}
    objectives = [first_run.loc[g, "objective.name"] for g in data.groups] if by_objective else None
    return group_looks(data.groups, modes, objectives)


# ---------------------------------------------------------------------------------------------------------------------
# Panels


def _no_data(ax: Axes, what: str) -> None:
    ax.text(0.5, 0.5, f"not logged:\n{what}", transform=ax.transAxes, ha="center", va="center", color="0.4")


def _label(ax: Axes, x: str, metric: str, values=()) -> None:
    """Axis labels; percent ticks for fractions; a floor at 0 for a non-negative linear axis."""
    ax.set_xlabel(X_LABELS.get(x, x))
    ax.set_ylabel(LABELS.get(metric, metric))
    if metric in PERCENT:
        _percent_axis(ax.yaxis)
    values = np.asarray(values, dtype=float)
    values = values[np.isfinite(values)]
    if ax.get_yscale() == "linear" and len(values) and values.min() >= 0:
        ax.set_ylim(bottom=0)
    if x in ("update", "step", "minibatch", "layer"):
        # At most ~5 integer ticks: the narrow panels of the stability figure have no room for more labels.
        ax.xaxis.set_major_locator(MaxNLocator(nbins=5, integer=True))


def _percent_axis(axis) -> None:
    axis.set_major_formatter(percent_formatter())
    axis.set_minor_formatter(NullFormatter())  # log axes: decade labels only, no crowded 2x, 3x, ... labels


def _log_if_wide(ax: Axes, which: str, values) -> bool:
    """Log scale on axis `which` ("x" or "y") when the positive values span more than a factor of 10 (then at
    least one labelled decade is in view); zeros are left out of a log axis. Returns whether it switched."""
    values = np.asarray(values, dtype=float)
    positive = values[np.isfinite(values) & (values > 0)]
    if not len(positive) or positive.max() <= 10 * positive.min():
        return False
    getattr(ax, f"set_{which}scale")("log", nonpositive="mask")
    getattr(ax, f"{which}axis").set_minor_formatter(NullFormatter())
    return True


def draw_curves(ax: Axes, data: RunSet, looks: Looks, frame: pd.DataFrame, metric: str, x: str,
                log: bool = False) -> None:
    """Mean over each group's runs with a 95% bootstrap band; diverged runs marked where they stopped."""
    summary = mean_ci(frame, metric, x=x)
    if summary.empty:
        return _no_data(ax, metric)
    if log:
        _log_if_wide(ax, "y", summary["mean"])
    for group in data.groups:
        curve = summary[summary["group"] == group]
        look = looks[group]
        ax.plot(curve[x], curve["mean"], color=look.color, linestyle=look.linestyle,
                marker=look.marker if len(curve) < 12 else None, label=group)
        ax.fill_between(curve[x], curve["ci_low"], curve["ci_high"], color=look.color, alpha=0.2, linewidth=0)
    _mark_diverged(ax, data, looks, frame, metric, x)
    _label(ax, x, metric, summary[["mean", "ci_low"]].to_numpy().ravel())


def _mark_diverged(ax: Axes, data: RunSet, looks: Looks, frame: pd.DataFrame, metric: str, x: str) -> None:
    """A cross at the last finite value of each diverged run."""
    diverged = frame[(frame["status"] == "diverged") & np.isfinite(frame[metric])]
    for _, last in diverged.sort_values(x).groupby("run").tail(1).iterrows():
        ax.scatter(last[x], last[metric], marker="x", s=36, linewidths=1.5, color=looks[last["group"]].color,
                   zorder=4)


def draw_layer_curves(ax: Axes, data: RunSet, looks: Looks, probe: str = "update") -> None:
    """Churn per MoE layer (each run's mean over the run), mean and 95% CI over runs, one line per group."""
    table = layer_churn(data.routing, [probe]) if len(data.routing) else pd.DataFrame()
    if table.empty:
        return _no_data(ax, f"routing/ tables of the {probe} probe")
    for group in data.groups:
        rows = table[table["group"] == group]
        look = looks[group]
        err = np.vstack([rows["mean"] - rows["ci_low"], rows["ci_high"] - rows["mean"]])
        ax.errorbar(rows["layer"], rows["mean"], yerr=np.nan_to_num(err), color=look.color, ls=look.linestyle,
                    marker=look.marker, capsize=2, label=group)
    _label(ax, "layer", f"routing/{probe}/churn", table["ci_low"].fillna(table["mean"]))


def _legend(fig: Figure, data: RunSet, looks: Looks) -> None:
    """One legend for the figure, below the panels; a cross for 'diverged' if any run diverged."""
    handles = [Line2D([], [], color=looks[g].color, linestyle=looks[g].linestyle, marker=looks[g].marker,
                      label=g) for g in data.groups]
    if (data.runs["status"] == "diverged").any():
        handles.append(Line2D([], [], color="0.2", marker="x", linestyle="none", label="diverged (run stopped)"))
    # As many columns as fit the figure's width (about 0.06 inch per character at 7 pt, plus the handle).
    entry_width = 0.06 * max(len(h.get_label()) for h in handles) + 0.5
    ncols = max(1, min(len(handles), int(fig.get_figwidth() // entry_width)))
    rows = -(-len(handles) // ncols)
    if rows > 2:  # make room below the panels instead of squeezing them (a sweep can have dozens of groups)
        fig.set_figheight(fig.get_figheight() + 0.16 * rows)
    fig.legend(handles=handles, loc="outside lower center", ncols=ncols)


# ---------------------------------------------------------------------------------------------------------------------
# Figures


@in_paper_style
def fig_update_churn(data: RunSet, looks: Looks) -> Figure:
    fig, axes = new_figure(1, 2)
    draw_curves(axes[0, 0], data, looks, data.metrics, "routing/update/churn", "update")
    draw_curves(axes[0, 1], data, looks, data.metrics, "routing/update/token_any", "update")
    _legend(fig, data, looks)
    return fig


@in_paper_style
def fig_layer_heatmap(data: RunSet, looks: Looks) -> Figure:
    """Update churn per (layer, rollout step), mean over the step's updates and the group's runs; one panel per
    group, one colour scale."""
    update = data.routing[data.routing["probe"] == "update"]
    grids = {group: update[update["group"] == group].pivot_table(index="layer", columns="step", values="churn",
                                                                aggfunc="mean") for group in data.groups}
    n_cols = min(3, len(data.groups))
    fig, axes = new_figure(-(-len(data.groups) // n_cols), n_cols, row_height=2.0, sharey=True)
    vmax = max((grid.to_numpy().max() for grid in grids.values() if not grid.empty), default=0) or 1.0
    mesh = None
    for ax, (group, grid) in zip(axes.flat, grids.items()):
        ax.set_title(textwrap.fill(group, 32))
        ax.grid(False)
        if grid.empty:
            _no_data(ax, "routing/ tables of\nthe update probe")
            ax.set_xticks([])
            continue
        mesh = ax.pcolormesh(grid.columns, grid.index, grid.to_numpy(), shading="nearest", cmap=SEQUENTIAL_CMAP,
                             vmin=0, vmax=vmax)
        ax.set_xlabel(X_LABELS["step"])
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    for ax in axes[:, 0]:
        ax.set_ylabel("MoE layer")
    for ax in list(axes.flat)[len(data.groups):]:
        ax.set_axis_off()
    if mesh is not None:
        fig.colorbar(mesh, ax=axes, label="update churn (% of active experts)", format=percent_formatter())
    return fig


@in_paper_style
def fig_layer_depth(data: RunSet, looks: Looks) -> Figure:
    fig, axes = new_figure(1, 2)
    draw_layer_curves(axes[0, 0], data, looks, "update")
    draw_layer_curves(axes[0, 1], data, looks, "staleness")
    _legend(fig, data, looks)
    return fig


@in_paper_style
def fig_churn_vs_policy_change(data: RunSet, looks: Looks) -> Figure:
    """Update churn against the per-update policy change: a small point per optimizer step and an outlined point
    per run (its means); colour = learning rate, marker = depth. Axes turn logarithmic when the values span more
    than a factor of 10 (a learning-rate sweep); zeros are left out either way, so the two views match."""
    churn, changes = "routing/update/churn", ("update/kl", "update/log_ratio_abs_mean")
    fig, axes = new_figure(1, 2, row_height=2.6)
    if churn not in data.metrics or any(c not in data.metrics for c in changes):
        for ax in axes.flat:
            _no_data(ax, f"{churn} and update/*")
        return fig
    frame = data.with_config(data.metrics, ["optim.lr", "model.n_layers"])
    points = frame[[churn, *changes, "optim.lr", "model.n_layers", "run"]].dropna()
    shown = points[(points[[churn, *changes]] > 0).all(axis=1)]
    norm = _lr_norm(shown["optim.lr"]) if len(shown) else None
    depths = sorted(shown["model.n_layers"].unique())
    per_run = shown.groupby("run").agg({churn: "mean", **{c: "mean" for c in changes}, "optim.lr": "first",
                                        "model.n_layers": "first"})
    mappable = None
    for ax, change in zip(axes.flat, changes):
        for i, depth in enumerate(depths):
            marker = MARKERS[i % len(MARKERS)]
            steps, runs = shown[shown["model.n_layers"] == depth], per_run[per_run["model.n_layers"] == depth]
            ax.scatter(steps[change], steps[churn], c=steps["optim.lr"], norm=norm, cmap=SEQUENTIAL_CMAP, s=6,
                       alpha=0.35, marker=marker, linewidths=0)
            mappable = ax.scatter(runs[change], runs[churn], c=runs["optim.lr"], norm=norm, cmap=SEQUENTIAL_CMAP,
                                  s=40, marker=marker, edgecolors="black", linewidths=0.7, label=f"{depth:g} layers")
        _log_if_wide(ax, "x", shown[change])
        _log_if_wide(ax, "y", shown[churn])
        if len(points) > len(shown):
            ax.text(0.02, 0.98, f"{len(points) - len(shown)} of {len(points)} steps have a zero: not shown",
                    transform=ax.transAxes, va="top", fontsize=6, color="0.4")
        ax.set_xlabel(LABELS[change].replace(", per update", ",\nper update"))
        ax.set_ylabel(LABELS[churn])
        _percent_axis(ax.yaxis)
    if depths:
        axes[0, 0].legend(loc="lower right", title="run means")
    if mappable is not None:
        fig.colorbar(mappable, ax=axes, label="learning rate")
    return fig


def _lr_norm(lrs: pd.Series) -> LogNorm:
    low, high = float(lrs.min()), float(lrs.max())
    return LogNorm(low / 2, high * 2) if low == high else LogNorm(low, high)


@in_paper_style
def fig_reward(data: RunSet, looks: Looks) -> Figure:
    has_eval = "eval/reward" in data.steps and data.steps["eval/reward"].notna().any()
    fig, axes = new_figure(1, 2 if has_eval else 1, width=7.0 if has_eval else 4.0)
    draw_curves(axes[0, 0], data, looks, data.steps, "reward", "step")
    if has_eval:
        draw_curves(axes[0, 1], data, looks, data.steps, "eval/reward", "step")
    _legend(fig, data, looks)
    return fig


@in_paper_style
def fig_stability(data: RunSet, looks: Looks) -> Figure:
    """Signals of off-policy fragility: clipping, log-ratio spread, extreme tokens, staleness and rollout churn."""
    fig, axes = new_figure(2, 3)
    panels = [("clip_ratio/region_mean", True), ("ratio/log_std", False), ("ratio/extreme_frac", True),
              ("routing/staleness/churn", False), ("routing/rollout/churn", False)]
    for ax, (metric, log) in zip(axes.flat, panels):
        draw_curves(ax, data, looks, data.steps, metric, "step", log=log)
    draw_curves(axes[1, 2], data, looks, data.metrics, "routing/staleness/churn", "minibatch")
    _legend(fig, data, looks)
    return fig


@in_paper_style
def fig_comparison(data: RunSet, looks: Looks) -> Figure:
    """The sweep at a glance: churn per update and per layer, reward, and clipping, side by side."""
    fig, axes = new_figure(2, 2, row_height=2.4)
    draw_curves(axes[0, 0], data, looks, data.steps, "routing/update/churn", "step")
    draw_curves(axes[0, 1], data, looks, data.steps, "reward", "step")
    draw_layer_curves(axes[1, 0], data, looks, "update")
    draw_curves(axes[1, 1], data, looks, data.steps, "clip_ratio/region_mean", "step", log=True)
    for ax, letter in zip(axes.flat, "abcd"):
        ax.set_title(f"({letter})", loc="left", fontweight="bold")
    _legend(fig, data, looks)
    return fig


# name -> (function, what the figure shows); the report writes them in this order.
# A function may return None when the runs do not have what it draws (the churn-scaling figures need an lr sweep).
FIGURES: dict[str, tuple[Callable[[RunSet, Looks], Figure | None], str]] = {
    "churn_scaling": (fig_churn_scaling, "update churn against learning rate, one line per depth, one panel per "
                                         "(experts, top-k), with the GSPO paper's ~10% (learning-rate sweeps only)"),
    "churn_layer_profile": (fig_churn_layer_profile, "update churn per MoE layer, one line per learning rate, one "
                                                     "panel per (experts, top-k) and depth (learning-rate sweeps only)"),
    "update_churn": (fig_update_churn, "update churn and the fraction of tokens whose path changed in any layer, "
                                       "per optimizer step"),
    "layer_churn_heatmap": (fig_layer_heatmap, "update churn per MoE layer and rollout step, one panel per group"),
    "layer_churn_depth": (fig_layer_depth, "update and staleness churn against layer depth"),
    "churn_vs_policy_change": (fig_churn_vs_policy_change, "update churn against the per-update policy change "
                                                           "(KL and mean |log w|), by learning rate and depth"),
    "reward": (fig_reward, "training reward (and held-out reward if evaluated) per rollout step"),
    "stability": (fig_stability, "clip fraction, token log-ratio std, extreme-token fraction F(2), staleness "
                                 "churn (per step and per minibatch j) and rollout churn"),
    "comparison": (fig_comparison, "the main panels side by side: churn per step, reward, churn per layer, "
                                   "clip fraction"),
}

