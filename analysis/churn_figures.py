"""Figures for churn-scaling sweeps: learning rate x depth x (experts, top-k), as in experiments/churn_repro.

The generic figures (analysis.plots) draw one curve per group, which does not read well with dozens of groups.
These two put the sweep's axes on the figure's axes instead:

- `fig_churn_scaling`: update churn against learning rate, one line per depth, one panel per (E, K), with the
  GSPO paper's ~10% as a reference line;
- `fig_churn_layer_profile`: update churn per MoE layer, one line per learning rate (colour), one panel per
  (E, K) and depth.

Both return None when the runs do not vary the learning rate (the report then skips them).
"""

from __future__ import annotations

import matplotlib
import numpy as np
import pandas as pd
from matplotlib.cm import ScalarMappable
from matplotlib.colors import LogNorm
from matplotlib.figure import Figure
from matplotlib.ticker import NullFormatter

from analysis.aggregate import summarize
from analysis.load import RunSet
from analysis.style import MARKERS, OKABE_ITO, SEQUENTIAL_CMAP, in_paper_style, new_figure, percent_formatter

SCALING_KEYS = ("optim.lr", "model.n_layers", "model.n_experts", "model.top_k")
CHURN = "routing/update/churn"
PAPER_CHURN = 0.10  # GSPO paper, section 5.3: ~10% of activated experts change per update (Qwen3-30B-A3B)


def _varies_lr(data: RunSet) -> bool:
    return "optim.lr" in data.runs and data.runs["optim.lr"].nunique() > 1 and CHURN in data.metrics


def _variants(frame: pd.DataFrame) -> list[tuple[int, int]]:
    return sorted({(int(e), int(k)) for e, k in zip(frame["model.n_experts"], frame["model.top_k"])})


def run_churn(data: RunSet) -> pd.DataFrame:
    """Each run's mean update churn over its optimizer steps, with the scaling config columns."""
    frame = data.with_config(data.metrics, list(SCALING_KEYS))
    return frame.groupby(["run", *SCALING_KEYS])[CHURN].mean().reset_index()


def _style_churn_axis(ax, ylabel: bool) -> None:
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(percent_formatter())
    ax.yaxis.set_minor_formatter(NullFormatter())
    if ylabel:
        ax.set_ylabel("update churn\n(% of active experts)")


@in_paper_style
def fig_churn_scaling(data: RunSet, looks=None) -> Figure | None:
    """Update churn vs learning rate (log-log), one line per depth (mean and 95% CI over seeds), one panel per
    (experts, top-k)."""
    if not _varies_lr(data):
        return None
    per_run = run_churn(data)
    variants = _variants(per_run)
    fig, axes = new_figure(1, len(variants), row_height=2.6, sharey=True)
    depths = sorted(per_run["model.n_layers"].unique())
    for ax, (experts, top_k) in zip(axes.flat, variants):
        panel = per_run[(per_run["model.n_experts"] == experts) & (per_run["model.top_k"] == top_k)]
        for i, depth in enumerate(depths):
            rows = [{"lr": lr, **summarize(runs[CHURN])}
                    for lr, runs in panel[panel["model.n_layers"] == depth].groupby("optim.lr")]
            if not rows:
                continue
            curve = pd.DataFrame(rows)
            color = OKABE_ITO[i % len(OKABE_ITO)]
            ax.plot(curve["lr"], curve["mean"], color=color, marker=MARKERS[i % len(MARKERS)],
                    label=f"{depth:g} MoE blocks")
            ax.fill_between(curve["lr"], curve["ci_low"].fillna(curve["mean"]),
                            curve["ci_high"].fillna(curve["mean"]), color=color, alpha=0.2, linewidth=0)
        ax.axhline(PAPER_CHURN, color="0.3", linestyle="--", linewidth=0.9)
        ax.text(0.02, PAPER_CHURN * 1.12, "~10%: GSPO paper, Qwen3-30B-A3B", transform=ax.get_yaxis_transform(),
                fontsize=6, color="0.3")
        ax.set_xscale("log")
        ax.set_xlabel("learning rate")
        ax.set_title(f"{experts} experts, top-{top_k}")
        _style_churn_axis(ax, ylabel=ax is axes.flat[0])
    axes.flat[0].legend(loc="lower right")
    return fig


@in_paper_style
def fig_churn_layer_profile(data: RunSet, looks=None) -> Figure | None:
    """Update churn per MoE layer (each run's mean over its updates), one line per learning rate; rows are
    (experts, top-k) variants, columns depths."""
    if not _varies_lr(data) or not len(data.routing):
        return None
    table = data.with_config(data.routing[data.routing["probe"] == "update"], list(SCALING_KEYS))
    per_layer = table.groupby(["run", "layer", *SCALING_KEYS])["churn"].mean().reset_index()
    variants, depths = _variants(per_layer), sorted(per_layer["model.n_layers"].unique())
    norm = LogNorm(per_layer["optim.lr"].min(), per_layer["optim.lr"].max())
    cmap = matplotlib.colormaps[SEQUENTIAL_CMAP]
    fig, axes = new_figure(len(variants), len(depths), row_height=2.0, sharey=True)
    for row, (experts, top_k) in enumerate(variants):
        for col, depth in enumerate(depths):
            ax = axes[row, col]
            panel = per_layer[(per_layer["model.n_experts"] == experts) & (per_layer["model.top_k"] == top_k)
                              & (per_layer["model.n_layers"] == depth)]
            for lr, runs in panel.groupby("optim.lr"):
                curve = runs.groupby("layer")["churn"].mean()
                ax.plot(curve.index, curve.to_numpy(), color=cmap(norm(lr)), marker="o", markersize=2.5)
            ax.set_title(f"{depth:g} MoE blocks, {experts} experts, top-{top_k}")
            ax.set_xticks(range(int(depth)) if depth <= 8 else np.linspace(0, depth - 1, 5).round())
            if row == len(variants) - 1:
                ax.set_xlabel("MoE layer (0 = input side)")
            _style_churn_axis(ax, ylabel=col == 0)
    fig.colorbar(ScalarMappable(norm=norm, cmap=cmap), ax=axes, label="learning rate")
    return fig
