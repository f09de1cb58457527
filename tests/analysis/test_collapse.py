"""The collapse detector (analysis/collapse.py) on synthetic held-out reward curves."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pandas as pd

from moe_rl.analysis.collapse import collapse_step, count_collapses, run_collapsed

STEPS = [0, 10, 20, 30, 40]


def test_a_curve_that_falls_below_half_and_stays_collapses_at_the_first_step_below():
    assert collapse_step(STEPS, [0.6, 0.5, 0.25, 0.1, 0.05]) == 20
    assert run_collapsed(STEPS, [0.6, 0.5, 0.25, 0.1, 0.05])


def test_learning_a_dip_that_recovers_and_a_mild_decline_do_not_collapse():
    assert collapse_step(STEPS, [0.4, 0.5, 0.6, 0.7, 0.7]) is None
    assert collapse_step(STEPS, [0.6, 0.2, 0.1, 0.4, 0.5]) is None  # below half, then recovers
    assert collapse_step(STEPS, [0.6, 0.5, 0.4, 0.35, 0.31]) is None  # worse, but never below 0.3
    assert collapse_step(STEPS, [0.6, 0.2, 0.5, 0.1, 0.1]) == 30  # the last fall is the one that stays


def test_non_finite_values_and_divergence_count_as_collapse_a_zero_start_does_not():
    assert collapse_step(STEPS, [0.6, 0.5, math.nan, math.nan, math.nan]) == 20
    assert run_collapsed(STEPS[:2], [0.6, 0.6], diverged=True)
    assert collapse_step(STEPS, [0.0, 0.0, 0.0, 0.0, 0.0]) is None
    assert collapse_step([0], [0.6]) is None


def test_count_collapses_per_group():
    runs = pd.DataFrame({"run": ["a", "b", "c"], "status": ["finished", "finished", "diverged"],
                         "group": ["grpo", "grpo", "gspo"]})
    curves = {"a": [0.6, 0.1, 0.1], "b": [0.6, 0.7, 0.8], "c": [0.6, 0.6, 0.6]}
    steps = pd.DataFrame([{"run": r, "step": 10 * i, "eval/reward": v} for r, vs in curves.items()
                          for i, v in enumerate(vs)])
    table = count_collapses(SimpleNamespace(runs=runs, steps=steps)).set_index("group")
    assert table.loc["grpo", "n_runs"] == 2 and table.loc["grpo", "n_collapsed"] == 1
    assert table.loc["gspo", "n_collapsed"] == 1 and table.loc["gspo", "n_diverged"] == 1


def test_learning_table_gain_ci_and_collapses_per_group():
    from moe_rl.analysis.learning import learning_table

    # group "up": 5 runs that gain 0.2 +- a little; group "down": one collapses, one holds
    curves = {f"u{i}": [0.4, 0.5, 0.6 + 0.01 * i] for i in range(5)}
    curves |= {"d0": [0.4, 0.1, 0.1], "d1": [0.4, 0.4, 0.4]}
    runs = pd.DataFrame({"run": list(curves), "status": "finished",
                         "group": ["up"] * 5 + ["down"] * 2})
    rows = [{"run": r, "step": 10 * i, "eval/reward": v, "n_updates": 4 if i < 2 else 0}
            for r, vs in curves.items() for i, v in enumerate(vs)]
    # training steps 0 and 10 made updates; the evaluation at step 20 is the one after training
    table = learning_table(SimpleNamespace(runs=runs, steps=pd.DataFrame(rows), groups=["up", "down"]),
                           last_k=1).set_index("group")
    up, down = table.loc["up"], table.loc["down"]
    assert up["start"] == 0.4 and abs(up["final"] - 0.62) < 1e-9 and abs(up["gain"] - 0.22) < 1e-9
    assert up["gain_ci_low"] > 0.2 and up["learns"] and up["n_collapsed"] == 0
    assert abs(down["gain"] - (-0.15)) < 1e-9 and not down["learns"] and down["n_collapsed"] == 1
