"""analysis/ on constructed data: final evaluations after training, percent tick labels, the calibrated comparison
of a rerun with the committed table (checked by simulation), and the churn scaling fit recovering a known law."""

import math
import re

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from moe_rl.analysis.aggregate import run_finals, run_initials, summarize
from moe_rl.analysis.compare_committed import compare, outside_count
from moe_rl.analysis.compare_committed import main as compare_main
from moe_rl.analysis.panels import percent_axis
from moe_rl.analysis.scaling import (
    bootstrap_laws,
    extrapolation_table,
    fit_power_law,
    held_out_check,
    near_level_cells,
    split_target,
)
from moe_rl.analysis.style import PercentFormatter, new_figure, paper
from moe_rl.errors import ConfigError

# --- final scores ------------------------------------------------------------------------------------------


def _steps(evals: dict[int, float], trained: range, last: int) -> pd.DataFrame:
    rows = [{"run": "r", "step": s, "n_updates": 4 if s in trained else 0, "eval/reward": evals.get(s, np.nan),
             "reward": 0.1 * s if s in trained else np.nan} for s in range(last + 1)]
    return pd.DataFrame(rows)


def test_run_finals_takes_the_evaluation_after_training_not_the_pre_rl_one():
    # Evaluations every 10 steps and after training (step 25): the lr 3e-3 case of the committed study, whose
    # "last 5 evaluations" reached back to the pre-RL 0.137 at step 0.
    steps = _steps({0: 0.137, 10: 0.05, 20: 0.01, 25: 0.0}, range(25), 25)
    assert run_finals(steps, "eval/reward", last_k=5)["r"] == 0.0
    assert run_finals(steps, "eval/reward", last_k=10)["r"] == pytest.approx(0.005)  # steps 15-24: evals 20, 25
    assert run_finals(steps, "reward", last_k=5)["r"] == pytest.approx(0.1 * np.mean([20, 21, 22, 23, 24]))
    assert run_initials(steps, "eval/reward", first_k=5)["r"] == 0.137
    # A run killed at step 22: its only evaluation after the window start (18) is step 20.
    killed = _steps({0: 0.137, 10: 0.05, 20: 0.01}, range(23), 22)
    assert run_finals(killed, "eval/reward", last_k=5)["r"] == 0.01
    # Killed before any evaluation of the trained policy: NaN, not the step-0 value.
    early = _steps({0: 0.137}, range(8), 7)
    assert math.isnan(run_finals(early, "eval/reward", last_k=5)["r"])


# --- percent ticks -----------------------------------------------------------------------------------------


def _parse(label: str) -> float:
    return float(label.rstrip("%")) / 100


@pytest.mark.parametrize("low, high, scale", [(0.01, 0.026, "linear"), (0.0, 0.5, "linear"),
                                              (0.0001, 0.00035, "linear"), (0.0149, 0.0151, "linear"),
                                              (1e-4, 0.3, "log"), (0.02, 0.9, "log"), (0.9, 1.0, "linear")])
def test_percent_tick_labels_are_distinct_and_true(low, high, scale):
    with paper():
        fig, axes = new_figure(1, 1)
        ax = axes[0, 0]
        ax.set_yscale(scale)
        ax.set_ylim(low, high)
        percent_axis(ax.yaxis)  # what every percent axis of the report gets
        ticks = [t for t in ax.yaxis.get_majorticklocs() if low <= t <= high]
        labels = ax.yaxis.get_major_formatter().format_ticks(ticks)
    assert len(ticks) >= 2
    assert len(set(labels)) == len(labels), labels
    for tick, label in zip(ticks, labels):
        decimals = len(label.rstrip("%").partition(".")[2])
        assert abs(_parse(label) - tick) <= 0.5 * 10 ** -decimals / 100 + 1e-15, (tick, label)


def test_percent_labels_keep_the_digits_a_value_needs():
    fmt = PercentFormatter()
    assert fmt.format_ticks([0.01, 0.015, 0.02, 0.025]) == ["1%", "1.5%", "2%", "2.5%"]  # was 1%, 2%, 2%, 2%
    assert fmt.format_ticks([0.0001, 0.001, 0.01, 0.1]) == ["0.01%", "0.1%", "1%", "10%"]
    assert fmt(0.0) == "0%" and fmt(0.123456) == "12.3%"
    assert fmt.format_ticks([0.12341, 0.12342]) == ["12.341%", "12.342%"]  # more digits until they differ
    assert re.fullmatch(r"-?\d+(\.\d+)?%", fmt(-0.05))


# --- comparison with the committed table ------------------------------------------------------------------


def _cells(rows) -> pd.DataFrame:
    return pd.DataFrame(rows).set_index("group")


def _cell(group: str, values, metric: str = "churn") -> dict:
    """A churn_vs_lr_depth row as the report writes it (moe_rl.analysis.aggregate.summarize over the seeds)."""
    summary = summarize(values)
    return {"group": group, "n_runs": summary["n"], f"{metric}_mean": summary["mean"],
            f"{metric}_ci_low": summary["ci_low"], f"{metric}_ci_high": summary["ci_high"]}


def test_compare_flags_a_shift_by_its_prediction_interval(tmp_path, capsys):
    committed = _cells([_cell("lr=1e-4 layers=8", [0.014, 0.015, 0.016]),
                        _cell("lr=3e-4 layers=8", [0.029, 0.030, 0.031]),
                        _cell("lr=1e-3 layers=8", [0.060]),
                        _cell("lr=3e-3 layers=8", [0.09, 0.10, 0.11])])
    new = _cells([_cell("lr=1e-4 layers=8", [0.0080, 0.0083, 0.0086]),  # the 1.8x cross-machine move
                  _cell("lr=3e-4 layers=8", [0.031, 0.032, 0.033]),
                  _cell("lr=1e-3 layers=8", [0.061, 0.062, 0.063])])
    result = compare(new, committed, ["churn"]).set_index("group")
    assert result["verdict"].to_dict() == {"lr=1e-4 layers=8": "OUTSIDE", "lr=3e-4 layers=8": "inside",
                                           "lr=1e-3 layers=8": "one run", "lr=3e-3 layers=8": "missing"}
    # The prediction interval by hand: 0.03 +- t(0.975, 2) 0.001 sqrt(1/3 + 1/3); the sd is backed out of the CI.
    row = result.loc["lr=3e-4 layers=8"]
    assert row["sd"] == pytest.approx(0.001, rel=1e-9)
    assert row["high"] - 0.03 == pytest.approx(4.302653 * 0.001 * math.sqrt(2 / 3), rel=1e-6)
    assert row["p"] == pytest.approx(2 * stats.t.sf(0.002 / (0.001 * math.sqrt(2 / 3)), 2), rel=1e-9)
    # A new mean of 3 seeds at 0.033 lies outside the committed CI of the mean [0.0275, 0.0325] but is a
    # plausible draw from the committed law: the prediction interval [0.0265, 0.0335] keeps it.
    assert committed.loc["lr=3e-4 layers=8", "churn_ci_high"] < 0.033 < row["high"]

    new.reset_index().to_csv(tmp_path / "new.csv", index=False)
    committed.reset_index().to_csv(tmp_path / "old.csv", index=False)
    args = [str(tmp_path / "new.csv"), str(tmp_path / "old.csv"), "--metrics", "churn"]
    assert compare_main(args) == 0
    out = capsys.readouterr().out
    assert "OUTSIDE  lr=1e-4 layers=8  churn: new 0.0083 (3 runs), committed 0.015 (3 runs), 95% prediction" in out
    assert "1 OUTSIDE, 1 inside, 1 missing, 1 one run of 4" in out
    # 1 of 2 tested: P(>= 1 | no change) = 1 - 0.95^2 = 0.0975, not improbable; --strict passes.
    assert "1 OUTSIDE of 2 tested; expected under no change 0.1" in out and "= 0.0975" in out
    assert compare_main([*args, "--strict"]) == 0
    # Both tested cells moved: P(>= 2 of 2 | no change) = 0.0025, and --strict fails.
    new.loc["lr=3e-4 layers=8", "churn_mean"] = 0.05
    new.reset_index().to_csv(tmp_path / "new.csv", index=False)
    assert compare_main([*args, "--strict"]) == 1
    assert "= 0.0025" in capsys.readouterr().out
    assert compare_main([str(tmp_path / "absent.csv"), str(tmp_path / "old.csv")]) == 2


def test_compare_uses_per_seed_values_beside_the_tables(tmp_path, capsys):
    seeds = {"a": [0.10, 0.12, 0.11], "b": [0.50, 0.52, 0.57]}
    for name, shift in (("old", 0.0), ("new", 0.005)):
        folder = tmp_path / name / "tables"
        folder.mkdir(parents=True)
        # The cell table's CI is deliberately wrong: per-seed values, when present, are what counts.
        pd.DataFrame([{**_cell(g, v), "churn_ci_low": 0.0, "churn_ci_high": 1.0} for g, v in seeds.items()]).to_csv(
            folder / "churn_vs_lr_depth.csv", index=False)
        pd.DataFrame([{"run": f"{g}{i}", "group": g, "churn": x + shift} for g, v in seeds.items()
                      for i, x in enumerate(v)]).to_csv(folder / "per_run_final.csv", index=False)
    args = [str(tmp_path / "new" / "tables" / "churn_vs_lr_depth.csv"),
            str(tmp_path / "old" / "tables" / "churn_vs_lr_depth.csv"), "--metrics", "churn", "--test", "welch"]
    assert compare_main(args) == 0
    out = capsys.readouterr().out
    assert "sd from new: per-seed values, committed: per-seed values" in out
    old, new = np.array(seeds["a"]), np.array(seeds["a"]) + 0.005
    assert f"p {stats.ttest_ind(new, old, equal_var=False).pvalue:.3g}" in out.splitlines()[1]


def _null_tables(rng, cells: int, n_old: int, n_new: int, shift_sd: float = 0.0):
    """Committed and rerun cell tables whose seeds come from one normal law per cell (the rerun's shifted by
    `shift_sd` sd), each with the t CI the report writes (moe_rl.analysis.aggregate.t_ci, vectorised here)."""
    means, sds = rng.uniform(0.01, 0.5, cells), rng.uniform(0.001, 0.05, cells)

    def table(n: int, shift: float) -> pd.DataFrame:
        x = rng.normal((means + shift * sds)[:, None], sds[:, None], (cells, n))
        half = stats.t.ppf(0.975, n - 1) * x.std(axis=1, ddof=1) / math.sqrt(n) if n > 1 else np.nan
        return pd.DataFrame({"group": [f"c{i}" for i in range(cells)], "n_runs": n, "churn_mean": x.mean(axis=1),
                             "churn_ci_low": x.mean(axis=1) - half, "churn_ci_high": x.mean(axis=1) + half})

    committed = table(n_old, 0.0)
    return table(n_new, shift_sd).set_index("group"), committed.set_index("group")


@pytest.mark.parametrize("test, n_old, n_new", [("prediction", 3, 3), ("prediction", 5, 1), ("welch", 3, 3),
                                                ("welch", 3, 5)])
def test_compare_under_no_change_rejects_at_the_nominal_rate(test, n_old, n_new):
    new, committed = _null_tables(np.random.default_rng(0), 1500, n_old, n_new)
    result = compare(new, committed, ["churn"], test=test)
    rate = (result["verdict"] == "OUTSIDE").mean()
    tolerance = 4 * math.sqrt(0.05 * 0.95 / 1500)  # binomial, 4 standard errors
    # Welch with 3 + 3 seeds is a little conservative (its df are estimated); the prediction interval is exact.
    assert 0.05 - tolerance - (0.015 if test == "welch" else 0) < rate < 0.05 + tolerance, rate
    outside, tested, p = outside_count(result, 0.05)
    assert tested == 1500 and p > 0.001


def test_the_old_inside_the_ci_check_was_not_calibrated_and_a_shift_is_found():
    new, committed = _null_tables(np.random.default_rng(1), 1500, 3, 3)
    joined = new.join(committed.add_suffix("_old"))
    outside_ci = ~joined["churn_mean"].between(joined["churn_ci_low_old"], joined["churn_ci_high_old"])
    assert 0.07 < outside_ci.mean() < 0.12  # about 9% with nothing changed: "3 of 36 outside" is the null
    shifted, committed = _null_tables(np.random.default_rng(2), 500, 3, 3, shift_sd=3.0)
    power = (compare(shifted, committed, ["churn"])["verdict"] == "OUTSIDE").mean()
    assert power > 0.4  # a 3-sd shift of the seed law is found often at 3 + 3 seeds


# --- the churn scaling fit ---------------------------------------------------------------------------------

LAW = {"intercept": math.log(0.02), "kl_median": 0.6, "model.n_layers": 0.5, "model.n_experts": 0.3,
       "model.top_k": -0.2}


def _synthetic_runs(noise: float, seed: int = 0) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    rows = []
    for layers in (2, 4, 8):
        for experts, top_k in ((8, 2), (32, 4), (64, 8), (64, 4)):
            for kl in (1e-4, 1e-3, 1e-2):
                for _ in range(3):  # seeds
                    x = kl * math.exp(rng.normal(0, 0.2))
                    log_churn = LAW["intercept"] + sum(LAW[k] * math.log(v) for k, v in (
                        ("kl_median", x), ("model.n_layers", layers), ("model.n_experts", experts),
                        ("model.top_k", top_k)))
                    churn = math.exp(log_churn + rng.normal(0, noise))
                    rows.append({"run": f"r{len(rows)}", "kl_median": x, "optim.lr": kl, "model.n_layers": layers,
                                 "model.n_experts": experts, "model.top_k": top_k, "churn": churn,
                                 "set_change": min(1.0, 3 * churn), "learns": kl < 5e-3})
    return pd.DataFrame(rows)


def test_scaling_fit_recovers_a_synthetic_power_law_with_honest_intervals():
    exact = fit_power_law(_synthetic_runs(noise=0.0))
    assert exact.predictors == ["kl_median", "model.n_layers", "model.n_experts", "model.top_k"]
    assert exact.intercept == pytest.approx(LAW["intercept"], abs=1e-9)
    assert exact.coef == pytest.approx([LAW[p] for p in exact.predictors], abs=1e-9) and exact.r2 == pytest.approx(1)

    runs = _synthetic_runs(noise=0.1)
    law = fit_power_law(runs)
    assert law.coef == pytest.approx([LAW[p] for p in law.predictors], abs=0.06)
    boots = bootstrap_laws(runs, "churn", n_boot=200)
    for i, name in enumerate(law.predictors):
        low, high = np.percentile([b.coef[i] for b in boots], [2.5, 97.5])
        assert low < LAW[name] < high, name
    # Extrapolation to the paper's model at KL 1e-3: the true law's value lies in the bootstrap interval.
    table = extrapolation_table(runs.assign(learns=runs["optim.lr"] == 1e-3)).set_index("reading")
    truth = math.exp(LAW["intercept"] + LAW["kl_median"] * math.log(table.loc["churn", "driver_ref"]) + LAW[
        "model.n_layers"] * math.log(48) + LAW["model.n_experts"] * math.log(128) + LAW["model.top_k"] * math.log(8))
    assert table.loc["churn", "predicted_ci_low"] < truth < table.loc["churn", "predicted_ci_high"]
    assert law.predict({"kl_median": law.driver_for(0.1, {"model.n_layers": 48, "model.n_experts": 128,
                        "model.top_k": 8}), "model.n_layers": 48, "model.n_experts": 128, "model.top_k": 8}) == \
        pytest.approx(0.1)


def test_a_width_column_that_varies_adds_a_width_term_and_one_that_does_not_changes_nothing():
    runs = _synthetic_runs(noise=0.0)
    without = fit_power_law(runs)
    assert fit_power_law(runs.assign(**{"model.d_model": 64})).coef == pytest.approx(without.coef, abs=1e-12)
    wide = runs.assign(**{"model.d_model": 128, "churn": runs["churn"] * 2 ** -0.4, "run": runs["run"] + "w"})
    law = fit_power_law(pd.concat([runs.assign(**{"model.d_model": 64}), wide], ignore_index=True))
    assert law.predictors[-1] == "model.d_model" and law.coef[-1] == pytest.approx(-0.4, abs=1e-9)
    held = wide.head(6).assign(**{"model.d_model": 256, "churn": wide["churn"].head(6) * 2 ** -0.4})
    check = held_out_check(pd.concat([runs.assign(**{"model.d_model": 64}), wide], ignore_index=True), held,
                           readings=("churn",))
    assert (check["d_model"] == 256).all() and check["agrees"].all()  # a width beyond the fit, on the law
    with pytest.raises(ConfigError, match="model.d_model"):  # a prediction that forgets the width is refused
        law.predict({"kl_median": 1e-3, "model.n_layers": 4, "model.n_experts": 64, "model.top_k": 8})


def test_the_paper_shaped_arm_is_held_out_and_checked_against_the_prediction():
    runs = _synthetic_runs(noise=0.05)
    paper = runs[runs["model.n_layers"] == 8].head(6).assign(**{"model.n_layers": 48, "model.n_experts": 128,
                                                               "model.top_k": 8})
    law_value = [math.exp(LAW["intercept"] + LAW["kl_median"] * math.log(kl) + LAW["model.n_layers"] * math.log(48)
                          + LAW["model.n_experts"] * math.log(128) + LAW["model.top_k"] * math.log(8))
                 for kl in paper["kl_median"]]
    paper = paper.assign(churn=law_value, set_change=[min(1.0, 3 * v) for v in law_value])
    fit_runs, held_out = split_target(pd.concat([runs, paper], ignore_index=True))
    assert len(held_out) == 6 and len(fit_runs) == len(runs)
    check = held_out_check(fit_runs, held_out, readings=("churn",))
    assert list(check["n_runs"]) == [3, 3]  # per learning rate of the held-out runs
    for r in check.itertuples():
        assert r.predicted_ci_low < r.measured < r.predicted_ci_high
    assert check["agrees"].all() and (check["top_k"] == 8).all()
    doubled = held_out_check(fit_runs, held_out.assign(churn=2 * held_out["churn"]), readings=("churn",))
    assert not doubled["agrees"].any()  # twice the law, well outside both intervals
    both = held_out_check(fit_runs, held_out)  # with set change, its reading from slot churn too
    assert set(both["reading"]) == {"churn", "set_change", "set_change_from_churn"}


def test_scaling_bootstrap_over_warm_starts_carries_their_variance():
    # Two warm starts per depth, each shifting log churn of all its runs by N(0, 0.3): the depth exponent rests on
    # 6 warm starts, not 54 runs. Resampling runs as independent gives a far narrower interval than resampling
    # warm starts (then runs within them).
    rng = np.random.default_rng(0)
    rows = []
    for layers in (2, 4, 8):
        for warm_start in range(2):
            offset = rng.normal(0, 0.3)
            for kl in (1e-4, 1e-3, 1e-2):
                for _ in range(3):
                    churn = math.exp(math.log(0.02) + 0.6 * math.log(kl) + 0.5 * math.log(layers) + offset
                                     + rng.normal(0, 0.05))
                    rows.append({"run": f"r{len(rows)}", "kl_median": kl, "optim.lr": kl, "model.n_layers": layers,
                                 "model.n_experts": 64, "model.top_k": 8, "churn": churn,
                                 "init_from": f"L{layers}-w{warm_start}"})
    runs = pd.DataFrame(rows)
    law = fit_power_law(runs)
    depth = law.predictors.index("model.n_layers")

    def width(boots):
        low, high = np.percentile([b.coef[depth] for b in boots], [2.5, 97.5])
        return high - low

    by_runs = width(bootstrap_laws(runs, "churn", n_boot=200))
    by_warm_start = width(bootstrap_laws(runs, "churn", n_boot=200, cluster="init_from"))
    assert by_warm_start > 2 * by_runs  # 0.49 against 0.16 here
    from moe_rl.analysis.scaling import warm_start_cluster

    assert warm_start_cluster(runs) == "init_from"  # every depth has 2 warm starts: the report resamples them
    one_each = runs.assign(init_from=runs["model.n_layers"].map(lambda n: f"L{n}"))
    assert warm_start_cluster(one_each) is None and warm_start_cluster(runs.drop(columns="init_from")) is None


def test_warm_starts_are_drawn_within_each_architecture():
    from moe_rl.analysis.stats import cluster_resamples

    # 3 architectures: 2, 2 and 1 warm starts of 2 runs each. Stratified, every resample holds each architecture's
    # number of warm starts and runs; drawn across architectures, some resamples leave one out.
    arch = np.array(["a"] * 4 + ["b"] * 4 + ["c"] * 2)
    warm = np.array(["a0", "a0", "a1", "a1", "b0", "b0", "b1", "b1", "c0", "c0"])
    for rows in cluster_resamples(warm, 200, 0, strata=arch):
        assert sorted(arch[rows].tolist()) == sorted(arch.tolist())
        assert all(set(warm[rows][arch[rows] == a]) <= set(warm[arch == a]) for a in "abc")
    assert any(set(arch[rows]) != {"a", "b", "c"} for rows in cluster_resamples(warm, 200, 0))


def test_a_held_init_separates_depth_from_the_residual_init():
    """Churn that depends on the residual init's depth only (exponent -0.4), not on depth: runs at 4 and 8 blocks
    with their own init, and 8 blocks with the 4-block init (init_depth 4). The law finds depth 0 and init -0.4;
    without the held-init runs it would read -0.4 as depth's."""
    from moe_rl.analysis.scaling import INIT_LAYERS

    rows = []
    for layers, init_depth in ((4, 0), (8, 0), (8, 4)):
        for kl in (1e-4, 3e-4, 1e-3):
            init_layers = init_depth or layers
            churn = 0.01 * (kl / 1e-3) ** 0.4 * (init_layers / 4) ** -0.4
            rows.append({"kl_median": kl, "model.n_layers": layers, "model.n_experts": 64, "model.top_k": 8,
                         "model.init_depth": init_depth, "churn": churn})
    runs = pd.DataFrame(rows)
    law = fit_power_law(runs)
    coef = dict(zip(law.predictors, law.coef))
    assert coef["model.n_layers"] == pytest.approx(0, abs=1e-9) and coef[INIT_LAYERS] == pytest.approx(-0.4)
    own = fit_power_law(runs[runs["model.init_depth"] == 0])
    assert INIT_LAYERS not in own.predictors + own.dropped  # no held init: no init term at all
    assert dict(zip(own.predictors, own.coef))["model.n_layers"] == pytest.approx(-0.4)
    assert law.predict({"kl_median": 1e-3, "model.n_layers": 8, "model.n_experts": 64, "model.top_k": 8}) == \
        pytest.approx(0.01 * 2 ** -0.4)  # a model with its own init: init_layers = its depth


def test_set_change_derived_from_slot_churn_respects_its_bound_where_the_direct_fit_breaks_it():
    """The reviewer's case: E and K move together in the runs (8/2 and 64/8), slot churn does not depend on E or K
    at all, and set change is exactly 1 - (1 - c)^K. The direct set-change fit puts the K change into an E exponent
    of log 4 / log 8 = 0.667, so at 128/8 it predicts 2^0.667 = 1.59x the 64/8 value, about 12.6 x slot churn:
    more than K = 8 allows. The derived row stays at 1 - (1 - c)^8."""
    from moe_rl.analysis.scaling import set_change_check, set_change_from_slot

    rows = []
    for layers in (4, 8):
        for experts, top_k in ((8, 2), (64, 8)):
            for kl in (1e-4, 3e-4, 1e-3):
                churn = 0.01 * (kl / 1e-3) ** 0.5 * (layers / 4) ** -0.3
                rows.append({"run": f"r{len(rows)}", "kl_median": kl, "optim.lr": kl, "model.n_layers": layers,
                             "model.n_experts": experts, "model.top_k": top_k, "churn": churn,
                             "set_change": set_change_from_slot(churn, top_k), "learns": True})
    runs = pd.DataFrame(rows)
    table = extrapolation_table(runs).set_index("reading")
    slot = table.loc["churn", "predicted"]
    assert slot == pytest.approx(0.01 * (table.loc["churn", "driver_ref"] / 1e-3) ** 0.5 * 12 ** -0.3, rel=1e-6)
    direct, derived = table.loc["set_change"], table.loc["set_change_from_churn"]
    assert direct["predicted"] / slot == pytest.approx(8 * 2 ** (math.log(4) / math.log(8)), rel=0.03)
    assert not direct["within_k_slot_bound"]
    assert derived["predicted"] == pytest.approx(set_change_from_slot(slot, 8), rel=1e-6)
    assert derived["within_k_slot_bound"] and derived["predicted"] <= 8 * slot
    assert derived["predicted_ci_low"] <= derived["predicted"] <= derived["predicted_ci_high"]
    # the KL at which the derived set change reaches 10% gives 10% when put back through both laws
    kl_10 = derived["driver_for_0.1"]
    assert set_change_from_slot(0.01 * (kl_10 / 1e-3) ** 0.5 * 12 ** -0.3, 8) == pytest.approx(0.1, rel=1e-6)
    check = set_change_check(runs).set_index("top_k")
    assert check.loc[8, "measured_ratio"] == pytest.approx(check.loc[8, "independent_slots_ratio"], rel=1e-9)
    assert check.loc[2, "bound"] == 2 and check.loc[8, "measured_ratio"] < 8


def test_scaling_fit_drops_what_the_runs_do_not_vary_and_refuses_a_fixed_driver():
    runs = _synthetic_runs(noise=0.0)
    law = fit_power_law(runs[runs["model.n_experts"] == 64])  # K still varies (4, 8); E does not
    assert law.dropped == ["model.n_experts"] and "model.top_k" in law.predictors
    with pytest.raises(ConfigError, match="kl_median does not vary"):
        fit_power_law(runs.assign(kl_median=1e-3))


def test_near_level_cells_name_the_reading_and_whether_rl_learns():
    cells = pd.DataFrame([
        {"group": "a", "n_runs": 3, "churn_mean": 0.02, "churn_ci_low": 0.01, "churn_ci_high": 0.03,
         "set_change_mean": 0.09, "set_change_ci_low": 0.08, "set_change_ci_high": 0.1, "eval_gain_mean": 0.1,
         "learns": True},
        {"group": "b", "n_runs": 3, "churn_mean": 0.12, "churn_ci_low": 0.1, "churn_ci_high": 0.14,
         "set_change_mean": 0.5, "set_change_ci_low": 0.4, "set_change_ci_high": 0.6, "eval_gain_mean": -0.2,
         "learns": False}])
    near = near_level_cells(cells)
    assert near[["group", "reading", "learns"]].values.tolist() == [["b", "churn", False], ["a", "set_change", True]]


def test_mdd_of_methods_that_agree_to_rounding_is_tiny_not_an_error():
    """Under the zero-mismatch control every correction is the identity, so two methods' values differ by float
    noise (sd ~1e-17): the minimum detectable difference scales with it, and the exact root must not fail."""
    from moe_rl.analysis.stats import mdd_paired

    assert mdd_paired(3, 1e-17) == pytest.approx(1e-17 * mdd_paired(3, 1.0), rel=1e-9)
    assert mdd_paired(3, 1.0) == pytest.approx(3.26, abs=0.01) and mdd_paired(3, 0.0) == 0.0


def test_power_at_two_seeds_where_scipys_noncentral_t_gives_nan():
    """Two pairs (df 1): scipy's nct is NaN at a noncentrality of ~22; the integral over the chi-squared gives the
    power, and agrees with nct where nct works."""
    from scipy import stats

    from moe_rl.analysis.stats import _noncentral_t_power, mdd_paired, power_paired

    tc = stats.t.ppf(0.975, 1)
    assert _noncentral_t_power(tc, 1, 3.0) == pytest.approx(stats.nct.sf(tc, 1, 3.0) + stats.nct.cdf(-tc, 1, 3.0),
                                                            abs=1e-6)
    assert 0.8 < power_paired(16.0, 1.0, 2) < 1.0
    assert power_paired(mdd_paired(2, 1.0), 1.0, 2) == pytest.approx(0.8, abs=1e-6)


def test_a_nearly_flat_law_puts_the_level_out_of_reach_instead_of_overflowing():
    """One sitting's runs at two lrs gave a churn law with a slope near 0: the lr that reaches 10% churn lies beyond
    any float, and the report (driver_for) crashed with OverflowError; it now reads inf."""
    from moe_rl.analysis.scaling import PowerLaw

    fields = {name: 0 for name in PowerLaw.__dataclass_fields__}
    law = PowerLaw(**{**fields, "reading": "churn", "predictors": ["kl_median"], "intercept": -5.0, "coef": [1e-4],
                      "dropped": []})
    assert law.driver_for(0.1, {}) == math.inf
    assert math.isnan(PowerLaw(**{**fields, "reading": "churn",
        "predictors": ["kl_median"], "intercept": -5.0, "coef": [-1.0], "dropped": []}).driver_for(0.1, {}))
