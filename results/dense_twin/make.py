"""Tables and the figure of results/dense_twin from the two `moe-rl stability` outputs (PROTOCOL.md, "Runs"):

    python results/dense_twin/make.py outputs/twin_moe outputs/twin_dense

tables/per_run.csv (one row per run: architecture, lr, seed, held-out start, final and change, churn, KL),
tables/cells.csv (per architecture and lr: mean change and its 95% t CI over seeds), tables/paired.csv (per lr: MoE
minus twin, paired by seed, 95% t CI), tables/critical.csv (each architecture's critical lr from `moe-rl stability`,
and their ratio), and change_vs_lr.png."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pandas as pd
from scipy import stats

from moe_rl.analysis.stability import pooled_frame
from moe_rl.analysis.style import in_paper_style, new_figure, save

HERE = Path(__file__).resolve().parent
ARCHITECTURES = ("MoE (64 experts, top-8)", "dense twin (one expert of width 256)")
COLUMNS = ["run", "seed", "optim.lr", "start", "eval_final", "change", "declined", "set_change", "kl_median"]


def t_interval(values: np.ndarray) -> tuple[float, float, float]:
    """(mean, low, high): the 95% Student t interval over the values (NaN bounds with fewer than two)."""
    mean = float(np.mean(values))
    if len(values) < 2:
        return mean, float("nan"), float("nan")
    half = stats.t.ppf(0.975, len(values) - 1) * np.std(values, ddof=1) / np.sqrt(len(values))
    return mean, mean - half, mean + half


def per_run(outputs: list[str]) -> pd.DataFrame:
    frames = []
    for architecture, out in zip(ARCHITECTURES, outputs):
        frame, _ = pooled_frame([out])
        frames.append(frame[COLUMNS].assign(architecture=architecture))
    return pd.concat(frames, ignore_index=True)


def cells(runs: pd.DataFrame) -> pd.DataFrame:
    rows = []
    for (architecture, lr), cell in runs.groupby(["architecture", "optim.lr"], sort=False):
        mean, low, high = t_interval(cell["change"].to_numpy(float))
        rows.append({"architecture": architecture, "optim.lr": lr, "n_seeds": len(cell), "change": mean,
                     "ci_low": low, "ci_high": high, "n_declined": int(cell["declined"].sum()),
                     "set_change": cell["set_change"].mean(), "kl_median": cell["kl_median"].median()})
    return pd.DataFrame(rows).sort_values(["architecture", "optim.lr"])


def paired(runs: pd.DataFrame) -> pd.DataFrame:
    wide = runs.pivot_table(index=["optim.lr", "seed"], columns="architecture", values="change")
    diff = (wide[ARCHITECTURES[0]] - wide[ARCHITECTURES[1]]).dropna()
    rows = []
    for lr, values in diff.groupby(level=0):
        mean, low, high = t_interval(values.to_numpy(float))
        rows.append({"optim.lr": lr, "n_pairs": len(values), "moe_minus_twin": mean, "ci_low": low, "ci_high": high})
    return pd.DataFrame(rows)


def critical(outputs: list[str]) -> pd.DataFrame:
    rows = [pd.read_csv(Path(out) / "tables" / "critical.csv").assign(architecture=architecture)
            for architecture, out in zip(ARCHITECTURES, outputs)]
    return pd.concat(rows, ignore_index=True)


@in_paper_style
def figure(table: pd.DataFrame):
    fig, axes = new_figure(1, 1, width=5.5, row_height=3.4)
    ax = axes[0][0]
    for (architecture, cell), marker in zip(table.groupby("architecture", sort=False), ("o", "s")):
        err = np.vstack([cell["change"] - cell["ci_low"], cell["ci_high"] - cell["change"]])
        ax.errorbar(cell["optim.lr"], cell["change"], yerr=err, marker=marker, capsize=3, label=architecture)
    ax.axhline(0.0, color="0.4", linewidth=0.7)
    ax.set_xscale("log")
    ax.set_xlabel("learning rate")
    ax.set_ylabel("held-out change over RL, T = 1")
    ax.set_title("native GRPO, 3 seeds each, one warm start each (95% CI over seeds)")
    ax.legend(loc="lower left")
    return fig


def main(outputs: list[str]) -> None:
    runs = per_run(outputs)
    table, pairs, crit = cells(runs), paired(runs), critical(outputs)
    (HERE / "tables").mkdir(exist_ok=True)
    runs.to_csv(HERE / "tables" / "per_run.csv", index=False)
    table.to_csv(HERE / "tables" / "cells.csv", index=False)
    pairs.to_csv(HERE / "tables" / "paired.csv", index=False)
    crit.to_csv(HERE / "tables" / "critical.csv", index=False)
    save(figure(table), HERE, "change_vs_lr")
    print(table.to_string(index=False))
    print(pairs.to_string(index=False))
    print(crit.to_string(index=False))


if __name__ == "__main__":
    main(sys.argv[1:])
