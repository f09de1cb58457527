"""analysis/stability.py: the decline rule, cells, critical values and the KL-matched reading, on runs whose answers
are known by construction."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from analysis.stability import (critical_values, fig_stability_map, kl_matched, method_name, run_changes,
                                stability_cells, stability_markdown, with_methods)

FIXED = {"optim.lr": 5e-5, "minibatches": 4}


def test_method_names_say_objective_routing_and_correction():
    assert method_name({"objective.name": "grpo", "routing_mode": "R2"}) == "grpo R2"
    assert method_name({"objective.name": "grpo", "routing_mode": "native", "correction.is_level": "token",
                        "correction.is_cap": 2.0, "correction.is_band": None}) == "grpo native TIS cap 2"
    assert method_name({"objective.name": "grpo", "routing_mode": "native", "correction.is_level": "token",
                        "correction.is_cap": float("nan"), "correction.is_band": "[0.5, 2.0]"}) == \
        "grpo native IcePop [0.5, 2]"
    assert method_name({"objective.name": "gspo", "routing_mode": "native", "correction.is_level": "none"}) == \
        "gspo native"


def test_a_decline_is_three_evaluations_below_the_start_by_twice_the_noise_floor():
    """Run a: 0.50 then 0.45, 0.40, 0.35 (SE 0.02 each): change -0.10, floor sqrt(0.02^2 + 0.02^2 / 3) = 0.0231,
    declined. Run b: the same fall with SE 0.06: floor 0.0693, -0.10 > -0.139, not declined. Run c: two evaluations
    after the start: not judged."""
    rows = [("a", s, v, 0.02) for s, v in zip((0, 5, 10, 15), (0.50, 0.45, 0.40, 0.35))]
    rows += [("b", s, v, 0.06) for s, v in zip((0, 5, 10, 15), (0.50, 0.45, 0.40, 0.35))]
    rows += [("c", s, v, 0.02) for s, v in zip((0, 5, 10), (0.50, 0.10, 0.05))]
    per_eval = pd.DataFrame(rows, columns=["run", "step", "eval/reward", "eval/reward_se"])
    changes = run_changes(per_eval).set_index("run")
    assert changes.loc["a", "change"] == pytest.approx(-0.10)
    assert changes.loc["a", "floor"] == pytest.approx(math.sqrt(0.02**2 + 0.02**2 / 3))
    assert changes.loc["a", "declined"] == 1.0 and changes.loc["b", "declined"] == 0.0
    assert math.isnan(changes.loc["c", "declined"]) and math.isnan(changes.loc["c", "change"])


def _synthetic(kl_scale: dict[str, float], seeds: int = 4, noise: float = 0.01) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Per method m, seed s and lr (at 4 minibatches) or minibatches (at lr 5e-5): KL per update = kl_scale[m] x lr
    x minibatches / 4, and held-out change = 0.3 - 0.1 x ln(KL / 1e-4) + seed noise: each method's change is one
    function of its KL, so at matched KL the methods agree while at matched lr the one with a smaller kl_scale
    looks more stable. Change turns negative at KL = 1e-4 x e^3."""
    rng = np.random.default_rng(0)
    runs, evals = [], []
    cells = [(lr, 4) for lr in (2.5e-5, 5e-5, 1e-4, 2e-4, 4e-4)] + [(5e-5, m) for m in (1, 2, 8, 16)]
    for method, scale in kl_scale.items():
        routing = method.split()[1]
        for seed in range(seeds):
            offset = rng.normal(0, noise)
            for lr, mb in cells:
                kl = scale * lr * mb / 4
                change = 0.3 - 0.1 * math.log(kl / 1e-4) + offset
                run = f"{method}-{lr}-{mb}-{seed}"
                runs.append({"run": run, "seed": seed, "objective.name": "grpo", "routing_mode": routing,
                             "optim.lr": lr, "minibatches": mb, "kl_median": kl})
                evals += [{"run": run, "step": 0, "eval/reward": 0.5, "eval/reward_se": 0.01}]
                evals += [{"run": run, "step": s, "eval/reward": 0.5 + change, "eval/reward_se": 0.01}
                          for s in (5, 10, 15)]
    return pd.DataFrame(runs), pd.DataFrame(evals)


def test_cells_critical_values_and_the_kl_matched_reading():
    per_run, per_eval = _synthetic({"grpo native": 1.0, "grpo R2": 0.25})
    frame = with_methods(per_run, per_eval)
    cells = stability_cells(frame, FIXED)
    assert set(cells["axis"]) == {"optim.lr", "minibatches"}
    assert len(cells) == 2 * (5 + 5)  # per method: 5 lr cells, 5 staleness cells (the shared one in both)
    native = cells[(cells["method"] == "grpo native") & (cells["axis"] == "optim.lr")].set_index("value")
    assert native.loc[1e-4, "change"] == pytest.approx(0.3, abs=0.02) and native.loc[1e-4, "n_seeds"] == 4
    assert native.loc[4e-4, "n_declined"] == 0 and native.loc[4e-4, "n_judged"] == 4  # 0.161 above the start
    critical = critical_values(frame, FIXED).set_index(["axis", "method"])
    # native: KL = lr, so the change crosses 0 at lr = 1e-4 e^3 = 2.0e-3, beyond the grid (inf); R2 even later
    assert critical.loc[("optim.lr", "grpo native"), "critical"] == math.inf
    # staleness at lr 5e-5: KL = 5e-5 x m / 4 < 1e-4 e^3 at every m here: no crossing either
    assert critical.loc[("minibatches", "grpo R2"), "critical"] == math.inf
    matched = kl_matched(frame, FIXED)
    r2 = matched[matched["method"] == "grpo R2"]
    assert len(r2) == 3 and r2["diff_vs_reference"].abs().max() < 0.02  # same change at the same KL
    by_lr = cells[(cells["axis"] == "optim.lr") & (cells["value"] == 4e-4)].set_index("method")["change"]
    assert by_lr["grpo R2"] - by_lr["grpo native"] == pytest.approx(0.1 * math.log(4), abs=0.02)  # at equal lr
    text = stability_markdown(cells, critical.reset_index(), matched, FIXED)
    assert "## At matched per-update KL" in text and "| learning rate | grpo R2 | 0.0004 | 4 |" in text


def test_a_crossing_inside_the_grid_gets_a_finite_critical_value():
    per_run, per_eval = _synthetic({"grpo native": 40.0})  # KL = 40 lr: change 0 at lr = 1e-4 e^3 / 40 = 5.0e-5
    critical = critical_values(with_methods(per_run, per_eval), FIXED).set_index(["axis", "method"])
    value = critical.loc[("optim.lr", "grpo native")]
    assert value["critical"] == pytest.approx(1e-4 * math.exp(3) / 40, rel=0.1)
    assert value["ci_low"] < value["critical"] < value["ci_high"]


def test_the_map_draws_one_panel_per_axis():
    per_run, per_eval = _synthetic({"grpo native": 1.0, "grpo R2": 0.25}, seeds=2)
    fig = fig_stability_map(stability_cells(with_methods(per_run, per_eval), FIXED))
    heat_maps = [ax for ax in fig.axes if ax.images]
    assert len(heat_maps) == 2 and [ax.get_xlabel() for ax in heat_maps] == ["learning rate",
                                                                              "minibatches per rollout batch"]
