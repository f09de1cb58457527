"""`moe-rl sweep --grid` / `--grid-file`: an ad-hoc experiment from the command line or a YAML file, without
touching the package: its plan (names, configs, directory), its one-line errors, and a tiny real grid that runs
and is skipped when the same command runs again."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from moe_rl.cli import main
from moe_rl.rl.run_config import TrainConfig
from moe_rl.sweep.adhoc import adhoc_experiment, adhoc_sweep_dir, grid_axes
from moe_rl.sweep.command import plan_sweep

TINY_SETS = ["model.d_model=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.n_experts=4",
             "model.top_k=2", "model.d_expert=32", "model.d_dense=64", "total_steps=1", "rollout.prompts_per_step=4",
             "rollout.group_size=4", "minibatches=2", "rollout.sampling.max_new_tokens=4", "log.samples_every=0"]


def test_a_2x2_grid_plans_4_named_runs_with_their_configs(tmp_path):
    axes = grid_axes({"objective.name": "grpo,gspo", "seed": "0,1"}, None)
    assert axes == {"objective.name": ["grpo", "gspo"], "seed": [0, 1]}  # typed by the fields
    plan = plan_sweep(adhoc_experiment(axes), tmp_path / "s", {}, {"optim.lr": "3e-4"})
    runs = {run.name: run.config for run in plan.runs}
    assert list(runs) == ["obj=grpo,seed=0", "obj=grpo,seed=1", "obj=gspo,seed=0", "obj=gspo,seed=1"]
    for name, config in runs.items():
        objective, seed = name.removeprefix("obj=").split(",seed=")
        assert (config.objective.name, config.seed, config.optim.lr) == (objective, int(seed), 3e-4)
        assert config.out_dir == str(tmp_path / "s" / "runs" / name)
        # Everything else is train's defaults.
        assert config.total_steps == TrainConfig().total_steps and config.model == TrainConfig().model
    assert plan.warmstarts == {}
    plan.grid = axes
    assert plan.command() == "moe-rl sweep --grid objective.name=grpo,gspo seed=0,1 --set optim.lr=0.0003"


def test_dry_run_prints_the_plan_and_writes_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["sweep", "--grid", "objective.name=grpo,gspo", "seed=0,1", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert f"-> {tmp_path / 'sweeps' / 'grid_obj_grpo+gspo_seed_0+1'} (new)" in out
    assert "runs (4): 4 start" in out and "obj=gspo,seed=1" in out and "dry run: nothing was run" in out
    assert not (tmp_path / "sweeps").exists()


def test_a_yaml_grid_file_is_the_same_grid(tmp_path):
    (tmp_path / "grid.yaml").write_text("objective.name: [grpo, gspo]\n--optim.warmup-steps: 3\n")
    from_file = grid_axes({"seed": "0,1"}, str(tmp_path / "grid.yaml"))
    assert from_file == {"seed": [0, 1], "objective.name": ["grpo", "gspo"], "optim.warmup_steps": [3]}
    assert adhoc_sweep_dir(from_file) == Path("sweeps/grid_seed_0+1_obj_grpo+gspo_warmup_3")


@pytest.mark.parametrize(("argv", "message"), [
    (["--grid", "optim.lrr=1e-4,3e-4"], "--grid 'optim.lrr' is not a field of TrainConfig; did you mean optim.lr"),
    (["--grid", "routing_mode=R2,R4"], "routing_mode='R4' is not valid"),
    (["--grid", "seed=0,0"], "--grid seed: a value is given twice"),
    (["--grid", "seed="], "--grid seed: an empty value"),
    (["smoke", "--grid", "seed=0,1"], "give them without an experiment name"),
    (["--grid-file", "missing.yaml"], "--grid-file missing.yaml: cannot be read"),
])
def test_a_bad_grid_is_one_line_naming_it(tmp_path, capsys, monkeypatch, argv, message):
    monkeypatch.chdir(tmp_path)
    assert main(["sweep", *argv, "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err


def test_too_long_a_grid_name_ends_with_its_hash():
    axes = {"optim.lr": [1e-5 * i for i in range(1, 40)]}
    name = adhoc_sweep_dir(axes).name
    assert len(name) == 120 and name.startswith("grid_lr_1e-5+2e-5") and name != adhoc_sweep_dir(
        {"optim.lr": [1e-5 * i for i in range(1, 41)]}).name


@pytest.mark.slow
def test_a_tiny_grid_runs_and_the_same_command_skips_it(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    argv = [sys.executable, "-m", "moe_rl.cli", "sweep", "--grid", "objective.name=grpo,gspo", "--set", *TINY_SETS]
    done = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert "summary: 2 finished" in done.stdout
    sweep = tmp_path / "sweeps" / "grid_obj_grpo+gspo"
    for name in ("obj=grpo", "obj=gspo"):
        assert (sweep / "runs" / name / "checkpoints" / "latest.pt").exists()
    again = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr
    assert "(continuing)" in again.stdout and "runs (2): 2 skip" in again.stdout
