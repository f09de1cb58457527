"""The figure code's print rules: smoothing only for runs long enough to smooth, no offset text on axes, PNG only by
default, and tables/curves.csv holding the raw values its documentation says it holds."""

from __future__ import annotations

import numpy as np
import pandas as pd
from matplotlib.backends.backend_agg import FigureCanvasAgg
from moe_rl.analysis.aggregate import mean_ci
from moe_rl.analysis.panels import SMOOTH, SMOOTH_MIN_WINDOWS, label_axes, smooth
from moe_rl.analysis.style import FORMATS, new_figure, paper


def _steps(run: str, rewards: list[float]) -> pd.DataFrame:
    return pd.DataFrame({"run": run, "group": "g", "step": range(len(rewards)), "reward": rewards})


def test_a_short_run_is_drawn_raw_and_a_long_one_smoothed():
    short = _steps("short", [0.062, 0.031, 0.156])  # the 3-step run, once drawn as a flat 0.083
    out, window = smooth(short, "reward", "step")
    assert window == 1 and out["reward"].tolist() == [0.062, 0.031, 0.156]
    n_long = SMOOTH_MIN_WINDOWS * SMOOTH["step"]
    rising = list(np.arange(n_long, dtype=float) ** 2)
    out, window = smooth(pd.concat([short, _steps("long", rising)]), "reward", "step")
    assert window == SMOOTH["step"]
    by_run = {run: rows.sort_values("step")["reward"].tolist() for run, rows in out.groupby("run")}
    assert by_run["short"] == [0.062, 0.031, 0.156]  # still raw beside a smoothed run
    assert by_run["long"][5] == np.mean(rising[3:8])  # centred 5-step mean
    assert by_run["long"] != rising


def test_a_run_one_point_short_of_the_rule_is_left_raw():
    values = [float(v) for v in range(SMOOTH_MIN_WINDOWS * SMOOTH["step"] - 1)]
    out, window = smooth(_steps("r", values), "reward", "step")
    assert window == 1 and out["reward"].tolist() == values


def test_axes_carry_no_offset_text():
    with paper():
        fig, axes = new_figure()
        ax = axes[0, 0]
        ax.plot([1e-5, 1.00002e-5, 1.00004e-5], [1.0, 1.00001, 1.00002])
        label_axes(ax, "kl", "reward")
        FigureCanvasAgg(fig).draw()
        assert ax.xaxis.get_offset_text().get_text() == "" and ax.yaxis.get_offset_text().get_text() == ""


def test_figures_are_png_only_by_default():
    assert FORMATS == ("png",)


def test_curves_table_holds_the_raw_mean_not_a_smoothed_one():
    """`moe-rl report --help` says tables/curves.csv holds the raw values' mean: a 3-step run's rewards come out as
    they are, never as their rolling mean."""
    frame = pd.concat([_steps("a", [0.062, 0.031, 0.156]), _steps("b", [0.062, 0.031, 0.156])])
    curves = mean_ci(frame, "reward", x="step")
    assert curves["mean"].round(3).tolist() == [0.062, 0.031, 0.156]
    from moe_rl.analysis import report

    assert "raw values" in report.__doc__ and "plotted mean" not in report.__doc__
