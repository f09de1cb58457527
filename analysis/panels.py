"""Panels that the report's figures share: labelled axes, seed-mean curves with CI bands, per-layer churn.

A curve is the mean over a group's runs with a 95% CI band over seeds (Student t; moe_rl.analysis.aggregate.mean_ci).
Noisy per-step series of runs long enough (SMOOTH_MIN_WINDOWS windows) are first smoothed per run by a centred
rolling mean (SMOOTH: 5 rollout steps, 20 optimizer steps; held-out evaluations, which are sparse, are not smoothed),
and the legend says so. Two groups whose curves coincide (R2 and R3 on CPU) are drawn so both stay visible (the later
one dashed, with large hollow markers, on top) and the figure's legend says "(coincides with ...)". Heavy-tailed
quantities (the k3 per-update KL) are summarised by medians, never means. Legends name groups in words (`words`),
and a figure of one line per group holds at most MAX_GROUPS of them (`facet_groups` splits more).
"""

from __future__ import annotations

import re

import numpy as np
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import FuncFormatter, MaxNLocator, NullFormatter, ScalarFormatter

from moe_rl.analysis.aggregate import layer_churn, mean_ci
from moe_rl.analysis.load import RunSet
from moe_rl.analysis.style import Look, NarrowLogLocator, group_looks, keyed_looks, percent_formatter

Looks = dict[str, Look]

# Axis labels, with units. Churn-like quantities are fractions shown as percentages.
LABELS = {
    "routing/update/churn": "slot churn per update\n(% of a token's K experts)",
    "routing/update/set_change": "set change per update\n(% of top-K sets changed)",
    "routing/update/token_any": "tokens re-routed\nin any layer (%)",
    "routing/staleness/churn": "staleness slot churn\nvs theta_old (%)",
    "routing/rollout/churn": "rollout slot churn\nsampler vs trainer (%)",
    "reward": "reward\n(rollout batch mean)",
    "eval/reward": "held-out reward\n(mean)",
    "clip_ratio/region_mean": "clipped tokens (%)",
    "ratio/log_std": "std of token log w\n(nats)",
    "ratio/extreme_frac": "F(2): tokens with\nmax(w, 1/w) > 2 (%)",
    "update/kl": "median k3 KL(before || after)\nper token, per update (nats)",
    "update/log_ratio_abs_mean": "median |log w| per token,\nper update (nats)",
}
PERCENT = {"routing/update/churn", "routing/update/set_change", "routing/update/token_any",
           "routing/staleness/churn", "routing/rollout/churn", "clip_ratio/region_mean", "ratio/extreme_frac"}
X_LABELS = {"update": "optimizer step", "step": "rollout step", "minibatch": "minibatch j of the rollout step",
            "layer": "MoE layer (0 = first)"}
SMOOTH = {"step": 5, "update": 20}  # centred rolling-mean window per run, in points of x
SMOOTH_STEPS = SMOOTH["step"]
# A run is smoothed only when it has at least this many windows of points: a centred 5-step mean of a 3-step run
# is one flat value (0.062, 0.031, 0.156 drawn as 0.083 three times), and of a 10-step run it hides the ends.
SMOOTH_MIN_WINDOWS = 3
COINCIDE = 0.002  # curves closer than this share of the panel's y range everywhere are said to coincide


def looks_for(data: RunSet) -> Looks:
    """Objective colours and routing-mode line styles when only objective and routing mode vary; otherwise
    looks keyed to the swept values (style.keyed_looks: colour = first group key, line style = second, ...)."""
    first_run = data.runs.drop_duplicates("group").set_index("group")
    by_objective = set(data.group_by) <= {"objective.name", "routing_mode"}
    if by_objective:
        modes = [first_run.loc[g, "routing_mode"] for g in data.groups] if "routing_mode" in data.group_by else None
        objectives = ([first_run.loc[g, "objective.name"] for g in data.groups]
                      if "objective.name" in data.group_by else None)
        return group_looks(data.groups, modes, objectives)
    return keyed_looks(data.groups, [tuple(first_run.loc[g, k] for k in data.group_by) for g in data.groups])


def present(frame: pd.DataFrame, metric: str) -> bool:
    """Whether any run logged a finite, non-zero value of `metric` (an all-zero panel is left out)."""
    if metric not in frame:
        return False
    values = pd.to_numeric(frame[metric], errors="coerce").to_numpy(dtype=float)
    return bool(np.any(np.isfinite(values) & (values != 0)))


def no_data(ax: Axes, what: str) -> None:
    ax.text(0.5, 0.5, f"not logged:\n{what}", transform=ax.transAxes, ha="center", va="center", color="0.4")


def note(ax: Axes, text: str, y: float = 0.98) -> None:
    ax.text(0.02, y, text, transform=ax.transAxes, va="top", fontsize=5.5, color="0.35")


def label_axes(ax: Axes, x: str, metric: str, values=()) -> None:
    """Axis labels; percent ticks for fractions; a floor at 0 for a non-negative linear axis."""
    ax.set_xlabel(X_LABELS.get(x, x))
    ax.set_ylabel(LABELS.get(metric, metric))
    if metric in PERCENT:
        percent_axis(ax.yaxis)
    values = np.asarray(values, dtype=float)
    values = values[np.isfinite(values)]
    if ax.get_yscale() == "linear" and len(values) and values.min() >= 0:
        ax.set_ylim(bottom=0)
    for axis in (ax.xaxis, ax.yaxis):
        # Each tick says its own value ("1e-05", "2e-05"): no "1e-5" multiplier on the far end of the axis.
        if axis.get_scale() == "linear" and isinstance(axis.get_major_formatter(), ScalarFormatter):
            axis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    if x in ("update", "step", "minibatch", "layer"):
        # At most ~5 integer ticks: narrow panels have no room for more labels.
        ax.xaxis.set_major_locator(MaxNLocator(nbins=5, integer=True))


def percent_axis(axis) -> None:
    """Percent labels that are distinct and true (style.PercentFormatter); on a log axis, enough ticks to label
    a narrow range (style.NarrowLogLocator). Call it after the axis scale is set."""
    if axis.get_scale() == "log":
        axis.set_major_locator(NarrowLogLocator())
    axis.set_major_formatter(percent_formatter())
    axis.set_minor_formatter(NullFormatter())  # log axes: decade labels only, no crowded 2x, 3x, ... labels


def log_if_wide(ax: Axes, which: str, values) -> bool:
    """Log scale on axis `which` when the positive values span more than a factor of 10. Returns whether it
    switched; callers floor zeros (`floor_zeros`) rather than let a log axis drop them silently."""
    values = np.asarray(values, dtype=float)
    positive = values[np.isfinite(values) & (values > 0)]
    if not len(positive) or positive.max() <= 10 * positive.min():
        return False
    getattr(ax, f"set_{which}scale")("log")
    getattr(ax, f"{which}axis").set_minor_formatter(NullFormatter())
    return True


def floor_zeros(values: pd.Series) -> tuple[pd.Series, int, float]:
    """Values with zeros raised to half the smallest positive value (drawn there, hollow), their count and
    the floor; for log axes."""
    positive = values[values > 0]
    floor = float(positive.min()) / 2 if len(positive) else 1e-6
    zeros = int((values == 0).sum())
    return values.where(values > 0, floor), zeros, floor


def smooth(frame: pd.DataFrame, metric: str, x: str) -> tuple[pd.DataFrame, int]:
    """Per run, the centred rolling mean of `metric` over SMOOTH[x] consecutive logged points, for runs of at least
    SMOOTH_MIN_WINDOWS windows of points; shorter runs, held-out evaluations and other x axes are left as they are.
    Returns the frame and the window used (1 = no run was smoothed)."""
    window = 1 if metric.startswith("eval/") else SMOOTH.get(x, 1)
    if window <= 1 or metric not in frame:
        return frame, 1
    out = frame.dropna(subset=[metric]).sort_values(["run", x]).copy()
    long_enough = out.groupby("run")[metric].transform("size") >= SMOOTH_MIN_WINDOWS * window
    if not long_enough.any():
        return frame, 1
    rolled = out.groupby("run")[metric].transform(lambda s: s.rolling(window, center=True, min_periods=1).mean())
    out[metric] = rolled.where(long_enough, out[metric])
    return out, window


def draw_curves(ax: Axes, data: RunSet, looks: Looks, frame: pd.DataFrame, metric: str, x: str,
                log: bool = False) -> None:
    """Mean over each group's runs (smoothed per run, see `smooth`) with a 95% CI band over seeds (Student t);
    diverged runs marked where they stopped; coinciding groups drawn distinguishably and named."""
    smoothed, window = smooth(frame, metric, x)
    summary = mean_ci(smoothed, metric, x=x)
    if (summary["n"] > 1).any():
        ax.figure.has_bands = True
    if summary.empty:
        return no_data(ax, metric)
    if log:
        log_if_wide(ax, "y", summary["mean"])
    span = float(np.nanmax(summary["mean"]) - np.nanmin(summary["mean"]))
    drawn, twins = {}, {}
    for group in data.groups:
        curve = summary[summary["group"] == group]
        twin = next((g for g, c in drawn.items() if _same_curve(c, curve, x, COINCIDE * span)), None) if span else None
        look = looks[group]
        # Markers on every curve (about 8 per line): groups that differ only in the marker's key (e.g. E/K at one lr
        # and depth) share colour and line style and would otherwise be told apart by their level alone.
        ax.plot(curve[x], curve["mean"], color=look.color, linestyle="--" if twin else look.linestyle,
                marker=look.marker, markevery=max(1, len(curve) // 8),
                zorder=3 if twin else 2, label=group, mfc="none" if twin else look.color,
                markersize=6 if twin else None)
        ax.fill_between(curve[x], curve["ci_low"], curve["ci_high"], color=look.color, alpha=0.2, linewidth=0)
        drawn[group], twins[group] = curve, twin
    _mark_diverged(ax, data, looks, frame, metric, x)
    label_axes(ax, x, metric, summary[["mean", "ci_low"]].to_numpy().ravel())
    _remember(ax.figure, twins if span else {}, window, x)


def _remember(fig: Figure, twins: dict, window: int, x: str) -> None:
    """Note on the figure, for its legend: the smoothing used, and each group's twin in every panel that could
    tell them apart (a group coincides with another when it does so in all of them)."""
    if window > 1:
        fig.curve_notes = getattr(fig, "curve_notes", set()) | {
            f"rolling mean over {window} {X_LABELS[x]}s per run of >= {SMOOTH_MIN_WINDOWS * window} (shorter runs raw)"}
    record = getattr(fig, "twins", {})
    for group, twin in twins.items():
        record.setdefault(group, []).append(twin)
    fig.twins = record


def coinciding(fig: Figure) -> dict[str, str]:
    """group -> the earlier group its curves coincide with in every panel of `fig` that could tell them apart."""
    return {g: ts[0] for g, ts in getattr(fig, "twins", {}).items() if ts and ts[0] and len(set(ts)) == 1}


def _same_curve(a: pd.DataFrame, b: pd.DataFrame, x: str, tolerance: float) -> bool:
    if len(a) != len(b) or not len(a) or not np.array_equal(a[x].to_numpy(), b[x].to_numpy()):
        return False
    return bool(np.nanmax(np.abs(a["mean"].to_numpy() - b["mean"].to_numpy())) <= tolerance)


def _mark_diverged(ax: Axes, data: RunSet, looks: Looks, frame: pd.DataFrame, metric: str, x: str) -> None:
    """A cross at the last finite value of each diverged run."""
    diverged = frame[(frame["status"] == "diverged") & np.isfinite(frame[metric])]
    for _, last in diverged.sort_values(x).groupby("run").tail(1).iterrows():
        ax.scatter(last[x], last[metric], marker="x", s=36, linewidths=1.5, color=looks[last["group"]].color,
                   zorder=4)


def draw_layer_curves(ax: Axes, data: RunSet, looks: Looks, probe: str = "update", reading: str = "churn") -> None:
    """Churn per MoE layer (each run's mean over the run), mean and 95% CI over runs, one line per group;
    `reading` "churn" (slot churn) or "set_change"."""
    table = layer_churn(data.routing, [probe]) if len(data.routing) else pd.DataFrame()
    if table.empty:
        return no_data(ax, f"routing/ tables of the {probe} probe")
    column, low, high = ("mean", "ci_low", "ci_high") if reading == "churn" else (
        "set_change", "set_change_ci_low", "set_change_ci_high")
    span = float(table[column].max() - table[column].min())
    drawn, twins = {}, {}
    for group in data.groups:
        rows = table[table["group"] == group]
        curve = rows.rename(columns={column: "mean"})
        twin = next((g for g, c in drawn.items() if _same_curve(c, curve, "layer", COINCIDE * span)),
                    None) if span else None
        look = looks[group]
        err = np.vstack([rows[column] - rows[low], rows[high] - rows[column]])
        ax.errorbar(rows["layer"], rows[column], yerr=np.nan_to_num(err), color=look.color,
                    ls="--" if twin else look.linestyle, marker=look.marker, capsize=2, label=group,
                    zorder=3 if twin else 2, mfc="none" if twin else look.color)
        drawn[group], twins[group] = curve, twin
    _remember(ax.figure, twins if span else {}, 1, "layer")
    label_axes(ax, "layer", f"routing/{probe}/{reading}", table[low].fillna(table[column]))
    if probe != "update":
        ax.set_ylabel(LABELS.get(f"routing/{probe}/{reading}", f"{probe} {reading}"))


def figure_legend(fig: Figure, data: RunSet, looks: Looks) -> None:
    """One legend for the figure, below the panels: groups (a group whose curves coincide with another's says
    so), a cross for 'diverged' if any run diverged, and the smoothing and bands as its title."""
    twins = coinciding(fig)
    handles = [Line2D([], [], color=looks[g].color, linestyle="--" if g in twins else looks[g].linestyle,
                      marker=looks[g].marker,
                      label=f"{words(g)} (coincides with {words(twins[g])})" if g in twins else words(g))
               for g in data.groups]
    if (data.runs["status"] == "diverged").any():
        handles.append(Line2D([], [], color="0.2", marker="x", linestyle="none", label="diverged (run stopped)"))
    # As many columns as fit the figure's width (about 0.06 inch per character at 7 pt, plus the handle).
    entry_width = 0.06 * max(len(h.get_label()) for h in handles) + 0.5
    ncols = max(1, min(len(handles), int(fig.get_figwidth() // entry_width)))
    rows = -(-len(handles) // ncols)
    if rows > 2:  # make room below the panels instead of squeezing them (a sweep can have dozens of groups)
        fig.set_figheight(fig.get_figheight() + 0.16 * rows)
    # The band note only where a band was drawn (a group of two or more runs): not under single-run curves.
    notes = sorted(getattr(fig, "curve_notes", set())) + (["bands: 95% CI over seeds"] if getattr(
        fig, "has_bands", False) else [])
    fig.legend(handles=handles, loc="outside lower center", ncols=ncols, title="; ".join(notes) or None,
               title_fontsize=6)


# ---------------------------------------------------------------------------------------------------------------------
# Group labels in words, and facets of at most MAX_GROUPS groups

MAX_GROUPS = 8  # lines one panel can hold and a reader can tell apart (Okabe-Ito has 8 colours)
_PART = re.compile(r"(\S+?)=(\[[^\]]*\]|\S+)|(\S+)")  # key=value (a value may be a bracketed list) or a bare word
# Label parts (key=value, as moe_rl.analysis.aggregate.group_label writes them) in words, applied in order.
WORDS = (
    (re.compile(r"\bis_level=none\b"), "no correction"),
    (re.compile(r"\bis_level=token is_cap=(\S+)"), r"TIS cap \1"),
    (re.compile(r"\bis_level=token is_band=\[([^\]]*)\]"), r"IcePop [\1]"),
    (re.compile(r"\bis_level=(\S+)"), r"\1-level correction"),
    (re.compile(r"\bprecision=(\S+)"), r"\1 sampler"),
    (re.compile(r"\bexperts=(\S+) top-k=(\S+)"), r"\1 experts top-\2"),
    (re.compile(r"\blayers=(\S+)"), r"\1 blocks"),
    (re.compile(r"\bd_expert=(\S+)"), r"expert width \1"),
    (re.compile(r"\binit_depth=0\b"), "own-depth init"),
    (re.compile(r"\binit_depth=(\S+)"), r"init of \1 blocks"),
    (re.compile(r"\bminibatches=(\S+)"), r"\1 minibatches"),
    (re.compile(r"\blr=(\S+)"), r"lr \1"),
    (re.compile(r"\b(\w+)=(\S+)"), r"\1 \2"),
)


def label_parts(label: str) -> dict[str, str]:
    """'R3 precision=bf16 is_level=none' -> {'#0': 'R3', 'precision': 'bf16', 'is_level': 'none'}: key=value
    parts by key, bare words by position."""
    parts = {}
    for i, match in enumerate(_PART.finditer(label)):
        key, value, word = match.groups()
        parts.update({key: value} if key else {f"#{i}": word})
    return parts


def words(label: str, drop: str = "") -> str:
    """A group label in words ('native precision=bf16 is_level=token is_cap=2' -> 'native bf16 sampler TIS cap 2'),
    without the part `drop` (a facet's shared part, said once in its title)."""
    if drop:
        label = " ".join(label.replace(drop, " ").split())
    for pattern, replacement in WORDS:
        label = pattern.sub(replacement, label)
    return label.replace(".0]", "]").replace(".0,", ",") or "all runs"


def facet_groups(groups: list[str], max_groups: int = MAX_GROUPS) -> list[tuple[str, list[str]]]:
    """`groups` in facets of at most `max_groups`: split by the label part whose values give the fewest facets
    (at most `max_groups` of them) that all fit (the facet is named by that part, e.g. 'precision=bf16'), else in
    runs of `max_groups`, named 'part 1', 'part 2', ..."""
    if len(groups) <= max_groups:
        return [("", list(groups))]
    parts = [label_parts(g) for g in groups]
    best = None
    for key in dict.fromkeys(k for p in parts for k in p):
        blocks: dict[str, list[str]] = {}
        for group, p in zip(groups, parts):
            blocks.setdefault(p.get(key, ""), []).append(group)
        fits = 1 < len(blocks) <= max_groups and max(map(len, blocks.values())) <= max_groups  # few facets, each fits
        if fits and (best is None or len(blocks) < len(best[1])):
            best = (key, blocks)
    if best is None:
        return [(f"part {i // max_groups + 1}", groups[i:i + max_groups]) for i in range(0, len(groups), max_groups)]
    key, blocks = best
    return [(value if key.startswith("#") else f"{key}={value}", chunk) for value, chunk in blocks.items()]


def slug(facet: str) -> str:
    """A facet in words as a file-name part ('precision=bf16' -> 'bf16_sampler')."""
    return "".join(c if c.isalnum() or c in ".-" else "_" for c in words(facet)).strip("_")
