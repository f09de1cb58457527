"""Figures of expert churn, reward and stability, from a grouped RunSet (moe_rl.analysis.aggregate.add_groups).

Every `fig_*` function takes (data, looks) and returns a matplotlib Figure (or None when the runs lack what it
draws); the panels come from moe_rl.analysis.panels, the figures of lr x depth x experts sweeps from
moe_rl.analysis.churn_figures. Churn is always shown in both readings, side by side: slot churn (the share of a token's
K experts that change) and set change (the share of (token, layer) decisions whose top-K set changed), with the
share of tokens re-routed in any layer. A panel whose metric is 0 or missing in every run is left out, and the
figure lists it in `fig.skipped_panels` (the report's README names them). FIGURES lists the report's figures
(docs/analysis.md explains how to read them).

    data = add_groups(load_runs("runs/"), ["objective.name", "routing_mode"])
    save(fig_update_churn(data, looks_for(data)), "results/x/figures", "update_churn")
"""

from __future__ import annotations

import textwrap
from collections.abc import Callable

import pandas as pd
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from moe_rl.analysis.aggregate import _label_part
from moe_rl.analysis.churn_figures import (
    fig_churn_layer_profile,
    fig_churn_scaling,
    fig_churn_vs_policy_change,
    fig_scaling_fit,
)
from moe_rl.analysis.load import RunSet
from moe_rl.analysis.panels import (
    LABELS,
    SMOOTH_STEPS,
    X_LABELS,
    Looks,
    draw_curves,
    draw_layer_curves,
    figure_legend,
    looks_for,
    no_data,
    present,
    words,
)
from moe_rl.analysis.style import SEQUENTIAL_CMAP, in_paper_style, new_figure, percent_formatter

__all__ = ["FIGURES", "LABELS", "SMOOTH_STEPS", "looks_for"]
READINGS = ("routing/update/churn", "routing/update/set_change", "routing/update/token_any")


def _panel_figure(specs: list[tuple], frame_of: Callable[[str], pd.DataFrame], n_cols: int, row_height=2.3):
    """A figure with one panel per spec whose metric is present; returns (fig, axes of the kept specs, kept
    specs, skipped names). A spec is (metric, ...): the rest is passed on by the caller."""
    kept = [spec for spec in specs if present(frame_of(spec[0]), spec[0])]
    skipped = [f"{spec[0]} (0 or not logged in every run)" for spec in specs if spec not in kept]
    n = max(1, len(kept))
    cols = min(n_cols, n)
    fig, axes = new_figure(-(-n // cols), cols, row_height=row_height)
    for ax in list(axes.flat)[len(kept):]:
        ax.set_axis_off()
    fig.skipped_panels = skipped
    return fig, list(axes.flat)[: len(kept)], kept


# ---------------------------------------------------------------------------------------------------------------------
# Figures


@in_paper_style
def fig_update_churn(data: RunSet, looks: Looks) -> Figure:
    """Both readings of update churn and tokens re-routed anywhere, per optimizer step."""
    fig, axes, kept = _panel_figure([(m,) for m in READINGS], lambda m: data.metrics, 3)
    for ax, (metric,) in zip(axes, kept):
        draw_curves(ax, data, looks, data.metrics, metric, "update")
    if not kept:
        no_data(fig.axes[0], "routing/update/*")
    figure_legend(fig, data, looks)
    return fig


def _facets(data: RunSet, groups: list[str]) -> tuple[list[list[str | None]], list[str]]:
    """Heatmap panels for `groups`: one row per value of the first group key (when there are two or more), at
    most 6 columns (a wider block wraps); returns the grid of groups (None = empty) and each row's label."""
    keys = data.group_by
    first = data.runs.drop_duplicates("group").set_index("group")
    blocks: dict[str, list[str]] = {}
    for group in groups:
        row_key = f"{keys[0]}={first.loc[group, keys[0]]}" if len(keys) >= 2 else ""
        blocks.setdefault(row_key, []).append(group)
    n_cols = min(6 if len(keys) >= 2 else 4, max(len(b) for b in blocks.values()))
    grid, labels = [], []
    for row_key, groups in blocks.items():
        for start in range(0, len(groups), n_cols):
            chunk = groups[start:start + n_cols]
            grid.append(chunk + [None] * (n_cols - len(chunk)))
            labels.append(row_key)
    return grid, labels


@in_paper_style
def fig_layer_heatmap(data: RunSet, looks: Looks) -> Figure | None:
    """Slot churn per update for each (MoE layer, rollout step), mean over the step's updates and the group's
    runs; one small panel per group that logged the update probe (the others are listed as left out), rows by
    the first group key, one colour scale."""
    update = data.routing[data.routing["probe"] == "update"] if len(data.routing) else pd.DataFrame(
        columns=["group", "layer", "step", "churn"])
    with_data = [g for g in data.groups if (update["group"] == g).any()]
    if not with_data:
        return None
    grid, row_labels = _facets(data, with_data)
    n_rows, n_cols = len(grid), len(grid[0])
    fig, axes = new_figure(n_rows, n_cols, width=min(7.0, 1.25 * n_cols + 1.0), row_height=1.25)
    vmax = float(update["churn"].max()) if len(update) else 0.0
    mesh = None
    for r, row in enumerate(grid):
        for c, group in enumerate(row):
            ax = axes[r, c]
            ax.grid(False)
            if group is None:
                ax.set_axis_off()
                continue
            title = group if not row_labels[r] else group.replace(_short(row_labels[r]), "").strip()
            ax.set_title(textwrap.fill(words(title), 22), fontsize=5.5)
            cells = update[update["group"] == group].pivot_table(index="layer", columns="step", values="churn",
                                                                aggfunc="mean")
            if cells.empty:
                no_data(ax, "update-probe tables")
                continue
            mesh = ax.pcolormesh(cells.columns, cells.index, cells.to_numpy(), shading="nearest",
                                 cmap=SEQUENTIAL_CMAP, vmin=0, vmax=vmax or 1.0)
            ax.tick_params(labelsize=5)
            ax.xaxis.set_major_locator(MaxNLocator(3, integer=True))
            ax.yaxis.set_major_locator(MaxNLocator(3, integer=True))
        axes[r, 0].set_ylabel(f"{words(_short(row_labels[r]))}\nMoE layer".strip(), fontsize=6)
    for ax in axes[-1]:
        ax.set_xlabel(X_LABELS["step"], fontsize=6)
    if mesh is not None:
        fig.colorbar(mesh, ax=axes, label="slot churn per update", format=percent_formatter(), shrink=0.8)
    fig.skipped_panels = [f"{g} (no update-probe tables)" for g in data.groups if g not in with_data]
    return fig


def _short(row_key: str) -> str:
    """'optim.lr=0.0001' -> 'lr=0.0001', as in group labels."""
    if not row_key:
        return ""
    key, value = row_key.split("=", 1)
    try:
        value = float(value)
    except ValueError:
        pass
    return _label_part(key, value)


@in_paper_style
def fig_layer_depth(data: RunSet, looks: Looks) -> Figure:
    """Per MoE layer: update slot churn, update set change, staleness slot churn."""
    fig, axes = new_figure(1, 3)
    draw_layer_curves(axes[0, 0], data, looks, "update", "churn")
    draw_layer_curves(axes[0, 1], data, looks, "update", "set_change")
    draw_layer_curves(axes[0, 2], data, looks, "staleness", "churn")
    figure_legend(fig, data, looks)
    return fig


@in_paper_style
def fig_reward(data: RunSet, looks: Looks) -> Figure:
    has_eval = "eval/reward" in data.steps and data.steps["eval/reward"].notna().any()
    fig, axes = new_figure(1, 2 if has_eval else 1, width=7.0 if has_eval else 4.0)
    draw_curves(axes[0, 0], data, looks, data.steps, "reward", "step")
    if has_eval:
        draw_curves(axes[0, 1], data, looks, data.steps, "eval/reward", "step")
    figure_legend(fig, data, looks)
    return fig


@in_paper_style
def fig_stability(data: RunSet, looks: Looks) -> Figure:
    """Signals of off-policy fragility: clipping, log-ratio spread, extreme tokens, staleness and rollout churn;
    panels whose metric is 0 in every run (rollout churn on CPU) are left out and listed."""
    specs = [("clip_ratio/region_mean", "step", True), ("ratio/log_std", "step", False),
             ("ratio/extreme_frac", "step", True), ("routing/staleness/churn", "step", False),
             ("routing/rollout/churn", "step", False), ("routing/staleness/churn", "minibatch", False)]
    fig, axes, kept = _panel_figure(specs, lambda _metric: data.steps, 3)
    for ax, (metric, x, log) in zip(axes, kept):
        draw_curves(ax, data, looks, data.metrics if x == "minibatch" else data.steps, metric, x, log=log)
    figure_legend(fig, data, looks)
    return fig


@in_paper_style
def fig_comparison(data: RunSet, looks: Looks) -> Figure:
    """The sweep at a glance: both churn readings per step, reward, churn per layer, and clipping."""
    fig, axes = new_figure(2, 3, row_height=2.3)
    draw_curves(axes[0, 0], data, looks, data.steps, "routing/update/churn", "step")
    draw_curves(axes[0, 1], data, looks, data.steps, "routing/update/set_change", "step")
    draw_curves(axes[0, 2], data, looks, data.steps, "reward", "step")
    draw_layer_curves(axes[1, 0], data, looks, "update", "churn")
    draw_layer_curves(axes[1, 1], data, looks, "update", "set_change")
    draw_curves(axes[1, 2], data, looks, data.steps, "clip_ratio/region_mean", "step", log=True)
    for ax, letter in zip(axes.flat, "abcdef"):
        ax.set_title(f"({letter})", loc="left", fontweight="bold")
    figure_legend(fig, data, looks)
    return fig


# name -> (function, what the figure shows); the report writes them in this order.
# A function may return None when the runs do not have what it draws (the churn-scaling figures need an lr sweep).
FIGURES: dict[str, tuple[Callable[[RunSet, Looks], Figure | None], str]] = {
    "churn_scaling": (fig_churn_scaling, "slot churn (top) and set change (bottom) against learning rate, one "
                                         "line per depth, one panel per (experts, top-k), with the GSPO paper's "
                                         "~10% (learning-rate sweeps only)"),
    "churn_scaling_fit": (fig_scaling_fit, "the churn scaling fit: slot churn and set change against the median "
                                           "KL per update, fitted power law per architecture, the extrapolation "
                                           "to 48 layers / 128 experts / top-8 with a bootstrap band, and the 10% "
                                           "line (learning-rate sweeps only)"),
    "churn_layer_profile": (fig_churn_layer_profile, "slot churn and set change per MoE layer, one line per "
                                                     "learning rate, one panel per architecture (learning-rate "
                                                     "sweeps only)"),
    "update_churn": (fig_update_churn, "slot churn, set change and tokens re-routed in any layer, per optimizer "
                                       "step"),
    "layer_churn_heatmap": (fig_layer_heatmap, "slot churn per update per MoE layer and rollout step, one panel "
                                               "per group"),
    "layer_churn_depth": (fig_layer_depth, "update slot churn, update set change and staleness churn against "
                                           "layer depth"),
    "churn_vs_policy_change": (fig_churn_vs_policy_change, "each run's slot churn, set change and tokens "
                                                           "re-routed against its median KL per update, colour = "
                                                           "learning rate, marker = depth"),
    "reward": (fig_reward, "training reward (and held-out reward if evaluated) per rollout step"),
    "stability": (fig_stability, "clip fraction, token log-ratio std, extreme-token fraction F(2), staleness "
                                 "churn (per step and per minibatch j) and rollout churn, where not 0 throughout"),
    "comparison": (fig_comparison, "the main panels side by side: both churn readings per step, reward, both "
                                   "readings per layer, clip fraction"),
}
