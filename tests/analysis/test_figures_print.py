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


def _groups(n_arms: int, per_arm: int) -> list[str]:
    corrections = ["is_level=none", "is_level=token is_cap=2", "is_level=token is_band=[0.5, 2.0]", "is_level=seq",
                   "is_level=none x=1", "is_level=none x=2"][:per_arm]
    return [f"native precision=p{a} {c}" for a in range(n_arms) for c in corrections]


def test_more_than_eight_groups_are_faceted_by_a_shared_part_and_named_by_it():
    from moe_rl.analysis.panels import MAX_GROUPS, facet_groups

    groups = _groups(3, 5)
    facets = facet_groups(groups)
    assert [name for name, _ in facets] == ["precision=p0", "precision=p1", "precision=p2"]
    assert [len(chunk) for _, chunk in facets] == [5, 5, 5] and sum((c for _, c in facets), []) == groups
    assert facet_groups(groups[:MAX_GROUPS]) == [("", groups[:MAX_GROUPS])]
    # no part splits 20 distinct one-part labels into blocks of 8 or fewer: runs of 8, in order
    flat = [f"g{i}" for i in range(20)]
    assert [len(c) for _, c in facet_groups(flat)] == [8, 8, 4] and facet_groups(flat)[2][1] == flat[16:]


def test_legend_labels_are_words_not_config_keys():
    from moe_rl.analysis.panels import words

    assert words("native precision=bf16 is_level=token is_cap=2") == "native bf16 sampler TIS cap 2"
    assert words("R3 precision=fp8 is_level=token is_band=[0.5, 2.0]") == "R3 fp8 sampler IcePop [0.5, 2]"
    assert words("lr=5e-05 layers=4 experts=8 top-k=2 d_expert=128") == (
        "lr 5e-05 4 blocks 8 experts top-2 expert width 128")
    assert words("native precision=bf16 is_level=none", drop="precision=bf16") == "native no correction"
    for label in _groups(3, 6):
        assert "=" not in words(label) and "is_" not in words(label), label


def test_rebuilt_figures_have_at_most_eight_legend_entries_and_true_captions(tmp_path):
    """A report folder of 15 groups (3 arms x 5 corrections, one of them a single run) redrawn from its tables:
    one file per arm, each legend of 5 entries in words, bands noted only where some group has 2+ runs."""
    from moe_rl.analysis.rebuild import REBUILT, fig_from_tables, rebuild

    groups = _groups(3, 5)
    rows = [(g, step, 1 if g.startswith("native precision=p2") else 3, 0.1 * step, 0.1 * step - 0.05,
             0.1 * step + 0.05, metric) for g in groups for step in range(6) for metric in ("reward", "eval/reward")]
    curves = pd.DataFrame(rows, columns=["group", "step", "n", "mean", "ci_low", "ci_high", "metric"])
    (tmp_path / "tables").mkdir()
    curves.to_csv(tmp_path / "tables" / "curves.csv", index=False)
    pd.DataFrame({"group": groups}).to_csv(tmp_path / "tables" / "runs.csv", index=False)
    (tmp_path / "figures").mkdir()
    (tmp_path / "figures" / "reward.png").write_bytes(b"old")  # the old 15-group figure is replaced
    written = rebuild(tmp_path)
    names = sorted(path.name for path, _ in written)
    assert names == ["reward_p0_sampler.png", "reward_p1_sampler.png", "reward_p2_sampler.png"], names
    assert not (tmp_path / "figures" / "reward.png").exists() and set(REBUILT) >= {"reward"}
    assert all((tmp_path / "figures" / n).read_bytes()[:4] == b"\x89PNG" for n in names)
    single = fig_from_tables("reward", curves, pd.DataFrame(), groups[10:], "precision=p2")
    legend = single.legends[0]
    labels = [t.get_text() for t in legend.get_texts()]
    assert len(labels) == 5 and all("=" not in label for label in labels), labels
    assert legend.get_title().get_text() == "raw means over runs"  # single runs: no band, no band note
    banded = fig_from_tables("reward", curves, pd.DataFrame(), groups[:5], "precision=p0")
    assert banded.legends[0].get_title().get_text() == "raw means over runs; bands: 95% CI over seeds"
