"""Figures for churn-scaling sweeps: learning rate x depth x (experts, top-k), as in experiments/churn_repro.

The generic figures (moe_rl.analysis.plots) draw one curve per group, which does not read well with dozens of groups.
These put the sweep's axes on the figure's axes instead, and always show both readings of churn (slot churn and
set change; docs/design.md section 5):

- `fig_churn_scaling`: each reading against learning rate, one line per depth, one panel per (E, K), with the
  GSPO paper's ~10% as a reference line;
- `fig_churn_layer_profile`: each reading per MoE layer, one line per learning rate, one panel per architecture;
- `fig_churn_vs_policy_change`: each run's readings against its median KL per update;
- `fig_scaling_fit`: the power law of moe_rl.analysis.scaling with its extrapolation to the paper's model.

Learning rates take discrete colours (one per swept value, with a legend), not a colour bar. Each returns None
when the runs do not vary the learning rate (the report then skips it).
"""

from __future__ import annotations

import textwrap

import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import FuncFormatter, MaxNLocator, NullFormatter

from moe_rl.analysis.aggregate import summarize
from moe_rl.analysis.cells import READING_LABELS, READINGS, run_summary
from moe_rl.analysis.load import RunSet
from moe_rl.analysis.panels import floor_zeros, log_if_wide, note, percent_axis
from moe_rl.analysis.scaling import ARCHITECTURE, PAPER_CHURN, TARGET, bootstrap_laws, fit_power_law, split_target
from moe_rl.analysis.style import LINESTYLES, MARKERS, OKABE_ITO, in_paper_style, new_figure
from moe_rl.errors import ConfigError

SCALING_KEYS = ("optim.lr", "model.n_layers", "model.n_experts", "model.top_k")
CHURN = "routing/update/churn"
FITTED = ("churn", "set_change")


def _varies_lr(data: RunSet) -> bool:
    return "optim.lr" in data.runs and data.runs["optim.lr"].nunique() > 1 and CHURN in data.metrics


def _variants(frame: pd.DataFrame) -> list[tuple[int, int]]:
    return sorted({(int(e), int(k)) for e, k in zip(frame["model.n_experts"], frame["model.top_k"])})


def _palette(values) -> dict:
    """One Okabe-Ito colour per distinct value, in sorted order."""
    return {v: OKABE_ITO[i % len(OKABE_ITO)] for i, v in enumerate(sorted(set(values)))}


def run_churn(data: RunSet) -> pd.DataFrame:
    """Each run's mean slot churn per update over its optimizer steps, with the scaling config columns."""
    frame = data.with_config(data.metrics, list(SCALING_KEYS))
    return frame.groupby(["run", *SCALING_KEYS])[CHURN].mean().reset_index()


def _churn_axis(ax, reading: str, ylabel: bool) -> None:
    ax.set_yscale("log")
    percent_axis(ax.yaxis)
    if ylabel:
        ax.set_ylabel(f"{READING_LABELS[reading]}\nper update")


def _paper_line(ax) -> None:
    ax.axhline(PAPER_CHURN, color="0.3", linestyle="--", linewidth=0.9)
    ax.text(0.02, PAPER_CHURN * 1.12, "~10%: GSPO paper", transform=ax.get_yaxis_transform(), fontsize=6,
            color="0.3")


def fig_churn_scaling(data: RunSet, looks=None) -> Figure | None:
    """Slot churn (top row) and set change (bottom row) vs learning rate, one line per depth (mean and 95% CI
    over seeds), one column per (experts, top-k)."""
    return fig_churn_scaling_of(run_summary(data)) if _varies_lr(data) else None


@in_paper_style
def fig_churn_scaling_of(per_run: pd.DataFrame) -> Figure:
    """fig_churn_scaling from the per-run table (moe_rl.analysis.cells.run_summary; a report's per_run_final)."""
    variants = _variants(per_run)
    colours = _palette(per_run["model.n_layers"])
    fig, axes = new_figure(2, len(variants), width=min(7.0, 2.4 * len(variants) + 0.6), row_height=2.2,
                           sharey="row")
    for col, (experts, top_k) in enumerate(variants):
        panel = per_run[(per_run["model.n_experts"] == experts) & (per_run["model.top_k"] == top_k)]
        for row, reading in enumerate(FITTED):
            ax = axes[row, col]
            for i, (depth, colour) in enumerate(colours.items()):
                rows = [{"lr": lr, **summarize(runs[reading])}
                        for lr, runs in panel[panel["model.n_layers"] == depth].groupby("optim.lr")]
                if not rows:
                    continue
                curve = pd.DataFrame(rows)
                ax.plot(curve["lr"], curve["mean"], color=colour, marker=MARKERS[i % len(MARKERS)],
                        label=f"{depth:g} MoE blocks")
                ax.fill_between(curve["lr"], curve["ci_low"].fillna(curve["mean"]),
                                curve["ci_high"].fillna(curve["mean"]), color=colour, alpha=0.2, linewidth=0)
            _paper_line(ax)
            ax.set_xscale("log")
            if row == 0:  # the reading is the row's y label; a column title says the architecture once
                ax.set_title(f"{experts} experts\ntop-{top_k}", fontsize=7)
            if row == 1:
                ax.set_xlabel("learning rate")
            _churn_axis(ax, reading, ylabel=col == 0)
    # One legend for every depth drawn (a panel may hold only some), and the band's meaning as its title.
    handles = [Line2D([], [], color=c, marker=MARKERS[i % len(MARKERS)], label=f"{d:g} MoE blocks")
               for i, (d, c) in enumerate(colours.items())]
    fewest = int(per_run.groupby(list(SCALING_KEYS)).size().min())
    fig.legend(handles=handles, loc="outside lower center", ncols=len(handles), title_fontsize=6,
               title=f"bands: 95% CI over seeds ({fewest}+ per point)")
    return fig


@in_paper_style
def fig_churn_layer_profile(data: RunSet, looks=None) -> Figure | None:
    """Slot churn (top row) and set change (bottom row) per MoE layer, each run's mean over its updates then the
    mean over seeds; one line per learning rate (discrete colours), one column per architecture."""
    if not _varies_lr(data) or not len(data.routing):
        return None
    table = data.with_config(data.routing[data.routing["probe"] == "update"], list(SCALING_KEYS))
    per_layer = table.groupby(["run", "layer", *SCALING_KEYS])[["churn", "set_change"]].mean().reset_index()
    architectures = sorted({tuple(int(v) for v in row) for row in per_layer[list(ARCHITECTURE)].to_numpy()})
    colours = _palette(per_layer["optim.lr"])
    n = len(architectures)
    fig, axes = new_figure(2, n, width=min(7.0, 1.5 * n + 0.8), row_height=1.9, sharey="row")
    for col, (depth, experts, top_k) in enumerate(architectures):
        panel = per_layer[(per_layer["model.n_layers"] == depth) & (per_layer["model.n_experts"] == experts)
                          & (per_layer["model.top_k"] == top_k)]
        for row, reading in enumerate(FITTED):
            ax = axes[row, col]
            for lr, runs in panel.groupby("optim.lr"):
                curve = runs.groupby("layer")[reading].mean()
                ax.plot(curve.index, curve.to_numpy(), color=colours[lr], marker="o", markersize=2)
            ax.set_title(f"{depth} blocks, {experts}/{top_k}", fontsize=6)
            ax.xaxis.set_major_locator(MaxNLocator(nbins=5, integer=True))
            if row == 1:
                ax.set_xlabel("MoE layer", fontsize=6)
            _churn_axis(ax, reading, ylabel=col == 0)
    handles = [Line2D([], [], color=c, marker="o", label=f"lr {lr:g}") for lr, c in colours.items()]
    fig.legend(handles=handles, loc="outside lower center", ncols=len(handles))
    return fig


def fig_churn_vs_policy_change(data: RunSet, looks=None) -> Figure | None:
    """Each run's mean slot churn, set change and tokens re-routed against its median k3 KL per update (the mean
    is ruled by rare outlying updates); colour = learning rate, marker = depth. Runs whose reading is 0 are drawn
    hollow at a floor below the smallest value, and the panel says how many."""
    if CHURN not in data.metrics or "update/kl" not in data.metrics:
        return None
    return fig_churn_vs_policy_change_of(run_summary(data))


@in_paper_style
def fig_churn_vs_policy_change_of(per_run: pd.DataFrame) -> Figure:
    """fig_churn_vs_policy_change from the per-run table (run_summary; a report's per_run_final)."""
    per_run = per_run.dropna(subset=["kl_median"])
    colours = _palette(per_run["optim.lr"])
    depths = sorted(per_run["model.n_layers"].unique())
    readings = [r for r in READINGS if per_run[r].notna().any()]
    fig, axes = new_figure(1, len(readings), row_height=2.5)
    for ax, reading in zip(axes.flat, readings):
        values, zeros, floor = floor_zeros(per_run[reading].fillna(0))
        for i, depth in enumerate(depths):
            mask = per_run["model.n_layers"] == depth
            for lr, colour in colours.items():
                pick = mask & (per_run["optim.lr"] == lr)
                hollow = pick & (per_run[reading].fillna(0) == 0)
                ax.scatter(per_run.loc[pick & ~hollow, "kl_median"], values[pick & ~hollow], color=colour, s=22,
                           marker=MARKERS[i % len(MARKERS)], edgecolors="black", linewidths=0.4)
                ax.scatter(per_run.loc[hollow, "kl_median"], values[hollow], facecolors="none", edgecolors=colour,
                           s=22, marker=MARKERS[i % len(MARKERS)])
        if not log_if_wide(ax, "x", per_run["kl_median"]):
            # A narrow linear KL axis: few ticks, each with its own value ('0.0001'), no '1e-5' multiplier.
            ax.xaxis.set_major_locator(MaxNLocator(4))
            ax.xaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:.2g}"))
        log_if_wide(ax, "y", values)
        if zeros:
            note(ax, f"{zeros} of {len(per_run)} runs read 0: hollow, at {100 * floor:.2g}%")
        ax.set_xlabel("median KL per update (nats, k3)")
        ax.set_ylabel(f"{READING_LABELS[reading]}\nper update")
        percent_axis(ax.yaxis)
        ax.xaxis.set_minor_formatter(NullFormatter())
    handles = [Line2D([], [], color=c, marker="o", linestyle="none", label=f"lr {lr:g}") for lr, c in colours.items()]
    handles += [Line2D([], [], color="0.3", marker=MARKERS[i % len(MARKERS)], linestyle="none",
                       label=f"{d:g} blocks") for i, d in enumerate(depths)]
    fig.legend(handles=handles, loc="outside lower center", ncols=min(len(handles), 8))
    return fig


def _target_band(laws, xs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    predictions = np.array([[law.predict({laws[0].predictors[0]: x, **TARGET}) for x in xs] for law in laws])
    return np.percentile(predictions, 2.5, axis=0), np.percentile(predictions, 97.5, axis=0)


def fig_scaling_fit(data: RunSet, looks=None) -> Figure | None:
    """Per reading: runs (colour = depth, marker = (E, K)), the fitted power law for each swept architecture,
    and the law extrapolated to 48 layers / 128 experts / top-8 (black, with its bootstrap 95% band), against
    the median KL per update; runs of that architecture (the paper-shaped arm), held out of the fit, are black
    stars; the dashed line is the paper's 10%."""
    return fig_scaling_fit_of(run_summary(data)) if _varies_lr(data) else None


@in_paper_style
def fig_scaling_fit_of(per_run: pd.DataFrame) -> Figure | None:
    """fig_scaling_fit from the per-run table (run_summary; a report's per_run_final); None when no law fits."""
    per_run, held_out = split_target(per_run)
    try:
        laws = {reading: fit_power_law(per_run, reading) for reading in FITTED}
    except ConfigError:
        return None
    colours = _palette(per_run["model.n_layers"])
    variants = _variants(per_run)
    fig, axes = new_figure(1, 2, row_height=2.8)
    for ax, reading in zip(axes.flat, FITTED):
        law = laws[reading]
        usable = per_run[(per_run[reading] > 0) & (per_run["kl_median"] > 0)]
        xs = np.geomspace(usable["kl_median"].min() / 3, max(usable["kl_median"].max(), 1e-9) * 30, 60)
        for (depth, experts, top_k), runs in usable.groupby(list(ARCHITECTURE)):
            v = variants.index((int(experts), int(top_k)))
            ax.scatter(runs["kl_median"], runs[reading], color=colours[depth], marker=MARKERS[v % len(MARKERS)],
                       s=14, edgecolors="black", linewidths=0.3)
            grid = np.geomspace(runs["kl_median"].min(), runs["kl_median"].max(), 20)
            settings = {"model.n_layers": depth, "model.n_experts": experts, "model.top_k": top_k}
            ax.plot(grid, [law.predict({"kl_median": x, **settings}) for x in grid], color=colours[depth],
                    linestyle=LINESTYLES[v % len(LINESTYLES)], linewidth=1)
        boots = bootstrap_laws(per_run, reading)
        target = [law.predict({"kl_median": x, **TARGET}) for x in xs]
        ax.plot(xs, target, color="black", linewidth=1.4, label="48 layers, 128 experts, top-8 (extrapolated)")
        if boots:
            low, high = _target_band(boots, xs)
            ax.fill_between(xs, low, high, color="black", alpha=0.12, linewidth=0)
        if len(held_out):
            ax.scatter(held_out["kl_median"], held_out[reading], color="black", marker="*", s=40, zorder=4)
        _paper_line(ax)
        ax.set_xscale("log")
        # The band can reach absurd values far from the data; the view stays within 30x below the runs.
        ax.set_ylim(max(1e-7, float(usable[reading].min()) / 30), 1.5)
        _churn_axis(ax, reading, ylabel=True)
        ax.set_xlabel("median KL per update (nats, k3)")
        terms = ", ".join(f"{p.split('.')[-1].replace('kl_median', 'KL')}^{c:.2f}"
                          for p, c in zip(law.predictors, law.coef))
        # Wrapped: with five predictors the two panels' titles would run into each other.
        ax.set_title(textwrap.fill(f"{READING_LABELS[reading]} ~ {terms}", 52) + f"\nR^2 {law.r2:.2f}, {law.n} runs",
                     fontsize=6.5)
        ax.xaxis.set_minor_formatter(NullFormatter())
    handles = [Line2D([], [], color=c, marker="o", label=f"{d:g} blocks") for d, c in colours.items()]
    handles += [Line2D([], [], color="0.3", marker=MARKERS[i % len(MARKERS)], linestyle=LINESTYLES[i % 4],
                       label=f"{e}/{k}") for i, (e, k) in enumerate(variants)]
    handles.append(Line2D([], [], color="black", label="48 / 128 / top-8, extrapolated (band: bootstrap 95%)"))
    if len(held_out):
        handles.append(Line2D([], [], color="black", marker="*", linestyle="none",
                              label="48 / 128 / top-8 runs (held out of the fit)"))
    fig.legend(handles=handles, loc="outside lower center", ncols=min(len(handles), 4))
    return fig
