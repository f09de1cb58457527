"""analysis/stability.py: the decline rule, cells, critical values and the KL-matched reading, on runs whose answers
are known by construction, and the 4-block map's committed tables recomputed. The deep arm's committed studies:
tests/analysis/test_stability_deep_arm.py."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from moe_rl.analysis.sittings import sitting_table
from moe_rl.analysis.stability import (
    critical_values,
    fig_stability_map,
    kl_matched,
    kl_matched_axes,
    method_name,
    run_changes,
    stability_cells,
    with_methods,
)
from moe_rl.analysis.stability_text import stability_markdown

STABILITY = Path(__file__).resolve().parents[2] / "results" / "stability"


def source(sitting: str) -> str:
    """A committed sitting of results/stability, as pooled_frame reads it (moe_rl.analysis.sittings)."""
    return f"{STABILITY}@{sitting}"


def committed_table(sitting: str, table: str) -> pd.DataFrame:
    """The table a sitting's report committed (results/stability/tables/<table>.parquet, its rows)."""
    return sitting_table(STABILITY, table, sitting)

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
    both = kl_matched_axes(frame, FIXED)
    assert list(both["axis"].unique()) == ["optim.lr", "minibatches"]
    for axis in ("optim.lr", "minibatches"):  # each axis's own reading, Holm within the axis
        own = both[both["axis"] == axis].drop(columns="axis").reset_index(drop=True)
        pd.testing.assert_frame_equal(own, kl_matched(frame, FIXED, axis), check_dtype=False)
    text = stability_markdown(cells, critical.reset_index(), both, FIXED)
    assert "## At matched per-update KL" in text and "| learning rate | grpo R2 | 0.0004 | 4 |" in text
    assert f"| learning rate | {both['kl'].iloc[0]:.3g} | grpo R2 |" in text


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


def _paired_frame() -> pd.DataFrame:
    """Two cells (lr 1e-4, 4e-4) x 4 seeds x three methods, change = reference + an offset per method and cell plus a
    seed effect every method shares (so pairing removes it): R2 +0.10 at 4e-4 (where the reference falls to
    -0.20), R3 +0.002 everywhere, GSPO -0.10 at 1e-4."""
    seed_effect = [0.05, -0.04, 0.01, -0.02]
    jitter = [0.004, -0.003, 0.001, -0.002]
    base = {1e-4: 0.10, 4e-4: -0.20}
    offsets = {"grpo R2": {1e-4: 0.0, 4e-4: 0.10}, "grpo R3": {1e-4: 0.002, 4e-4: 0.002},
               "gspo native": {1e-4: -0.10, 4e-4: 0.0}}
    rows = []
    for lr, start in base.items():
        for seed, (effect, noise) in enumerate(zip(seed_effect, jitter)):
            rows.append({"method": "grpo native", "optim.lr": lr, "minibatches": 4, "seed": seed,
                         "change": start + effect, "greedy_change": start + effect})
            for i, (method, by_lr) in enumerate(offsets.items()):
                value = start + effect + by_lr[lr] + noise * (i + 1)
                rows.append({"method": method, "optim.lr": lr, "minibatches": 4, "seed": seed, "change": value,
                             "greedy_change": value})
    return pd.DataFrame(rows)


def test_paired_cells_remove_the_shared_seed_effect_and_call_rescues_and_equivalence():
    from moe_rl.analysis.stability import paired_cells
    from moe_rl.analysis.stats import holm, paired_t, tost_p

    frame = _paired_frame()
    paired = paired_cells(frame, {"optim.lr": 5e-5, "minibatches": 4})
    t1 = paired[paired["endpoint"] == "change"].set_index(["value", "method"])
    assert len(t1) == 6 and set(paired["endpoint"]) == {"change", "greedy_change"}
    # the numbers are the textbook paired t, Holm over the 6 pairs of the table, TOST at the fixed margin
    r2 = frame[frame["method"] == "grpo R2"].set_index(["optim.lr", "seed"])["change"]
    ref = frame[frame["method"] == "grpo native"].set_index(["optim.lr", "seed"])["change"]
    expected = paired_t(r2.loc[4e-4].to_numpy(), ref.loc[4e-4].to_numpy())
    assert t1.loc[(4e-4, "grpo R2"), "diff"] == pytest.approx(0.10 + np.mean([0.004, -0.003, 0.001, -0.002]))
    assert t1.loc[(4e-4, "grpo R2"), "p"] == pytest.approx(expected.p)
    assert t1.loc[(4e-4, "grpo R2"), "tost_p"] == pytest.approx(tost_p(expected, 0.03))
    np.testing.assert_allclose(t1["p_holm"].to_numpy(), holm(t1["p"].to_numpy()))
    # the reference falls at 4e-4 (CI below 0) and R2 is better there: a rescue; at 1e-4 R2 is the reference
    assert t1.loc[(4e-4, "grpo R2"), "verdict"] == "better" and bool(t1.loc[(4e-4, "grpo R2"), "rescue"])
    assert t1.loc[(1e-4, "gspo native"), "verdict"] == "worse" and not t1.loc[(1e-4, "gspo native"), "rescue"]
    # R3 is 0.002 off with a spread of a few thousandths: equivalent at +-0.03, not "undecided"
    assert t1.loc[(1e-4, "grpo R3"), "verdict"] == "equivalent"
    assert t1.loc[(4e-4, "grpo R3"), "verdict"] == "equivalent"


def test_a_pair_without_enough_seeds_is_untested_and_noise_is_undecided():
    from moe_rl.analysis.stability import paired_cells

    frame = _paired_frame()
    frame = frame[~((frame["method"] == "grpo R3") & (frame["seed"] > 0))]  # R3 has one seed left
    rng = np.random.default_rng(1)
    noisy = frame["method"] == "gspo native"
    frame.loc[noisy, "change"] = frame.loc[noisy, "change"] + rng.normal(0, 0.2, noisy.sum())
    paired = paired_cells(frame, {"optim.lr": 5e-5, "minibatches": 4}).set_index(["endpoint", "value", "method"])
    assert paired.loc[("change", 1e-4, "grpo R3"), "verdict"] == "untested"
    assert paired.loc[("change", 1e-4, "grpo R3"), "n_pairs"] == 1
    assert paired.loc[("change", 4e-4, "gspo native"), "verdict"] == "undecided"


def test_two_seeds_whose_differences_coincide_give_no_verdict():
    """Two seeds with the same paired difference (discrete accuracies make it likely) have sd 0, which the paired t
    reads as p ~ 0; a verdict needs 3 seeds, so the pair reads "too few seeds", and a third seed makes it a test."""
    from moe_rl.analysis.stability import paired_cells

    def frame(starts):
        return pd.DataFrame([{"method": method, "optim.lr": 2e-4, "minibatches": minibatches, "seed": seed,
                              "change": start + lift, "greedy_change": start + lift}
                             for minibatches in (2, 4) for seed, start in enumerate(starts)
                             for method, lift in (("grpo native", 0.0), ("grpo R3", 0.024))])

    fixed = {"optim.lr": 2e-4, "minibatches": 4}
    two = paired_cells(frame([0.026, 0.006]), fixed)
    assert len(two) == 4 and (two["p"] < 1e-12).all()  # the degenerate t: zero spread, certain
    assert set(two["verdict"]) == {"too few seeds"}
    three = paired_cells(frame([0.026, 0.006, 0.011]), fixed)
    assert set(three["verdict"]) == {"better"} and (three["n_pairs"] == 3).all()


def test_the_minimum_detectable_difference_uses_the_pooled_sd_of_the_differences():
    from moe_rl.analysis.stability import paired_mdd
    from moe_rl.analysis.stats import mdd_paired

    frame = _paired_frame()
    mdd = paired_mdd(frame, {"optim.lr": 5e-5, "minibatches": 4}).set_index(["axis", "endpoint"])
    # each method's differences are jitter x (i + 1): sd of [4, -3, 1, -2] e-3 times 1, 2, 3, pooled equally
    sd = np.std([0.004, -0.003, 0.001, -0.002], ddof=1) * math.sqrt(np.mean([1, 4, 9]))
    assert mdd.loc[("optim.lr", "change"), "sd_diff"] == pytest.approx(sd)
    assert mdd.loc[("optim.lr", "change"), "mdd"] == pytest.approx(mdd_paired(4, sd))


def test_the_greedy_endpoint_is_read_like_the_sampled_one():
    rows = [("a", s, v, g) for s, v, g in zip((0, 5, 10, 15), (0.10, 0.12, 0.14, 0.16), (0.2, 0.3, 0.3, 0.3))]
    per_eval = pd.DataFrame(rows, columns=["run", "step", "eval/reward", "eval/greedy"])
    per_eval["eval/reward_se"] = 0.01
    per_eval["eval/greedy_se"] = 0.01
    changes = run_changes(per_eval).set_index("run")
    assert changes.loc["a", "change"] == pytest.approx(0.04)
    assert changes.loc["a", "greedy_change"] == pytest.approx(0.1)
    assert changes.loc["a", "greedy_declined"] == 0.0 and changes.loc["a", "n_after"] == 3


def test_method_fields_come_from_the_run_configs_when_the_report_left_them_out():
    from moe_rl.analysis.stability import with_configs

    per_run = pd.DataFrame({"run": ["a", "b"], "seed": [0, 0], "routing_mode": ["native", "native"]})
    runs = pd.DataFrame({"run": ["b", "a"], "routing_mode": ["native", "native"], "objective.name": ["grpo", "grpo"],
                         "correction.is_level": ["token", "none"], "correction.is_cap": [2.0, None],
                         "correction.is_band": [None, None], "optim.lr": [1e-4, 1e-4], "minibatches": [4, 4]})
    frame = with_configs(per_run, runs)
    assert list(frame["run"]) == ["a", "b"] and list(frame["minibatches"]) == [4, 4]
    assert [method_name(row) for _, row in frame.iterrows()] == ["grpo native", "grpo native TIS cap 2"]


def test_only_results_count_and_a_diverged_run_declines_to_zero():
    per_run = pd.DataFrame({"run": ["done", "blown", "live"], "seed": [0, 1, 2], "status": ["finished", "diverged",
                            "running"], "objective.name": "grpo", "routing_mode": "native", "optim.lr": 4e-4,
                            "minibatches": 4})
    rows = [("done", s, v) for s, v in zip((0, 5, 10, 15), (0.10, 0.12, 0.14, 0.16))]
    rows += [("blown", 0, 0.10), ("blown", 5, 0.11)]  # diverged after its first evaluation
    rows += [("live", s, v) for s, v in zip((0, 5, 10, 15), (0.10, 0.20, 0.20, 0.20))]
    per_eval = pd.DataFrame(rows, columns=["run", "step", "eval/reward"])
    per_eval["eval/greedy"] = per_eval["eval/reward"]
    per_eval["eval/reward_se"] = per_eval["eval/greedy_se"] = 0.01
    frame = with_methods(per_run, per_eval).set_index("run")
    assert list(frame.index) == ["done", "blown"]  # the running one is not a result yet
    assert frame.loc["blown", "change"] == pytest.approx(-0.10) and frame.loc["blown", "declined"] == 1.0
    assert frame.loc["blown", "greedy_change"] == pytest.approx(-0.10)
    assert frame.loc["done", "change"] == pytest.approx(0.04) and frame.loc["done", "declined"] == 0.0


def test_the_shared_cell_of_two_sweeps_counts_once_and_a_differing_repeat_is_refused():
    from moe_rl.analysis.stability import drop_repeats

    frame = pd.DataFrame({"method": ["grpo native"] * 3, "optim.lr": [5e-5, 5e-5, 1e-4], "minibatches": [4, 4, 4],
                          "seed": [0, 0, 0], "change": [0.05, 0.05, 0.02], "run": ["lr/a", "staleness/a", "lr/b"]})
    kept, dropped = drop_repeats(frame)
    assert dropped == 1 and list(kept["run"]) == ["lr/a", "lr/b"]
    frame.loc[1, "change"] = 0.06
    from moe_rl.errors import DataError

    with pytest.raises(DataError, match="different held-out change"):  # main() turns it into one line
        drop_repeats(frame)


def test_the_change_against_step_figure_has_a_point_per_run_on_both_panels():
    from moe_rl.analysis.stability import fig_change_vs_step

    per_run, per_eval = _synthetic({"grpo native": 1.0, "grpo R2": 0.25}, seeds=2)
    per_run["set_change"] = per_run["kl_median"] * 10
    fig = fig_change_vs_step(with_methods(per_run, per_eval), FIXED)
    panels = [ax for ax in fig.axes if ax.collections]
    assert len(panels) == 2
    for ax in panels:  # 2 methods x 5 lrs x 2 seeds
        assert sum(len(c.get_offsets()) for c in ax.collections) == 20 and ax.get_xscale() == "log"


def test_the_confirmatory_table_uses_only_the_given_seeds():
    from moe_rl.analysis.stability import paired_cells, paired_mdd

    frame = _paired_frame()
    frame["declined"], frame["kl_median"] = 0.0, 1e-3
    later = frame[frame["seed"].isin([1, 2, 3])]
    confirm = paired_cells(later, FIXED)
    assert set(confirm["n_pairs"]) == {3}
    cells = stability_cells(frame, FIXED)
    text = stability_markdown(cells, critical_values(frame, FIXED), kl_matched_axes(frame, FIXED), FIXED,
                              paired_cells(frame, FIXED), paired_mdd(frame, FIXED),
                              ([1, 2, 3], confirm, paired_mdd(later, FIXED)))
    assert "(paired by seed)" in text and "(paired by seed; confirmatory: seeds 1, 2, 3)" in text
    assert text.index("confirmatory") > text.index("(paired by seed)")


def test_a_run_learned_when_its_change_clears_twice_the_noise_floor():
    """From a start of 0.003 (SE 0.0017 at 1,024 prompts): a rise to 0.03 learned; a fall to 0 (change -0.003;
    the binomial SE of 0 is 0, so the floor is the start's SE) neither learned nor declined: near the noise floor a
    collapse can hide from the decline rule, and the learned outcome still counts it as a failure to learn."""
    se = math.sqrt(0.003 * 0.997 / 1024)
    rows = [("up", s, v, se) for s, v in zip((0, 5, 10, 15), (0.003, 0.03, 0.03, 0.03))]
    rows += [("flat", s, v, se if v else 0.0) for s, v in zip((0, 5, 10, 15), (0.003, 0.0, 0.0, 0.0))]
    changes = run_changes(pd.DataFrame(rows, columns=["run", "step", "eval/reward", "eval/reward_se"]))
    changes = changes.set_index("run")
    assert changes.loc["up", "learned"] == 1.0 and changes.loc["up", "declined"] == 0.0
    assert changes.loc["flat", "floor"] == pytest.approx(se)
    assert changes.loc["flat", "learned"] == 0.0 and changes.loc["flat", "declined"] == 0.0


def _report_folder(root, name: str, runs: list[tuple[str, int, float]]):
    """A report folder holding the three per-run tables: per run (name, seed, final held-out), native GRPO at lr
    4e-4 and 4 minibatches, evaluations 0.1 then three times the final value."""
    tables = root / name / "tables"
    tables.mkdir(parents=True)
    pd.DataFrame({"run": [r for r, _, _ in runs], "seed": [s for _, s, _ in runs], "status": "finished"}).to_csv(
        tables / "per_run_final.csv", index=False)
    pd.DataFrame({"run": [r for r, _, _ in runs], "objective.name": "grpo", "routing_mode": "native",
                  "optim.lr": 4e-4, "minibatches": 4}).to_csv(tables / "runs.csv", index=False)
    evals = [(r, step, 0.1 if step == 0 else final, 0.01) for r, _, final in runs for step in (0, 5, 10, 15)]
    pd.DataFrame(evals, columns=["run", "step", "eval/reward", "eval/reward_se"]).to_csv(tables / "per_run_eval.csv",
                                                                                        index=False)
    return root / name


def test_sittings_pool_by_folder_a_repeat_counts_once_and_a_differing_one_is_refused(tmp_path):
    from moe_rl.analysis.stability import pooled_frame
    from moe_rl.errors import DataError

    first = _report_folder(tmp_path, "lr_1", [("runs/a", 0, 0.2), ("runs/b", 1, 0.3)])
    second = _report_folder(tmp_path, "lr_2", [("runs/a", 0, 0.2), ("runs/c", 2, 0.0)])  # seed 0 again, same value
    frame, repeats = pooled_frame([first, second])
    assert repeats == 1 and sorted(frame["run"]) == ["lr_1/runs/a", "lr_1/runs/b", "lr_2/runs/c"]
    assert frame.set_index("run")["change"].to_dict() == pytest.approx(
        {"lr_1/runs/a": 0.1, "lr_1/runs/b": 0.2, "lr_2/runs/c": -0.1})
    alone, none = pooled_frame([first])  # one folder: the report's own run names
    assert none == 0 and sorted(alone["run"]) == ["runs/a", "runs/b"]
    other = _report_folder(tmp_path / "x", "lr_2", [("runs/a", 0, 0.25)])
    with pytest.raises(DataError, match="different held-out change"):
        pooled_frame([first, other])
    with pytest.raises(DataError, match="share a name"):
        pooled_frame([second, other])
    (first / "tables" / "runs.csv").unlink()
    with pytest.raises(DataError, match="runs.csv: no such table"):
        pooled_frame([first])


def test_the_committed_map_is_recomputed_from_its_per_run_tables():
    """results/stability/lr_1 (the first sitting's report): the cells and the paired table follow from its
    committed per-run rows alone."""

    from moe_rl.analysis.stability import paired_cells, pooled_frame

    folder, tables = source("lr_1"), "lr_1"
    frame, _ = pooled_frame([folder])
    committed = committed_table(tables, "stability_cells")
    again = stability_cells(frame, FIXED)
    assert len(again) == len(committed) == 30
    for column in ("n_seeds", "change", "change_ci_low", "greedy_change", "n_declined", "kl_median", "set_change"):
        np.testing.assert_allclose(again[column].to_numpy(float), committed[column].to_numpy(float), rtol=1e-9,
                                   equal_nan=True, err_msg=column)
    paired = paired_cells(frame, FIXED)
    np.testing.assert_allclose(paired["p_holm"].to_numpy(float),
                               committed_table(tables, "paired_cells")["p_holm"].to_numpy(float), equal_nan=True)


def test_the_staleness_map_is_recomputed_from_its_per_run_tables():
    """results/stability/staleness_1 (the third sitting, lr 2e-4): its cells, critical values and paired table
    follow from its committed per-run rows alone."""

    from moe_rl.analysis.stability import paired_cells, pooled_frame

    folder, tables, fixed = source("staleness_1"), "staleness_1", {"optim.lr": 2e-4, "minibatches": 4}
    frame, _ = pooled_frame([folder])
    committed = committed_table(tables, "stability_cells")
    again = stability_cells(frame, fixed)
    assert len(again) == len(committed) == 30 and set(again["axis"]) == {"minibatches"}
    for column in ("n_seeds", "change", "change_ci_low", "n_learned", "n_declined", "kl_median", "set_change"):
        np.testing.assert_allclose(again[column].to_numpy(float), committed[column].to_numpy(float), rtol=1e-9,
                                   equal_nan=True, err_msg=column)
    critical = critical_values(frame, fixed)
    np.testing.assert_array_equal(critical[["ci_low", "ci_high"]].to_numpy(float),
                                  committed_table(tables, "critical")[["ci_low", "ci_high"]].to_numpy(float))
    np.testing.assert_allclose(paired_cells(frame, fixed)["p_holm"].to_numpy(float),
                               committed_table(tables, "paired_cells")["p_holm"].to_numpy(float), equal_nan=True)


def test_the_pooled_staleness_axis_is_recomputed_from_both_sittings_tables():
    """results/stability/staleness: the staleness axis from the third and fourth sittings' per-run tables; the fourth
    re-ran one of the third's runs (the pooling check of PROTOCOL.md's fourth addendum), and they agree (else
    pooled_frame raises). Every cell has 3 seeds."""

    from moe_rl.analysis.stability import paired_cells, pooled_frame
    fixed = {"optim.lr": 2e-4, "minibatches": 4}
    frame, repeats = pooled_frame([source("staleness_1"), source("staleness_2")])
    assert repeats == 1 and len(frame) == 90
    tables = "staleness"
    committed = committed_table(tables, "stability_cells")
    again = stability_cells(frame, fixed)
    assert len(again) == 30 and set(again["n_seeds"]) == {3}
    for column in ("n_seeds", "change", "change_ci_low", "n_learned", "n_declined", "kl_median", "set_change"):
        np.testing.assert_allclose(again[column].to_numpy(float), committed[column].to_numpy(float), rtol=1e-9,
                                   equal_nan=True, err_msg=column)
    np.testing.assert_array_equal(critical_values(frame, fixed)[["ci_low", "ci_high"]].to_numpy(float),
                                  committed_table(tables, "critical")[["ci_low", "ci_high"]].to_numpy(float))
    paired = paired_cells(frame, fixed)
    np.testing.assert_allclose(paired["p_holm"].to_numpy(float),
                               committed_table(tables, "paired_cells")["p_holm"].to_numpy(float), equal_nan=True)
    assert set(paired["verdict"]) == {"equivalent", "undecided"}


def test_the_pooled_map_is_recomputed_from_the_sittings_tables():
    """results/stability: the map of the lr axis's sittings (lr_1 .. lr_5) from their committed per-run tables alone;
    the second sitting re-ran four of the first's runs, the eighth one of the second's (PROTOCOL.md, 16:45 UTC
    addendum), and lr_4 is the eighth sitting's folder with the ninth's runs added, so the eighth's 13 runs come
    twice; every repeat agrees (else pooled_frame raises). The eighth sitting gave lr 5e-5 its 3 seeds, the ninth
    2.5e-5; the tenth and eleventh (lr_5) gave the frontier cells, 8e-4 and 1.6e-3, 5 seeds."""

    from moe_rl.analysis.stability import critical_values, pooled_frame
    frame, repeats = pooled_frame([source(f"lr_{sitting}") for sitting in (1, 2, 3, 4, 5)])
    assert repeats == 18 and len(frame) == 162
    cells = stability_cells(frame, FIXED)
    at_5e5 = cells[np.isclose(cells["value"], 5e-5)]
    assert len(at_5e5) == 6 and set(at_5e5["n_seeds"]) == {3} and (at_5e5["change_ci_low"] > 0).all()
    at_2e5 = cells[np.isclose(cells["value"], 2.5e-5)]
    assert len(at_2e5) == 6 and set(at_2e5["n_seeds"]) == {3} and set(at_2e5["n_learned"]) == {3}
    assert cells["n_seeds"].min() >= 3  # every cell of the lr axis has 3 seeds or more
    frontier = cells[np.isclose(cells["value"], 8e-4) | np.isclose(cells["value"], 1.6e-3)]
    assert len(frontier) == 12 and set(frontier["n_seeds"]) == {5}
    committed = committed_table("lr_map", "stability_cells")
    again = stability_cells(frame, FIXED)
    for column in ("n_seeds", "change", "change_ci_low", "n_learned", "n_declined", "kl_median"):
        np.testing.assert_allclose(again[column].to_numpy(float), committed[column].to_numpy(float), rtol=1e-9,
                                   equal_nan=True, err_msg=column)
    critical = critical_values(frame, FIXED)
    np.testing.assert_allclose(critical["critical"].to_numpy(float),
                               committed_table("lr_map", "critical")["critical"].to_numpy(float), rtol=1e-9)


def test_a_method_at_one_axis_value_takes_no_part_in_the_kl_matched_reading():
    """GRPO native and R2 along the whole lr axis, R3 only at lr 1e-4: R3 has no curve to read, so the KL points
    lie inside native's and R2's common range (as without R3), not at R3's one KL, where no point would fit; with
    native the only method left, there is nothing to match."""
    per_run, per_eval = _synthetic({"grpo native": 1.0, "grpo R2": 0.25, "grpo R3": 0.5})
    one_value = (per_run["routing_mode"] == "R3") & ~np.isclose(per_run["optim.lr"], 1e-4)
    frame = with_methods(per_run[~one_value], per_eval)
    matched = kl_matched(frame, FIXED)
    without_r3 = kl_matched(with_methods(*_synthetic({"grpo native": 1.0, "grpo R2": 0.25})), FIXED)
    assert set(matched["method"]) == {"grpo native", "grpo R2"}
    np.testing.assert_allclose(matched["kl"].unique(), without_r3["kl"].unique())
    # the points lie inside R2's range (0.25 x 2.5e-5 .. 0.25 x 4e-4) and native's (2.5e-5 .. 4e-4)
    assert matched["kl"].min() > 2.5e-5 and matched["kl"].max() < 1e-4
    native_and_one_value = (per_run["routing_mode"] == "native") | (per_run["routing_mode"] == "R3") & ~one_value
    assert kl_matched(with_methods(per_run[native_and_one_value], per_eval), FIXED).empty


def test_a_folder_of_one_cell_off_the_fixed_point_is_read_as_that_cell_of_its_axis():
    """A sitting of one lr (4e-4, at the fixed 4 minibatches) analysed on its own is one cell of the lr axis, paired
    and Holm-adjusted within it; a folder of the fixed point's own cell (lr 5e-5, 4 minibatches) lies on both axes
    and is read as neither; a folder with a swept axis reads that axis alone, as before."""
    from moe_rl.analysis.stability import paired_cells, swept_axes

    per_run, per_eval = _synthetic({"grpo native": 1.0, "grpo R2": 0.25, "grpo R3": 0.5})
    frame = with_methods(per_run, per_eval)
    one_lr = frame[np.isclose(frame["optim.lr"], 4e-4)]
    assert swept_axes(one_lr, FIXED) == ["optim.lr"]
    cells = stability_cells(one_lr, FIXED)
    assert len(cells) == 3 and set(cells["value"]) == {4e-4} and set(cells["n_seeds"]) == {4}
    paired = paired_cells(one_lr, FIXED)
    at_t1 = paired[paired["endpoint"] == "change"]
    assert len(at_t1) == 2  # R2 and R3 against native: Holm over these two
    np.testing.assert_allclose(sorted(at_t1["p_holm"]), sorted(np.minimum(1, [min(at_t1["p"]) * 2, max(at_t1["p"])])))
    centre = frame[np.isclose(frame["optim.lr"], 5e-5) & (frame["minibatches"] == 4)]
    assert swept_axes(centre, FIXED) == [] and stability_cells(centre, FIXED).empty
    assert swept_axes(frame[frame["minibatches"] == 4], FIXED) == ["optim.lr"]
    assert swept_axes(frame, FIXED) == ["optim.lr", "minibatches"]
