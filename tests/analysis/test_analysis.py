"""analysis/: loaders, aggregation over seeds, figures and the `moe-rl report` command, on real tiny runs.

The runs are made once per module by the real trainer (about a second each): a sweep of GRPO, GRPO+R2 and GSPO
over two seeds, a learning-rate x depth scan, and a run that diverges. Every table is checked against a direct
pandas computation on the loaded frames, written out here.
"""

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from conftest import TINY_MODEL, tiny_train_config

from moe_rl.analysis.aggregate import (
    add_groups,
    bootstrap_ci,
    final_scores,
    group_keys,
    iqm,
    layer_churn,
    mean_ci,
    run_finals,
    t_ci,
)
from moe_rl.analysis.cells import churn_vs_lr_depth
from moe_rl.analysis.load import NoRunsError, load_runs
from moe_rl.analysis.plots import FIGURES
from moe_rl.analysis.report import ReportConfig, summary_markdown
from moe_rl.commands.train import train
from moe_rl.errors import ConfigError
from moe_rl.model import ModelConfig
from moe_rl.objectives import ObjectiveConfig
from moe_rl.rl.run_config import LogConfig, OptimConfig
from moe_rl.runs.runlog import RunDir, read_metrics

REPO = Path(__file__).resolve().parents[2]
EVAL = LogConfig(eval_every=2, eval_prompts=4)
SWEEP = {"grpo": {}, "grpo_r2": {"routing_mode": "R2"}, "gspo": {"objective": ObjectiveConfig(name="gspo")}}


@pytest.fixture(scope="module")
def runs_root(tmp_path_factory):
    """root/sweep/runs/<objective>_s<seed>, root/scan/<lr>_<depth>, root/diverged."""
    root = tmp_path_factory.mktemp("analysis")
    for name, overrides in SWEEP.items():
        for seed in (0, 1):
            train(tiny_train_config(root / "sweep" / "runs" / f"{name}_s{seed}", seed=seed, log=EVAL, **overrides))
    (root / "sweep" / "sweep.json").write_text(json.dumps({"name": "tiny", "grid": list(SWEEP)}))
    for lr, layers in ((3e-4, 2), (3e-2, 2), (3e-2, 3)):
        model = ModelConfig(**{**TINY_MODEL, "n_layers": layers})
        train(tiny_train_config(root / "scan" / f"lr{lr:g}_L{layers}", total_steps=2, model=model,
                                optim=OptimConfig(lr=lr)))
    train(tiny_train_config(root / "diverged", optim=OptimConfig(lr=1e30, grad_clip=0.0)))
    return root


@pytest.fixture(scope="module")
def sweep(runs_root):
    data = load_runs(runs_root / "sweep")
    return add_groups(data, group_keys(data))


# --- loaders -----------------------------------------------------------------------------------------------


def test_loader_finds_every_run_with_its_config_and_status(sweep):
    assert sorted(sweep.runs["run"]) == sorted(f"runs/{n}_s{s}" for n in SWEEP for s in (0, 1))
    assert set(sweep.runs["status"]) == {"finished"}
    assert sweep.sweep == {"name": "tiny", "grid": list(SWEEP)}
    for column in ("run", "path", "status", "seed", "objective.name", "routing_mode", "optim.lr", "model.n_layers"):
        assert column in sweep.metrics.columns and column in sweep.steps.columns
    assert len(sweep.metrics) == 6 * 3 * 4  # runs x rollout steps x minibatches: one row per optimizer step
    assert (sweep.metrics["minibatch"] >= 0).all()
    assert set(sweep.routing["probe"]) >= {"update", "staleness", "noise", "rollout"}


def test_steps_take_the_first_line_for_rollout_metrics_and_the_mean_for_update_metrics(sweep):
    run = sweep.runs.iloc[0]
    lines = pd.DataFrame(read_metrics(run["path"]))
    optimizer_lines = lines[lines["minibatch"] >= 0]
    steps = sweep.steps[sweep.steps["run"] == run["run"]].set_index("step")
    assert list(steps.index) == [0, 1, 2, 3]  # step 3 holds only the evaluation after training
    for step, group in optimizer_lines.groupby("step"):
        assert steps.loc[step, "reward"] == group["reward"].iloc[0]
        assert steps.loc[step, "loss/total"] == pytest.approx(group["loss/total"].mean(), rel=1e-12)
        assert steps.loc[step, "routing/update/churn"] == pytest.approx(group["routing/update/churn"].mean())
        assert steps.loc[step, "n_updates"] == 4
    assert steps.loc[3, "n_updates"] == 0 and not math.isnan(steps.loc[3, "eval/reward"])
    assert not math.isnan(steps.loc[0, "eval/reward"])  # the step-0 eval rides on the first minibatch line


def test_group_keys_are_the_varying_config_fields_without_seed_or_paths(sweep, runs_root):
    assert sweep.group_by == ["objective.name", "routing_mode"]
    assert sweep.groups == ["grpo R2", "grpo native", "gspo native"]
    data = load_runs(runs_root / "sweep")
    assert group_keys(data, ["objective.name"]) == ["objective.name"]
    with pytest.raises(ConfigError, match="no config field optim.lrr.*objective.name"):
        group_keys(data, ["optim.lrr"])


def test_a_run_killed_mid_line_loads_without_its_partial_line(runs_root, tmp_path):
    run = tmp_path / "killed"
    shutil.copytree(runs_root / "sweep" / "runs" / "grpo_s0", run)
    text = (run / "metrics.jsonl").read_text()
    lines = text.splitlines()
    (run / "metrics.jsonl").write_text("\n".join(lines[:6]) + "\n" + lines[6][: len(lines[6]) // 2])
    manifest = json.loads((run / "manifest.json").read_text())
    (run / "manifest.json").write_text(json.dumps({**manifest, "status": "running", "ended_at": None}))
    data = load_runs(run)
    assert data.runs["status"].tolist() == ["running"]
    assert len(data.metrics) == 6
    assert data.steps["step"].tolist() == [0, 1]
    assert data.steps.set_index("step").loc[1, "n_updates"] == 2


def test_a_diverged_run_loads_with_its_reason_and_its_nan_kept(runs_root):
    data = load_runs(runs_root / "diverged")
    run = data.runs.iloc[0]
    assert run["status"] == "diverged" and "non-finite" in run["reason"]
    last = data.metrics.iloc[-1]
    assert math.isnan(last["loss/total"]) and "loss/total" in last["nan_metrics"]
    # The step's mean is NaN too: a logged NaN is not averaged away with the finite minibatch before it.
    assert math.isnan(data.steps.set_index("step").loc[last["step"], "loss/total"])


def test_a_folder_of_links_reads_each_linked_sweep_once_even_through_a_loop(tmp_path):
    from moe_rl.analysis.load import find_runs

    for sweep in ("lr", "staleness"):
        for name in ("a", "b"):
            run = tmp_path / "sweeps" / sweep / "runs" / name
            run.mkdir(parents=True)
            (run / "config.json").write_text("{}")
            (run / "manifest.json").write_text("{}")
    both = tmp_path / "both"
    both.mkdir()
    for sweep in ("lr", "staleness"):
        (both / sweep).symlink_to(tmp_path / "sweeps" / sweep, target_is_directory=True)
    (both / "again").symlink_to(tmp_path / "sweeps" / "lr", target_is_directory=True)  # the same sweep twice
    (both / "lr" / "loop").symlink_to(both, target_is_directory=True)  # and a link back up
    found = [p.relative_to(both).as_posix() for p in find_runs(both)]
    assert len(found) == 4 and sorted(f.split("/", 1)[1] for f in found) == ["runs/a", "runs/a", "runs/b", "runs/b"]


def test_an_empty_folder_and_a_run_without_metrics_give_one_clear_message(tmp_path):
    with pytest.raises(NoRunsError, match="no RL runs under"):
        load_runs(tmp_path)
    RunDir(tmp_path / "fresh", tiny_train_config(tmp_path / "fresh"))  # started, no optimizer step yet
    with pytest.raises(NoRunsError, match="none has logged a metrics line yet"):
        load_runs(tmp_path)


# --- aggregation -------------------------------------------------------------------------------------------


def test_bootstrap_ci_is_reproducible_and_handles_one_value_constants_and_nan():
    values = [0.1, 0.4, 0.2, 0.9]
    low, high = bootstrap_ci(values)
    assert (low, high) == bootstrap_ci(values) and low < np.mean(values) < high
    assert all(math.isnan(v) for v in bootstrap_ci([0.3]))
    assert bootstrap_ci([0.5, 0.5, 0.5]) == (0.5, 0.5)
    assert bootstrap_ci([0.1, float("nan"), 0.4]) == bootstrap_ci([0.1, 0.4])
    assert iqm([1, 2, 3, 100]) == pytest.approx(2.5)


def test_t_ci_is_the_textbook_interval_and_covers_where_the_bootstrap_does_not():
    low, high = t_ci([1.0, 2.0, 3.0])  # mean 2, s 1, t(0.975, 2) = 4.3027
    assert (low, high) == pytest.approx((2 - 4.302653 / math.sqrt(3), 2 + 4.302653 / math.sqrt(3)), rel=1e-6)
    assert all(math.isnan(v) for v in t_ci([0.3])) and t_ci([0.5, 0.5, 0.5]) == (0.5, 0.5)
    assert t_ci([0.1, float("nan"), 0.4]) == t_ci([0.1, 0.4])
    # 3 seeds from a normal law: the t interval covers the true mean ~95% of the time, the percentile bootstrap
    # (what the reports used before) far less often.
    samples = np.random.default_rng(0).normal(0.5, 0.1, size=(300, 3))
    covered_t = np.mean([lo <= 0.5 <= hi for lo, hi in map(t_ci, samples)])
    covered_boot = np.mean([lo <= 0.5 <= hi for lo, hi in (bootstrap_ci(x, n_resamples=200) for x in samples)])
    assert 0.92 <= covered_t <= 0.98 and covered_boot < 0.8


def test_final_scores_equal_a_direct_pandas_computation(sweep):
    table = final_scores(sweep, ["reward", "routing/update/churn"], last_k=2).set_index(["group", "metric"])
    for metric in ("reward", "routing/update/churn"):
        rows = sweep.steps.dropna(subset=[metric]).sort_values("step")
        per_run = rows.groupby("run")[metric].apply(lambda s: s.iloc[-2:].mean())
        for group, runs in sweep.runs.groupby("group"):
            finals = per_run[runs["run"]]
            row = table.loc[(group, metric)]
            assert row["n_runs"] == 2 and row["n_diverged"] == 0
            assert row["mean"] == pytest.approx(finals.mean())
            assert row["std"] == pytest.approx(finals.std(), nan_ok=True)
            assert row["ci_low"] <= row["mean"] <= row["ci_high"]


def test_curves_and_layer_churn_equal_a_direct_pandas_computation(sweep):
    curve = mean_ci(sweep.metrics, "routing/update/churn", x="update").set_index(["group", "update"])
    direct = sweep.metrics.groupby(["group", "update"])["routing/update/churn"].agg(["mean", "count"])
    assert np.allclose(curve["mean"], direct.loc[curve.index, "mean"])
    assert (curve["n"] == direct.loc[curve.index, "count"]).all()

    table = layer_churn(sweep.routing).set_index(["group", "probe", "layer"])
    per_run = sweep.routing.groupby(["group", "probe", "layer", "run"])["churn"].mean()
    direct = per_run.groupby(["group", "probe", "layer"]).mean()
    assert np.allclose(table["mean"], direct.loc[table.index])
    assert (table.xs("noise", level="probe")["mean"] == 0).all()  # two identical forwards on CPU


def test_churn_vs_lr_depth_equals_a_direct_pandas_computation(runs_root):
    data = load_runs(runs_root / "scan")
    data = add_groups(data, group_keys(data))
    assert data.group_by == ["optim.lr", "model.n_layers"]
    table = churn_vs_lr_depth(data).set_index(["optim.lr", "model.n_layers"])
    keys = ["optim.lr", "model.n_layers"]
    means = data.metrics.groupby(keys)[["routing/update/churn", "routing/update/set_change",
                                        "routing/update/token_any"]].mean()
    medians = data.metrics.groupby(keys)["update/kl"].median()  # one run per cell: the run's median
    assert len(table) == 3
    assert np.allclose(table["churn_mean"], means.loc[table.index, "routing/update/churn"])
    assert np.allclose(table["set_change_mean"], means.loc[table.index, "routing/update/set_change"])
    assert np.allclose(table["token_any_mean"], means.loc[table.index, "routing/update/token_any"])
    assert np.allclose(table["kl_median_mean"], medians.loc[table.index])
    assert (table["set_change_mean"] >= table["churn_mean"]).all()  # a changed slot changes its set
    assert not table["learns"].any()  # one seed per cell: no CI, never "learns"


# --- the command, end to end ------------------------------------------------------------------------------


def _moe_rl(*args, cwd):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}  # this checkout's moe_rl
    return subprocess.run([sys.executable, "-m", "moe_rl.cli", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=120)


def test_report_writes_figures_tables_and_summary(runs_root, tmp_path):
    out = _moe_rl("report", str(runs_root), "--out", "results/tiny", "--last-k", "2", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    folder = tmp_path / "results" / "tiny"
    for name in FIGURES:
        png = folder / "figures" / f"{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000, name
        assert not (folder / "figures" / f"{name}.pdf").exists(), name  # PNG only unless a PDF is asked for
    runs = pd.read_csv(folder / "tables" / "runs.csv")
    assert len(runs) == 6 + 3 + 1 and (runs["status"] == "diverged").sum() == 1
    finals = pd.read_csv(folder / "tables" / "final_scores.csv")
    assert {"reward", "routing/update/churn"} <= set(finals["metric"])
    for table in ("layer_churn", "churn_vs_lr_depth", "curves", "per_run_final", "per_run_eval", "paired_comparisons"):
        assert len(pd.read_csv(folder / "tables" / f"{table}.csv")), table
    per_run = pd.read_csv(folder / "tables" / "per_run_final.csv")
    assert sorted(per_run["run"]) == sorted(runs["run"]) and {"eval_gain", "eval/reward", "churn"} <= set(per_run)
    assert not any(str(v).startswith("/") for column in runs for v in runs[column])  # no machine's paths
    assert (folder / runs.loc[runs["run"] == "diverged", "path"].item()).resolve() == runs_root / "diverged"
    cells = pd.read_csv(folder / "tables" / "churn_vs_lr_depth.csv")
    assert {"churn_mean", "set_change_mean", "token_any_mean", "kl_median_mean", "eval_gain_ci_low"} <= set(cells)
    readme = (folder / "README.md").read_text()
    assert "## Cells: churn in both readings" in readme and "## Churn scaling fit" in readme
    assert "| slot churn | set change | token any |" in readme
    assert "stability: routing/rollout/churn (0 or not logged in every run)" in readme  # left out, and said so
    assert f"moe-rl report {runs_root} --out results/tiny --last-k 2" in readme
    assert "`objective.name`, `routing_mode`" in readme and '"grid"' not in readme  # root has no sweep.json
    assert "1 diverged" in readme


def test_coinciding_groups_are_named_in_the_legend(runs_root, tmp_path):
    from moe_rl.analysis.plots import fig_comparison, looks_for

    shutil.copytree(runs_root / "sweep" / "runs", tmp_path / "runs")
    for seed in (0, 1):  # an R3 group identical to R2, as on CPU
        copy = tmp_path / "runs" / f"grpo_r3_s{seed}"
        shutil.copytree(tmp_path / "runs" / f"grpo_r2_s{seed}", copy)
        config = json.loads((copy / "config.json").read_text())
        (copy / "config.json").write_text(json.dumps({**config, "routing_mode": "R3"}))
    data = load_runs(tmp_path / "runs")
    data = add_groups(data, group_keys(data))
    fig = fig_comparison(data, looks_for(data))
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert "grpo R3 (coincides with grpo R2)" in labels and "grpo R2" in labels
    title = fig.legends[0].get_title().get_text()  # these runs are shorter than 15 steps: drawn raw, with bands
    assert "rolling mean" not in title and "bands: 95% CI over seeds" in title


def test_final_evaluation_is_the_one_after_training(sweep):
    # Evaluations at steps 0 (before RL), 2 and 3 (after the last training step, 2); last_k=1: the window is
    # step 2, so only the evaluation at step 3 counts.
    finals = run_finals(sweep.steps, "eval/reward", last_k=1)
    for run, steps in sweep.steps.groupby("run"):
        evals = steps.dropna(subset=["eval/reward"]).set_index("step")["eval/reward"]
        assert list(evals.index) == [0, 2, 3]
        assert finals[run] == evals[3]
        assert run_finals(sweep.steps, "eval/reward", last_k=2)[run] == pytest.approx(evals[[2, 3]].mean())


def test_summary_names_the_command_and_the_sweep_config(sweep, runs_root):
    cfg = ReportConfig(runs=str(runs_root / "sweep"), out="results/x", group_by=("objective.name", "routing_mode"))
    text = summary_markdown(sweep, cfg, final_scores(sweep, ["reward"]), list(FIGURES))
    assert f"moe-rl report {runs_root / 'sweep'} --out results/x --group-by objective.name routing_mode" in text
    assert '"grid": [' in text  # sweep.json, verbatim
    assert '"optim.lr": 0.0003' in text  # the shared config
    assert all(f"figures/{name}.png" in text for name in FIGURES)


def test_report_help_and_bad_input(tmp_path):
    help_ = _moe_rl("report", "--help", cwd=tmp_path)
    assert help_.returncode == 0 and "--group-by" in help_.stdout and "--last-k" in help_.stdout
    empty = _moe_rl("report", str(tmp_path), "--out", str(tmp_path / "out"), cwd=tmp_path)
    assert empty.returncode == 2
    assert "no RL runs under" in empty.stderr and "Traceback" not in empty.stderr
    assert len(empty.stderr.strip().splitlines()) == 1


def test_churn_scaling_figures_only_for_learning_rate_sweeps(sweep, runs_root):
    from moe_rl.analysis.churn_figures import fig_churn_layer_profile, fig_churn_scaling, run_churn

    assert fig_churn_scaling(sweep) is None and fig_churn_layer_profile(sweep) is None  # one lr: nothing to draw
    scan = load_runs(runs_root / "scan")
    assert fig_churn_scaling(scan) is not None and fig_churn_layer_profile(scan) is not None
    per_run = run_churn(scan).set_index("run")
    direct = scan.metrics.groupby("run")["routing/update/churn"].mean()
    pd.testing.assert_series_equal(per_run["routing/update/churn"], direct, check_names=False)


def test_report_with_a_baseline_puts_it_first_and_compares_each_group_with_it(runs_root, tmp_path, monkeypatch):
    import moe_rl.analysis.report
    from moe_rl.analysis.report import report

    # figures are tested above; they take 20 s here
    monkeypatch.setattr(moe_rl.analysis.report, "write_figures", lambda data, folder: ([], []))

    result = {"checkpoint": "c.pt", "step": 300, "best_temperature": 0.5,
              "heldout": {"sampled": {"temperature": 0.5, "mean": 0.25, "se": 0.02, "prompts": 1024, "samples": 1},
                          "greedy": {"mean": 0.3, "se": 0.014, "prompts": 1024, "samples": 1}}}
    (tmp_path / "evaluate.json").write_text(json.dumps(result))
    out = report(ReportConfig(str(runs_root), out=str(tmp_path / "report"), last_k=2,
                              baseline=str(tmp_path / "evaluate.json")))
    learning = pd.read_csv(out / "tables" / "learning.csv")
    assert learning.loc[0, "group"] == "warm start (T=0.5, best on validation)" and learning.loc[0, "final"] == 0.25
    assert learning["baseline_se"].notna().sum() == 1
    against = pd.read_csv(out / "tables" / "against_baseline.csv")
    per_run = pd.read_csv(out / "tables" / "per_run_final.csv")
    sampled = against[(against["decoding"] == "sampled") & (against["n_runs"] > 0)]
    assert len(sampled) >= 2  # groups whose runs logged no held-out reward have n_runs 0 and no difference
    first = sampled.iloc[0]
    finals = per_run.loc[per_run["group"] == first["group"], "eval/reward"].dropna()
    assert first["diff"] == pytest.approx(finals.mean() - 0.25) and first["n_runs"] == len(finals)
    readme = (out / "README.md").read_text()
    assert "## Against the warm start's best" in readme and "0.250 +- 0.020" in readme
    assert "0.250 +- 0.020 (baseline)" in readme  # the learning table's first row
    assert f"--baseline {tmp_path / 'evaluate.json'}" in readme


def test_fields_unset_in_some_runs_or_added_since_others_ran_group_correctly(tmp_path):
    """Two kinds of missing config value: a field set to None in some runs (a correction's cap where another run has
    a band) is a value of its own, so TIS and IcePop runs fall in different groups, and its label part is left out;
    a field absent from an older run's config.json (added to moe-rl since) reads as its default, so it does not
    split runs made before and after the addition."""
    from moe_rl.analysis.aggregate import group_label
    from moe_rl.analysis.load import distinct_values

    assert distinct_values(pd.Series([2.0, None, None])) == 2 and distinct_values(pd.Series([None, None])) == 1
    assert group_label({"routing_mode": "native", "correction.is_cap": float("nan"),
                        "correction.is_band": "[0.5, 2.0]"}, ["routing_mode", "correction.is_cap",
                                                              "correction.is_band"]) == "native is_band=[0.5, 2.0]"
    from moe_rl.runs.runlog import config_to_dict

    for name, cap, drop in (("tis", 2.0, False), ("plain", None, True), ("plain_new", None, False)):
        cfg = tiny_train_config(tmp_path / name, total_steps=1)
        data = json.loads(json.dumps(config_to_dict(cfg)))
        data["correction"]["is_cap"], data["correction"]["is_level"] = cap, "token" if cap else "none"
        if drop:
            del data["model"]["init_depth"]  # as written before the field existed
        Path(cfg.out_dir).mkdir(parents=True)
        (Path(cfg.out_dir) / "config.json").write_text(json.dumps(data))
        (Path(cfg.out_dir) / "metrics.jsonl").write_text(json.dumps(
            {"step": 0, "wall_time": 1.0, "minibatch": 0, "update": 1, "loss": 0.1}) + "\n")
    data = load_runs(tmp_path)
    assert "model.init_depth" not in data.varying() and "correction.is_cap" in data.varying()
    assert set(data.runs["model.init_depth"]) == {0}


def test_a_baseline_path_without_evaluate_json_is_named(tmp_path):
    with pytest.raises(ConfigError, match="baseline=.*no evaluate.json there"):
        ReportConfig(str(tmp_path), baseline=str(tmp_path / "missing"))


def test_a_sweep_whose_routing_never_moves_has_no_scaling_fit_and_no_error():
    """A dense twin's runs (one expert) read churn 0 everywhere: the report leaves the churn law out instead of
    failing on a fit with no usable run."""
    from moe_rl.analysis.report import scaling_tables

    runs = pd.DataFrame({"run": ["a", "b", "c", "d"], "status": "finished"})
    summary = pd.DataFrame({"run": ["a", "b", "c", "d"], "group": "g", "optim.lr": [1e-4, 1e-4, 4e-4, 4e-4],
                            "churn": 0.0, "set_change": 0.0, "token_any": 0.0, "kl_median": [1e-3, 2e-3, 5e-3, 6e-3],
                            "model.n_layers": 4, "model.n_experts": 1, "model.top_k": 1})
    cells = pd.DataFrame({"group": ["g"], "learns": [True]})
    data = type("RunSetLike", (), {"runs": runs})()
    assert scaling_tables(data, cells, summary) == {}
