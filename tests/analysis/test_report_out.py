"""`moe-rl report --out` owns what it writes (issue 50, items 2 and 12): a README.md it did not write is refused,
two reports into one folder leave one whole report, a planned sweep run without a directory and a run whose metric
is never finite are named. Figures are left out (tested in test_analysis.py; 20 s each)."""

import json
import math
from pathlib import Path

import pandas as pd
import pytest
from conftest import cli, tiny_train_config

import moe_rl.analysis.report
from moe_rl.analysis.report import ReportConfig, report
from moe_rl.commands.train import train


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> Path:
    """A sweep folder: sweep.json plans runs a, b and c; a and b ran (2 steps), c has no directory."""
    root = tmp_path_factory.mktemp("report_out") / "sweep"
    for seed, name in enumerate("ab"):
        train(tiny_train_config(root / "runs" / name, total_steps=2, seed=seed))
    plan = {"experiment": "tiny", "grid": {"seed": [0, 1, 2]}, "runs": [{"name": n} for n in "abc"]}
    (root / "sweep.json").write_text(json.dumps(plan))
    return root


@pytest.fixture(autouse=True)
def no_figures(monkeypatch):
    monkeypatch.setattr(moe_rl.analysis.report, "write_figures", lambda data, folder: ([], []))


def test_a_readme_the_report_did_not_write_is_refused_and_kept(sweep, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "README.md").write_text("# My notes\n\nnot a report\n")
    code, _, err = cli("report", sweep, "--out", out)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"{out / 'README.md'} was not written by moe-rl report" in err
    assert [p.name for p in out.iterdir()] == ["README.md"] and "My notes" in (out / "README.md").read_text()


def test_a_tables_folder_without_a_report_readme_is_refused(sweep, tmp_path):
    (tmp_path / "out" / "tables").mkdir(parents=True)
    (tmp_path / "out" / "tables" / "mine.csv").write_text("a,b\n1,2\n")
    code, _, err = cli("report", sweep, "--out", tmp_path / "out")
    assert code == 2 and "holds tables/ but no report README.md" in err, err
    assert sorted(p.name for p in (tmp_path / "out").rglob("*")) == ["mine.csv", "tables"]


def test_a_report_replaces_its_own_report_and_leaves_other_files(sweep, tmp_path):
    out = tmp_path / "out"
    code, _, err = cli("report", sweep, "--out", out)
    assert code == 0, err
    (out / "baseline").mkdir()  # e.g. the warm start's evaluate output, kept beside the report
    (out / "baseline" / "evaluate.json").write_text("{}")
    code, _, err = cli("report", sweep, "--out", out, "--last-k", "1")
    assert code == 0, err
    assert "--last-k 1" in (out / "README.md").read_text() and (out / "baseline" / "evaluate.json").exists()
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "baseline", "figures", "tables"]


def test_two_reports_into_one_folder_at_once_leave_one_whole_report(sweep, tmp_path, monkeypatch):
    """The second report runs while the first makes its figures: before, the folder ended with the first's README
    and the second's tables."""
    out = tmp_path / "out"
    nested = []

    def figures_then_another_report(data, folder):
        if not nested:
            nested.append("second")
            report(ReportConfig(str(sweep), out=str(out), group_by=("seed",)))
        return [], []

    monkeypatch.setattr(moe_rl.analysis.report, "write_figures", figures_then_another_report)
    report(ReportConfig(str(sweep), out=str(out), group_by=("optim.lr",)))
    readme = (out / "README.md").read_text()
    groups = set(pd.read_csv(out / "tables" / "runs.csv")["group"])
    assert "--group-by optim.lr" in readme and groups == {"lr=0.0003"}, (readme[:300], groups)
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "figures", "tables"]  # no temporary folder left


def test_a_missing_planned_run_and_a_never_finite_metric_are_named(sweep, tmp_path):
    root = tmp_path / "sweep"
    import shutil

    shutil.copytree(sweep, root)
    metrics = root / "runs" / "b" / "metrics.jsonl"
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    metrics.write_text("".join(json.dumps({**line, "reward": math.nan}) + "\n" for line in lines))
    code, stdout, err = cli("report", root, "--out", tmp_path / "out")
    assert code == 0, err
    readme = (tmp_path / "out" / "README.md").read_text()
    assert "Missing: 1 run(s) that sweep.json plans have no run directory under runs/ (not started, or deleted): c." \
        in readme
    assert "Left out of `reward` (no finite value in the window; n_runs counts the others): runs/b." in readme
    assert "note: 1 planned run(s) of the sweep have no run directory (c)" in stdout
    assert "note: reward has no finite value in runs/b, left out of its scores" in stdout
