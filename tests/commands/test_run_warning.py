"""The run's early warning (`--log.warn-threshold`, moe_rl/runs/warning.py): one line and a manifest entry the first
time the watched metric reaches the threshold, and not one number of the run changed by it. Tiny `moe-rl train`
runs through the entry point, in this process (about a second each)."""

from __future__ import annotations

import json

from conftest import cli

from moe_rl.rl.run_config import LogConfig, TrainConfig
from moe_rl.runs.runlog import config_to_dict
from moe_rl.runs.warning import EarlyWarning, warning_line
from moe_rl.sweep.plan import stable_config

TINY = ["--model.d-model", "32", "--model.n-layers", "2", "--model.n-heads", "4", "--model.n-kv-heads", "2",
        "--model.n-experts", "4", "--model.top-k", "2", "--model.d-expert", "32", "--model.d-dense", "64"]
TRAIN = ["train", *TINY, "--rollout.prompts-per-step", "4", "--rollout.group-size", "4", "--minibatches", "2",
         "--rollout.sampling.max-new-tokens", "4", "--total-steps", "3", "--optim.lr", "3e-3", "--quiet"]


def lines_of(run) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def without_time(lines: list[dict]) -> list[dict]:
    return [{k: v for k, v in line.items() if k != "wall_time" and not k.startswith("time/")} for line in lines]


def first_rise(lines: list[dict], metric: str) -> dict:
    """The first line after step 0 whose metric exceeds every value of step 0 (else step 0's largest): the line a
    threshold at its value fires on first."""
    opening = max(line[metric] for line in lines if line["step"] == 0)
    later = [line for line in lines if line["step"] > 0 and line.get(metric, -1.0) > opening]
    return later[0] if later else next(line for line in lines if line.get(metric) == opening)


def test_the_warning_fires_once_at_the_first_crossing_and_changes_no_number(tmp_path):
    off = tmp_path / "off"
    code, out, err = cli(*TRAIN, "--out-dir", off)
    assert code == 0 and "early warning" not in out + err, err
    expected = first_rise(lines_of(off), "grad_norm")

    on = tmp_path / "on"
    code, out, err = cli(*TRAIN, "--out-dir", on, "--log.warn-metric", "grad_norm", "--log.warn-threshold",
                         repr(expected["grad_norm"]))
    assert code == 0, err
    event = {"metric": "grad_norm", "value": expected["grad_norm"], "threshold": expected["grad_norm"],
             "step": expected["step"], "update": expected["update"]}
    assert [line for line in err.splitlines() if line.strip()] == [warning_line(event)]  # printed under --quiet
    assert json.loads((on / "manifest.json").read_text())["early_warning"] == event
    assert "early_warning" not in json.loads((off / "manifest.json").read_text())
    assert without_time(lines_of(on)) == without_time(lines_of(off))


def test_a_metric_never_logged_is_said_once_and_never_fires(tmp_path):
    code, _, err = cli(*TRAIN, "--out-dir", tmp_path / "run", "--log.warn-metric", "routing/update/chrun",
                       "--log.warn-threshold", "0")
    assert code == 0
    said = [line for line in err.splitlines() if line.strip()]
    assert len(said) == 1 and "'routing/update/chrun' (log.warn_metric) is not among the metrics" in said[0]
    assert "early_warning" not in json.loads((tmp_path / "run" / "manifest.json").read_text())


def test_the_watcher_fires_on_the_first_line_at_or_above_and_only_once():
    lines = [{"step": 0, "update": 0, "x": 0.1}, {"step": 0, "update": 1, "x": float("nan")},
             {"step": 1, "update": 2, "x": 0.3}, {"step": 1, "update": 3, "x": 0.5}]
    watcher = EarlyWarning("x", 0.3)
    assert watcher.check(lines[:2]) is None
    assert watcher.check(lines[2:]) == {"metric": "x", "value": 0.3, "threshold": 0.3, "step": 1, "update": 2}
    assert watcher.check(lines[2:]) is None  # once per run
    assert EarlyWarning("x", None).check(lines) is None  # off
    assert EarlyWarning("x", 0.3, fired=True).check(lines) is None  # warned before a resume


def test_a_sweep_reads_a_grid_with_the_warning_on_as_the_same_grid():
    """The warning changes no number, so like the W&B fields it is left out of the grid hash (moe_rl/sweep/plan.py):
    a sweep re-run with --set log.warn_threshold=... continues its runs, and existing sweeps keep their hashes."""
    on = TrainConfig(log=LogConfig(warn_threshold=0.02, warn_metric="grad_norm"))
    assert stable_config(config_to_dict(on)) == stable_config(config_to_dict(TrainConfig()))
