"""The stability map in words: STABILITY.md from the tables analysis/stability.py computes (cells, critical values,
KL-matched and paired comparisons), and the line that says which runs it was made from."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pandas as pd

from moe_rl.analysis.sittings import is_sitting_source, source_name
from moe_rl.analysis.stability_terms import AXES, ENDPOINT_LABELS, MARGIN, REFERENCE


def stability_markdown(cells: pd.DataFrame, critical: pd.DataFrame, matched: pd.DataFrame, fixed: dict,
                       paired: pd.DataFrame | None = None, mdd: pd.DataFrame | None = None,
                       confirm: tuple[list[int], pd.DataFrame, pd.DataFrame] | None = None, sources: str = "") -> str:
    """The map in words. `confirm`: (seeds, their paired table, their MDD), the confirmatory comparisons of a
    protocol that kept the seeds which suggested a hypothesis out of its test, written after the full table.
    `sources`: a line on which runs the map was made from."""
    fixed_text = ", ".join(f"`{k}` = {v:g}" for k, v in fixed.items())
    lines = ["# Stability map", "", "Each axis holds the other fixed at " + fixed_text + ". Definitions: "
             "analysis/stability.py and docs/analysis.md (\"The stability map\").", "",
             *([sources, ""] if sources else []),
             "## Cells", "", "| axis | method | value | seeds | held-out change, T = 1 [95% CI] | "
             "learned / declined / judged | "
             "greedy change [95% CI] | median KL per update | set change per update | training reward gain |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in cells.itertuples():
        lines.append(f"| {AXES.get(r.axis, r.axis)} | {r.method} | {r.value:g} | {r.n_seeds} | "
                     f"{_with_ci(r.change, r.change_ci_low, r.change_ci_high)} | "
                     f"{r.n_learned} / {r.n_declined} / {r.n_judged} | "
                     f"{_with_ci(r.greedy_change, r.greedy_change_ci_low, r.greedy_change_ci_high)} | "
                     f"{r.kl_median:.3g} | {_percent(r.set_change)} | {_with_ci(r.reward_gain, math.nan, math.nan)} |")
    lines += ["", "## Critical values", "", "| axis | method | seeds | where the change turns negative [95% CI] |",
              "|---|---|---|---|"]
    for r in critical.itertuples():
        lines.append(f"| {AXES.get(r.axis, r.axis)} | {r.method} | {r.n_seeds} | {r.critical:.3g} "
                     f"[{r.ci_low:.3g}, {r.ci_high:.3g}] |")
    if paired is not None and len(paired):
        lines += _paired_markdown(paired, mdd)
    if confirm is not None and len(confirm[1]):
        lines += _paired_markdown(confirm[1], confirm[2], f"; confirmatory: seeds {', '.join(map(str, confirm[0]))}")
    lines += ["", f"## At matched per-update KL (per axis; differences from {REFERENCE}, paired over seeds)",
              "", "| axis | KL per update | method | seeds | change [95% CI] | minus reference [95% CI] | p (Holm) |",
              "|---|---|---|---|---|---|---|"]
    for r in matched.itertuples():
        finite = math.isfinite(r.diff_vs_reference)
        diff = _with_ci(r.diff_vs_reference, r.diff_ci_low, r.diff_ci_high) if finite else ""
        p = f"{r.p_holm:.3f}" if math.isfinite(r.p_holm) else ""
        axis = AXES.get(r.axis, r.axis)
        lines.append(f"| {axis} | {r.kl:.3g} | {r.method} | {r.n_seeds} | {r.change:+.3f} | {diff} | {p} |")
    return "\n".join(lines) + "\n"


def _paired_markdown(paired: pd.DataFrame, mdd: pd.DataFrame | None, which: str = "") -> list[str]:
    lines = ["", f"## Each method against {REFERENCE}, cell by cell (paired by seed{which})", "",
             f"Paired t; Holm across the pairs of one axis and endpoint; TOST at +-{MARGIN:g} (the margin fixed in "
             "results/stability/PROTOCOL.md), Holm-adjusted the same way. verdict: better / worse (Holm p < 0.05), "
             "equivalent (TOST Holm p < 0.05), undecided; a verdict needs 3 seeds or more (too few seeds: 2, untested: "
             "1). rescue: the reference's change has a CI below 0 there and the method is better."]
    if mdd is not None and len(mdd):
        lines += ["", "Minimum detectable paired difference (80% power, alpha 0.05, pooled sd of the differences): " +
                  "; ".join(f"{AXES.get(r.axis, r.axis)}, {ENDPOINT_LABELS[r.endpoint]}: {r.mdd:.3f} at "
                            f"{r.n_pairs} seeds (sd {r.sd_diff:.3f})" for r in mdd.itertuples()) + "."]
    lines += ["", "| axis | endpoint | value | method | pairs | minus reference [95% CI] | p (Holm) | TOST p (Holm) | "
              "verdict |", "|---|---|---|---|---|---|---|---|---|"]
    for r in paired.itertuples():
        diff = _with_ci(r.diff, r.diff_ci_low, r.diff_ci_high) if math.isfinite(r.diff) else ""
        p = f"{r.p_holm:.3f}" if math.isfinite(r.p_holm) else ""
        tost = f"{r.tost_p_holm:.3f}" if math.isfinite(r.tost_p_holm) else ""
        verdict = r.verdict + (" (rescue)" if r.rescue else "")
        lines.append(f"| {AXES.get(r.axis, r.axis)} | {ENDPOINT_LABELS[r.endpoint]} | {r.value:g} | {r.method} | "
                     f"{r.n_pairs} | {diff} | {p} | {tost} | {verdict} |")
    return lines


def sources_line(folders: list[Path | str], frame: pd.DataFrame, repeats: int, out: Path) -> str:
    """Which report folders' (or folded sittings') per-run tables the map was made from, with their runs (paths
    relative to `out`)."""
    if len(folders) == 1:
        return f"Made from the per-run tables of `{_where(folders[0], out)}` ({len(frame)} runs)."
    counts = frame["run"].str.split("/", n=1).str[0].value_counts()
    parts = [f"`{_where(folder, out)}` ({int(counts.get(source_name(folder), 0))} runs)" for folder in folders]
    return (f"Made from the per-run tables of {', '.join(parts)}, pooled: each run named `<folder>/<run>`; "
            f"{repeats} repeat(s) of a method, cell and seed in two folders, with the same held-out change, "
            "counted once.")


def _where(source: Path | str, out: Path) -> str:
    """A report folder's tables, or a folded sitting (`<study>@<sitting>`), relative to `out`."""
    if is_sitting_source(source):
        study, sitting = str(source).rsplit("@", 1)
        return f"{os.path.relpath(study, out)}/tables/*.parquet, sitting {sitting}"
    return f"{os.path.relpath(source, out)}/tables"


def _with_ci(value: float, low: float, high: float) -> str:
    if not math.isfinite(value):
        return ""
    return f"{value:+.3f}" + (f" [{low:+.3f}, {high:+.3f}]" if math.isfinite(low) else "")


def _percent(value: float) -> str:
    return f"{100 * value:.2f}%" if math.isfinite(value) else ""
