"""The collapse detector (analysis/collapse.py) on synthetic held-out reward curves."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pandas as pd

from analysis.collapse import collapse_step, count_collapses, run_collapsed

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
