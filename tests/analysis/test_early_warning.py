"""The early-warning analysis (analysis/early_warning.py) on synthetic run directories whose collapse steps, signal
peaks and therefore thresholds, precision, recall and lead times are worked out by hand below.

Every run: 15 rollout steps of 2 optimizer steps, held-out evaluations at steps 0, 5, 10 and 15 with SE 0.01, so the
decline floor is sqrt(0.01^2 + 0.01^2 / 3) = 0.011547 and the decline line start - 0.023094 = 0.476906 for a start of
0.5. `routing/update/set_change` is 0.05 on every line except one spike per run, on minibatch 1 of one step;
`grad_norm` is 1.0 on every line.

    run   seed half  evaluations              label (collapse step)     set-change spike
    a     0    fit   0.5 0.49 0.2 0.1         declined (10: 0.49 is above the line)   0.30 at step 2
    b     2    fit   0.5 0.3 0.1 0.1          declined (5)              0.20 at step 4
    c     4    fit   0.5 0.5 0.52 0.55        learned                   0.10 at step 1
    d     6    fit   0.5 0.5 0.5 0.5          neither                   0.25 at step 3
    e     1    test  0.5 0.49 0.2 0.1         declined (10)             0.22 at step 3
    f     3    test  0.5 0.3 0.1 0.1          declined (5)              0.15 at step 2
    g     5    test  0.5 0.5 0.5 0.5          neither                   0.21 at step 0
    h     7    test  0.5 0.5 0.5 0.5          neither                   0.10 at step 1
    i     9    test  diverged on step 3's second update (collapse step 3)   0.50 at step 3
    j     11   test  running: left out (not a result)

Set change on the fit half (K = 5, min lead 1): at T = 0.30 one hit (a) in one alarm, F1 2/3; at 0.25 one hit in
two alarms, 1/2; at 0.20 two hits in three alarms, 4/5; at 0.10 two in four, 2/3: the threshold is 0.20. On the test
half at 0.20: alarms e, g, i; hits e alone (i's alarm at step 3 is its collapse step: lead 0); collapsed e, f, i:
precision 1/3, recall 1/3, F1 1/3, lead 10 - 3 = 7. Grad norm is 1.0 everywhere: threshold 1.0, every test run of
the window alarms (5), and every collapsed one in time (e, f, and i at steps 0-2): precision 3/5, recall 3/3, F1
0.75, so no routing signal beats grad norm here.
"""

from __future__ import annotations

import json
import math

import pandas as pd
import pytest

from moe_rl.analysis.early_warning import (
    collapse_labels,
    early_warning_tables,
    fit_threshold,
    half_of,
    load_frames,
    verdict,
    wilson,
)
from moe_rl.cli import main

STEPS, MINIBATCHES, SE = 15, 2, 0.01
RUNS = {  # name: (seed, status, evaluations at 0/5/10/15, set-change spike (step, value), last step)
    "a": (0, "finished", [0.5, 0.49, 0.2, 0.1], (2, 0.30), None),
    "b": (2, "finished", [0.5, 0.3, 0.1, 0.1], (4, 0.20), None),
    "c": (4, "finished", [0.5, 0.5, 0.52, 0.55], (1, 0.10), None),
    "d": (6, "finished", [0.5, 0.5, 0.5, 0.5], (3, 0.25), None),
    "e": (1, "finished", [0.5, 0.49, 0.2, 0.1], (3, 0.22), None),
    "f": (3, "finished", [0.5, 0.3, 0.1, 0.1], (2, 0.15), None),
    "g": (5, "finished", [0.5, 0.5, 0.5, 0.5], (0, 0.21), None),
    "h": (7, "finished", [0.5, 0.5, 0.5, 0.5], (1, 0.10), None),
    "i": (9, "diverged", [0.5], (3, 0.50), 3),
    "j": (11, "running", [0.5, 0.1], (0, 0.90), 6),
}


def metrics_lines(evals, spike, last_step) -> list[dict]:
    """One line per optimizer step; evaluations ride on the first line of steps 0, 5, 10 and on a final line."""
    lines = []
    for step in range(STEPS if last_step is None else last_step + 1):
        for j in range(MINIBATCHES):
            line = {"step": step, "minibatch": j, "update": MINIBATCHES * step + j, "wall_time": 0.0, "reward": 0.5,
                    "grad_norm": 1.0, "routing/update/set_change": spike[1] if (step, j) == (spike[0], 1) else 0.05}
            if j == 0 and step % 5 == 0 and step // 5 < len(evals):
                line.update({"eval/reward": evals[step // 5], "eval/reward_se": SE})
            lines.append(line)
    if last_step is None:
        lines.append({"step": STEPS, "minibatch": -1, "update": MINIBATCHES * STEPS, "wall_time": 0.0,
                      "eval/reward": evals[-1], "eval/reward_se": SE})
    return lines


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    root = tmp_path_factory.mktemp("early_warning") / "sweep"
    for name, (seed, status, evals, spike, last_step) in RUNS.items():
        run = root / "runs" / name
        run.mkdir(parents=True)
        config = {"seed": seed, "routing_mode": "native", "optim": {"lr": 8e-4}, "log": {"eval_every": 5}}
        (run / "config.json").write_text(json.dumps(config))
        (run / "manifest.json").write_text(json.dumps({"status": status, "seed": seed}))
        lines = metrics_lines(evals, spike, last_step)
        (run / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return root


@pytest.fixture(scope="module")
def readings(sweep):
    runs, metrics, steps = load_frames((str(sweep),))
    labels = collapse_labels(runs, steps)
    table, per_run = early_warning_tables(metrics, labels, first_steps=5, min_lead=1)
    return labels.set_index("run"), table.set_index("signal"), per_run


def test_labels_follow_the_decline_rule_and_the_collapse_step_is_the_first_evaluation_below_its_line(readings):
    labels = readings[0]
    assert sorted(labels.index) == [f"runs/{n}" for n in "abcdefghi"]  # j is still running
    collapsed = labels[labels["collapsed"]]
    assert sorted(collapsed.index) == ["runs/a", "runs/b", "runs/e", "runs/f", "runs/i"]
    assert collapsed["collapse_step"].to_dict() == {"runs/a": 10, "runs/b": 5, "runs/e": 10, "runs/f": 5, "runs/i": 3}
    assert labels.loc["runs/a", "floor"] == pytest.approx(math.sqrt(SE**2 + SE**2 / 3))
    assert labels["half"].to_dict() == {f"runs/{n}": "fit" if n in "abcd" else "test" for n in "abcdefghi"}
    assert labels.loc[~labels["collapsed"], "collapse_step"].isna().all()


def test_a_diverged_run_collapses_at_its_first_evaluation_below_the_line_if_that_came_first():
    # x evaluated below its decline line from step 5 on and diverged on step 17; y diverged on step 17 with only
    # its step-0 evaluation, so it has no decline line
    evals = [0.5, 0.3, 0.1, 0.1]
    runs = pd.DataFrame({"run": ["x", "y"], "seed": [0, 1], "status": ["diverged", "diverged"]})
    steps = pd.DataFrame([{"run": run, "step": step, "eval/reward": evals[step // 5] if step % 5 == 0 and
                           (run == "x" or step == 0) else math.nan, "eval/reward_se": SE}
                          for run in ("x", "y") for step in range(18)])
    labels = collapse_labels(runs, steps).set_index("run")
    assert labels["collapsed"].all() and labels["collapse_step"].to_dict() == {"x": 5, "y": 17}


def test_the_threshold_is_fitted_on_even_seeds_and_read_on_odd_ones(readings):
    row = readings[1].loc["set change"]
    assert row["threshold"] == pytest.approx(0.20)
    assert (row["fit_runs"], row["fit_collapsed"], row["fit_alarms"], row["fit_hits"]) == (4, 2, 3, 2)
    assert row["fit_f1"] == pytest.approx(0.8)
    assert (row["test_runs"], row["test_collapsed"], row["test_alarms"], row["test_hits"]) == (5, 3, 3, 1)
    assert row["precision"] == pytest.approx(1 / 3) and row["recall"] == pytest.approx(1 / 3)
    assert row["f1"] == pytest.approx(1 / 3)
    assert (row["precision_ci_low"], row["precision_ci_high"]) == pytest.approx(wilson_by_hand(1, 3))
    assert (row["lead_median"], row["lead_min"], row["lead_max"]) == (7, 7, 7)


def test_lead_times_and_hits_per_run_at_the_fitted_threshold(readings):
    per_run = readings[2]
    rows = per_run[per_run["signal"] == "set change"].set_index("run")
    assert rows.loc["runs/a", "alarm_step"] == 2 and rows.loc["runs/a", "lead"] == 8 and rows.loc["runs/a", "hit"]
    assert rows.loc["runs/b", "alarm_step"] == 4 and rows.loc["runs/b", "lead"] == 1 and rows.loc["runs/b", "hit"]
    assert rows.loc["runs/i", "alarm_step"] == 3 and rows.loc["runs/i", "lead"] == 0 and not rows.loc["runs/i", "hit"]
    assert rows.loc["runs/g", "alarm_step"] == 0 and not rows.loc["runs/g", "collapsed"]
    assert math.isnan(rows.loc["runs/f", "alarm_step"]) and math.isnan(rows.loc["runs/h", "alarm_step"])


def test_grad_norm_is_the_bar_and_the_verdict_says_when_nothing_beats_it(readings):
    table = readings[1]
    grad = table.loc["grad norm"]
    assert grad["threshold"] == 1.0
    assert (grad["test_alarms"], grad["test_hits"], grad["test_collapsed"]) == (5, 3, 3)
    assert grad["f1"] == pytest.approx(0.75) and grad["recall"] == 1.0
    assert list(table.index) == ["set change", "grad norm"]  # only the signals some run logged
    assert verdict(table.reset_index()) == "no signal beats grad norm on the test half (grad norm F1 0.75)"
    better = table.reset_index().assign(f1=[0.9, 0.75])
    assert verdict(better) == "best on the test half: set change (F1 0.90) against grad norm's 0.75"
    confound = pd.concat([better, pd.DataFrame({"signal": ["learning rate"], "f1": [0.95]})], ignore_index=True)
    assert verdict(confound) == ("best on the test half: set change (F1 0.90) against grad norm's 0.75; the "
                                 "learning rate alone: F1 0.95")  # the confound is never the best signal


def test_a_tie_in_f1_goes_to_the_higher_threshold_and_no_collapse_gives_none():
    # T = 0.5: 1 hit in 1 alarm of 2 collapsed, F1 2/3; T = 0.2: 2 hits in 4 alarms, F1 4/6 = 2/3 as well.
    fit = pd.DataFrame({"collapsed": [True, False, False, True], "peak": [0.5, 0.4, 0.3, 0.2],
                        "peak_in_time": [0.5, math.nan, math.nan, 0.2]})
    assert fit_threshold(fit) == 0.5
    assert math.isnan(fit_threshold(fit.assign(collapsed=False)))


def test_wilson_matches_its_formula_and_the_split_rule_is_seed_parity():
    for k, n in ((0, 4), (1, 3), (5, 5), (7, 20)):
        assert wilson(k, n) == pytest.approx(wilson_by_hand(k, n))
    assert all(math.isnan(v) for v in wilson(0, 0))
    assert [half_of(s) for s in (0, 1, 2, 3)] == ["fit", "test", "fit", "test"]


def wilson_by_hand(k: int, n: int, z: float = 1.959963984540054) -> tuple[float, float]:
    p = k / n
    centre, spread = (p + z * z / (2 * n)) / (1 + z * z / n), z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return centre - spread / (1 + z * z / n), centre + spread / (1 + z * z / n)


def test_the_command_writes_both_tables_and_the_figure_and_prints_the_verdict(sweep, tmp_path, capsys):
    out = tmp_path / "ew"
    assert main(["early-warning", str(sweep), "--out", str(out), "--first-steps", "5"]) == 0
    printed = capsys.readouterr().out
    assert "9 judged runs; collapsed 2/4 (fit, even seeds), 3/5 (test, odd seeds)" in printed
    assert "(alarming on every test run: precision 3/5, recall 1, F1 0.75)" in printed
    assert printed.rstrip().endswith(f"no signal beats grad norm on the test half (grad norm F1 0.75) -> {out}")
    table = pd.read_csv(out / "early_warning.csv")
    assert table.set_index("signal").loc["set change", "threshold"] == pytest.approx(0.2)
    runs = pd.read_csv(out / "early_warning_runs.csv")
    assert len(runs) == 2 * 9 and set(runs["optim.lr"]) == {8e-4}
    assert (out / "figures" / "early_warning.png").stat().st_size > 0


def test_a_bad_command_line_is_one_line(tmp_path, capsys):
    assert main(["early-warning", "--out", str(tmp_path)]) == 2
    assert "give one or more run folders" in capsys.readouterr().err
