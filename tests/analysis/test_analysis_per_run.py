"""The report's per-run tables and paired comparisons, on a sweep written by hand (config.json, manifest.json and
metrics.jsonl as the trainer writes them, with values chosen here): the CIs of final_scores.csv and
churn_vs_lr_depth.csv are recomputed from per_run_final.csv, and the paired table is checked against scipy's
paired t-test, Holm by hand and TOST's definition."""

import itertools
import json
import math
from unittest import mock

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from moe_rl.analysis.aggregate import add_groups, group_keys, t_ci
from moe_rl.analysis.comparisons import critical_points, method_keys, paired_comparisons
from moe_rl.analysis.load import load_runs
from moe_rl.analysis.per_run import warm_start_name
from moe_rl.analysis.plots import FIGURES
from moe_rl.analysis.report import ReportConfig, report

METHODS = {"grpo native": ("grpo", "native"), "grpo R2": ("grpo", "R2"), "gspo native": ("gspo", "native")}
SEEDS = (0, 1, 2, 3)
STEPS, MINIBATCHES = 4, 2
# Final held-out reward per method and seed: GRPO+R2 is GRPO + 0.05 +- a little, GSPO is GRPO + 0.001 +- a little.
START = {0: 0.30, 1: 0.34, 2: 0.28, 3: 0.32}  # the step-0 evaluation, shared by every method of a seed
FINAL = {"grpo native": [0.50, 0.56, 0.47, 0.52], "grpo R2": [0.56, 0.60, 0.52, 0.58],
         "gspo native": [0.502, 0.559, 0.468, 0.523]}


def _write_run(folder, objective: str, mode: str, seed: int, final: float, lr: float = 3e-4) -> None:
    folder.mkdir(parents=True)
    config = {"seed": seed, "routing_mode": mode, "total_steps": STEPS, "minibatches": MINIBATCHES,
              "objective": {"name": objective}, "optim": {"lr": lr},
              "model": {"n_layers": 2, "n_experts": 8, "top_k": 2}}
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "manifest.json").write_text(json.dumps({"status": "finished", "seed": seed}))
    rng = np.random.default_rng([seed, len(objective), len(mode)])
    lines, update = [], 0
    for step in range(STEPS):
        reward = 0.3 + 0.05 * step + 0.01 * rng.normal()
        for minibatch in range(MINIBATCHES):
            line = {"step": step, "minibatch": minibatch, "update": update, "wall_time": float(update),
                    "reward": reward, "loss": float(rng.normal()), "update/kl": float(rng.uniform(1e-4, 1e-3)),
                    "routing/update/churn": float(rng.uniform(0.01, 0.02)),
                    "routing/update/set_change": float(rng.uniform(0.02, 0.04)),
                    "routing/update/token_any": float(rng.uniform(0.05, 0.1))}
            if step == 0:
                line["eval/reward"] = START[seed]
            lines.append(line)
            update += 1
    lines.append({"step": STEPS, "minibatch": -1, "update": update, "wall_time": float(update), "eval/reward": final})
    (folder / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))


@pytest.fixture(scope="module")
def sweep_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("per_run") / "sweep"
    for label, (objective, mode) in METHODS.items():
        for seed, final in zip(SEEDS, FINAL[label]):
            _write_run(root / "runs" / f"{objective}_{mode}_s{seed}", objective, mode, seed, final)
    return root


def _report_without_figures(cfg: ReportConfig) -> None:
    """moe-rl report's tables and README; the figures (seconds each) are tests/analysis/test_analysis.py's business."""
    with mock.patch.dict(FIGURES, clear=True):
        report(cfg)


@pytest.fixture(scope="module")
def reported(sweep_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("report") / "out"
    _report_without_figures(ReportConfig(runs=str(sweep_dir), out=str(out), last_k=2, equivalence_margin=0.02))
    return out


def test_per_run_files_recompute_the_committed_cis(reported):
    tables = reported / "tables"
    per_run = pd.read_csv(tables / "per_run_final.csv")
    assert len(per_run) == 12 and set(per_run["seed"]) == set(SEEDS)
    finals = pd.read_csv(tables / "final_scores.csv").set_index(["group", "metric"])
    checked = 0
    for (group, metric), row in finals.iterrows():
        values = per_run.loc[per_run["group"] == group, metric]
        assert row["n_runs"] == values.notna().sum()
        assert row["mean"] == pytest.approx(values.mean(), rel=1e-12)
        assert (row["ci_low"], row["ci_high"]) == pytest.approx(t_ci(values), rel=1e-12)
        checked += 1
    assert checked >= 3 * 6  # every group x every logged final metric
    cells = pd.read_csv(tables / "churn_vs_lr_depth.csv").set_index("group")
    for quantity in ("churn", "set_change", "kl_median", "eval_gain", "reward_final"):
        for group, row in cells.iterrows():
            values = per_run.loc[per_run["group"] == group, quantity]
            assert (row[f"{quantity}_ci_low"], row[f"{quantity}_ci_high"]) == pytest.approx(t_ci(values), rel=1e-12)
    # The held-out finals are the hand-written ones, and the evaluation curves hold step 0 and step total_steps.
    grpo = per_run[per_run["group"] == "grpo native"].sort_values("seed")
    assert grpo["eval/reward"].tolist() == FINAL["grpo native"]
    assert grpo["eval_gain"].to_numpy() == pytest.approx(np.array(FINAL["grpo native"]) - [START[s] for s in SEEDS])
    evals = pd.read_csv(tables / "per_run_eval.csv")
    assert len(evals) == 12 * 2 and sorted(set(evals["step"])) == [0, STEPS]
    start = evals[evals["step"] == 0]
    assert start["eval/reward"].tolist() == [START[s] for s in start["seed"]]


def test_paired_table_against_scipy_holm_and_tost(reported):
    paired = pd.read_csv(reported / "tables" / "paired_comparisons.csv")
    gain = paired[paired["metric"] == "eval_gain"].set_index(["a", "b"])
    assert len(gain) == 3 and set(paired["metric"]) == {"eval_gain", "eval_final", "reward_final"}
    raw = []
    for a, b in gain.index:
        # per-seed gains: final - the shared start, so the paired difference is the difference of finals
        diff = np.array(FINAL[a]) - np.array(FINAL[b])
        reference = stats.ttest_rel(FINAL[a], FINAL[b])
        row = gain.loc[(a, b)]
        assert row["n_pairs"] == 4 and row["diff"] == pytest.approx(diff.mean())
        assert row["p"] == pytest.approx(reference.pvalue, rel=1e-8)
        ci = reference.confidence_interval()
        assert (row["ci_low"], row["ci_high"]) == pytest.approx((ci.low, ci.high), rel=1e-8)
        lower = stats.ttest_1samp(diff, -0.02, alternative="greater").pvalue
        upper = stats.ttest_1samp(diff, 0.02, alternative="less").pvalue
        assert row["p_tost"] == pytest.approx(max(lower, upper), rel=1e-8)
        raw.append(reference.pvalue)
    # Holm over the 3 pairs of this metric, by hand: sorted p times 3, 2, 1, then running max.
    order = np.argsort(raw)
    expected = np.maximum.accumulate(np.minimum(1, np.array(raw)[order] * [3, 2, 1]))
    assert gain["p_holm"].to_numpy()[order] == pytest.approx(expected, rel=1e-8)
    readings = gain["reading"].to_dict()
    assert list(gain.index) == [("grpo R2", "grpo native"), ("grpo R2", "gspo native"), ("grpo native", "gspo native")]
    assert readings[("grpo R2", "grpo native")] == "a > b"  # R2 is 0.04-0.06 higher on every seed
    assert readings[("grpo native", "gspo native")] == "no difference"  # within +-0.02 on every seed
    readme = (reported / "README.md").read_text()
    assert "## Paired comparisons of methods" in readme and "| held-out gain |  | grpo R2 - grpo native | 4 |" in readme
    assert "--equivalence-margin 0.02" in readme


def test_paired_blocks_by_setting_and_pairs_only_shared_seeds(sweep_dir, tmp_path):
    # Add a second learning rate for GRPO and GSPO with seeds 0-2 only: pairs form within each lr, never across.
    for label in ("grpo native", "gspo native"):
        objective, mode = METHODS[label]
        for seed in (0, 1, 2):
            _write_run(sweep_dir.parent / "lr" / f"{objective}_s{seed}", objective, mode, seed, FINAL[label][seed],
                       lr=1e-3)
    data = load_runs(sweep_dir.parent)
    data = add_groups(data, group_keys(data))
    assert data.group_by == ["objective.name", "routing_mode", "optim.lr"]
    assert method_keys(data.group_by) == ["objective.name", "routing_mode"]
    from moe_rl.analysis.per_run import per_run_final

    table = paired_comparisons(per_run_final(data, ["eval/reward"]), data.group_by, metrics=["eval_gain"])
    assert sorted(table["setting"].unique()) == ["lr=0.0003", "lr=0.001"]
    at_high = table[table["setting"] == "lr=0.001"]
    assert len(at_high) == 1 and at_high["n_pairs"].item() == 3
    assert len(table[table["setting"] == "lr=0.0003"]) == 3
    # Holm's family is the whole table of the metric (4 pairs here), not one block.
    assert (table["p_holm"] >= table["p"]).all() and table["p_holm"].max() <= 1
    assert table["p_holm"].to_numpy() == pytest.approx(_holm(table["p"].to_numpy()))
    assert paired_comparisons(per_run_final(data, []), ["optim.lr"]).empty  # no method key: no table


def _holm(p):
    m, order = len(p), np.argsort(p)
    adjusted = np.empty(m)
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * p[i]))
        adjusted[i] = running
    return adjusted


def test_no_paired_table_without_two_methods(tmp_path):
    for seed in (0, 1):
        _write_run(tmp_path / "runs" / f"grpo_s{seed}", "grpo", "native", seed, 0.5 + 0.01 * seed)
    out = tmp_path / "out"
    _report_without_figures(ReportConfig(runs=str(tmp_path / "runs"), out=str(out), last_k=2))
    assert (out / "tables" / "per_run_final.csv").is_file() and (out / "tables" / "per_run_eval.csv").is_file()
    assert not (out / "tables" / "paired_comparisons.csv").exists()
    assert "Paired comparisons" not in (out / "README.md").read_text()


def test_mdd_column_is_the_noncentral_t_inverse(reported):
    paired = pd.read_csv(reported / "tables" / "paired_comparisons.csv")
    for r in paired.itertuples():
        if not math.isfinite(r.sd_diff) or r.sd_diff == 0:
            continue
        nc = r.mdd * math.sqrt(r.n_pairs) / r.sd_diff
        tc = stats.t.ppf(0.975, r.n_pairs - 1)
        power = stats.nct.sf(tc, r.n_pairs - 1, nc) + stats.nct.cdf(-tc, r.n_pairs - 1, nc)
        assert power == pytest.approx(0.8, abs=1e-6)
    assert not list(itertools.filterfalse(math.isfinite, paired["mdd"]))


def test_critical_points_per_method_on_a_known_law():
    # held-out change = slope x log10(x0 / lr) per method, plus a seed offset: GRPO turns negative at 3e-4,
    # GRPO+R2 at 1e-3; a third method never turns negative on the grid.
    crossing = {("grpo", "native"): 3e-4, ("grpo", "R2"): 1e-3, ("gspo", "native"): math.inf}
    rows = [{"seed": s, "objective.name": o, "routing_mode": m, "optim.lr": lr,
             "eval_gain": (0.1 if math.isinf(x0) else 0.2 * math.log10(x0 / lr)) + 0.01 * (s - 1)}
            for (o, m), x0 in crossing.items() for s in range(3) for lr in (1e-4, 1e-3, 1e-2)]
    table = critical_points(pd.DataFrame(rows), "optim.lr", ["objective.name", "routing_mode", "optim.lr"])
    table = table.set_index("method")
    assert table.loc["grpo native", "critical"] == pytest.approx(3e-4, rel=1e-9)
    assert table.loc["grpo R2", "critical"] == pytest.approx(1e-3, rel=1e-9)
    assert table.loc["gspo native", "critical"] == math.inf and table.loc["gspo native", "ci_high"] == math.inf
    for method in ("grpo native", "grpo R2"):
        row = table.loc[method]
        assert row["ci_low"] <= row["critical"] <= row["ci_high"] and row["n_seeds"] == 3


def test_a_warm_start_is_named_by_its_sweep_key_not_by_where_the_sweep_lay():
    # The same warm start, copied into a second sweep folder, must be one cluster of the bootstrap over warm starts.
    here = "sweeps/a/warmstart/L4-E64-K8-D64-1834c7e2/checkpoints/latest.pt"
    there = "../../../other/sweeps/b/warmstart/L4-E64-K8-D64-1834c7e2/checkpoints/latest.pt"
    assert warm_start_name(here) == warm_start_name(there) == "L4-E64-K8-D64-1834c7e2"
    assert warm_start_name("/data/sft_seed3.pt") == "sft_seed3.pt"
    assert warm_start_name(None) is None


def test_the_committed_churn_law_is_recomputed_from_its_per_run_table():
    """results/churn_law/report: the law's coefficients and their intervals (warm starts resampled within each
    architecture) come out of the committed per-run table again, as does the held-out 48-block check."""
    from pathlib import Path

    from moe_rl.analysis.scaling import coefficient_table, held_out_check, split_target, warm_start_cluster

    tables = Path(__file__).resolve().parents[2] / "results" / "churn_law" / "report" / "tables"
    per_run = pd.read_csv(tables / "per_run_final.csv")
    fit_runs, paper_runs = split_target(per_run)
    assert len(fit_runs) == 48 and len(paper_runs) == 6
    cluster = warm_start_cluster(fit_runs)
    assert cluster == "init_from" and fit_runs.groupby("model.n_experts")["init_from"].nunique().min() >= 2
    committed = pd.read_csv(tables / "scaling_fit.csv")
    again = coefficient_table(fit_runs, cluster=cluster)
    for column in ("estimate", "ci_low", "ci_high"):
        assert again[column].to_numpy() == pytest.approx(committed[column].to_numpy(), rel=1e-9, nan_ok=True)
    check = held_out_check(fit_runs, paper_runs, cluster=cluster)
    assert check["agrees"].tolist() == pd.read_csv(tables / "scaling_check.csv")["agrees"].tolist()
