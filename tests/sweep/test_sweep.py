"""Sweeps: grid expansion and names, the plan and its hash, local workers with failures and re-runs, the submitit
path with a requeue that resumes from a checkpoint, bad input, and the `smoke` experiment end to end."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import metric_lines, tiny_train_config

from moe_rl.errors import ConfigError
from moe_rl.experiments import get_experiment
from moe_rl.model import ModelConfig
from moe_rl.rl.overrides import coerce, from_dict, with_overrides
from moe_rl.rl.run_config import OptimConfig, SFTConfig, SFTLogConfig
from moe_rl.runs.runlog import config_to_dict, read_manifest
from moe_rl.sweep.command import plan_sweep, print_plan
from moe_rl.sweep.grid import Experiment, axis, format_value, product, run_name, union
from moe_rl.sweep.jobs import execute_job, run_local
from moe_rl.sweep.plan import grid_hash
from moe_rl.sweep.sweepdir import planned_action, read_index, read_record, run_action, store_plan

TINY = dict(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, n_experts=4, top_k=2, d_expert=32, d_dense=64)


def experiment(grid, *, warm=False, labels=None, **overrides):
    """An experiment function over the tiny test model: `grid` points, optionally warm started by 5 SFT steps."""
    def tiny() -> Experiment:
        base = tiny_train_config("unused", **{"total_steps": 2, "checkpoint_every": 1, "model": ModelConfig(**TINY),
                                              **overrides})
        warmstart = SFTConfig(total_steps=5, batch_size=8, log=SFTLogConfig(eval_every=5, eval_prompts=4),
                              model=ModelConfig(**TINY))
        return Experiment(base, grid, warmstart=warmstart if warm else None, labels=labels or {})

    return tiny


def moe_rl(*args, cwd):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    return subprocess.run([sys.executable, "-m", "moe_rl.cli", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


# --- grids and names --------------------------------------------------------------------------------------------


def test_grid_expansion_gives_readable_stable_names_in_order(tmp_path):
    grid = product(axis("objective.name", ["grpo", "gspo"]), axis("routing_mode", ["native", "R2", "R3"]),
                   axis("seed", [0, 1]))
    plan = plan_sweep(experiment(grid), tmp_path / "s")
    names = [run.name for run in plan.runs]
    assert len(names) == 2 * 3 * 2 == len(set(names))
    assert names[:3] == ["obj=grpo,mode=native,seed=0", "obj=grpo,mode=native,seed=1", "obj=grpo,mode=R2,seed=0"]
    assert names[-1] == "obj=gspo,mode=R3,seed=1"
    run = plan.runs[3]
    assert (run.config.objective.name, run.config.routing_mode, run.config.seed) == ("grpo", "R2", 1)
    again = plan_sweep(experiment(grid), tmp_path / "elsewhere")
    assert [r.name for r in again.runs] == names
    assert again.to_json()["hash"] == plan.to_json()["hash"]  # paths are not part of the grid


@pytest.mark.parametrize("value, text", [(1e-4, "1e-4"), (3e-4, "3e-4"), (2.5e-5, "2.5e-5"), (0.2, "0.2"),
                                         (0.135, "0.135"), (1.0, "1"), (8, "8"), (True, "true"), (None, "none"),
                                         ("R2", "R2"), (("update", "noise"), "update+noise"),
                                         ("/data/sets/a b.jsonl", "a-b.jsonl"), (("128/8",), "128-8"),
                                         (("8/2", "64/8"), "8-2+64-8"), ("runs/64/8", "8")])
def test_values_in_names_are_short_and_file_name_safe(value, text):
    assert format_value(value) == text


def test_seed_goes_last_and_a_point_without_changes_is_base():
    assert run_name({"seed": 2, "optim.lr": 1e-4}) == "lr=1e-4,seed=2"
    assert run_name({"seed": 0}) == "base,seed=0"
    assert run_name({}) == "base"
    assert run_name({"task.max_terms": 4}) == "task.max_terms=4"  # unlabelled fields keep their dotted name
    assert union([{}], axis("minibatches", [1, 2]), [{}]) == [{}, {"minibatches": 1}, {"minibatches": 2}]


def test_a_different_grid_or_config_changes_the_hash(tmp_path):
    plan = plan_sweep(experiment(axis("seed", [0, 1])), tmp_path / "s")
    other_lr = plan_sweep(experiment(axis("seed", [0, 1])), tmp_path / "s", overrides={"optim.lr": "1e-4"})
    other_grid = plan_sweep(experiment(axis("seed", [0, 1, 2])), tmp_path / "s")
    hashes = {p.to_json()["hash"] for p in (plan, other_lr, other_grid)}
    assert len(hashes) == 3
    assert all(r.config.optim.lr == 1e-4 for r in other_lr.runs)


def test_architecture_overrides_get_one_warm_start_each(tmp_path):
    grid = product(axis("model.n_layers", [1, 2]), axis("optim.lr", [1e-4, 3e-4]))
    plan = plan_sweep(experiment(grid, warm=True), tmp_path / "s")
    assert len(plan.warmstarts) == 2
    for run in plan.runs:
        assert plan.warmstarts[run.warmstart].model.n_layers == run.config.model.n_layers
        assert run.config.init_from.startswith(str(tmp_path / "s" / "warmstart" / run.warmstart))
    changed = plan_sweep(experiment(grid, warm=True), tmp_path / "s", overrides={"sft.total_steps": "7"})
    assert all(w.total_steps == 7 for w in changed.warmstarts.values())
    assert set(changed.warmstarts).isdisjoint(plan.warmstarts)  # the key follows the warm start's config


# --- overrides ----------------------------------------------------------------------------------------------------


def test_a_warm_start_on_its_own_task_serves_runs_on_harder_problems(tmp_path):
    """Length generalisation: runs on 4- and 5-term problems share one warm start trained on 2-3 terms; without
    warmstart_own_task each run would get a warm start on its own task."""
    from dataclasses import replace

    from moe_rl.tasks import TaskConfig

    grid = axis("task.min_terms", [4, 5])
    own = experiment(grid, warm=True, task=TaskConfig(min_terms=4, max_terms=5))

    def own_task() -> Experiment:
        return replace(own(), warmstart_own_task=True)

    plan = plan_sweep(own_task, tmp_path / "s")
    assert len(plan.warmstarts) == 1
    (warm,) = plan.warmstarts.values()
    assert (warm.task.min_terms, warm.task.max_terms) == (TaskConfig().min_terms, TaskConfig().max_terms)
    assert sorted(run.config.task.min_terms for run in plan.runs) == [4, 5]
    assert len({run.config.init_from for run in plan.runs}) == 1
    per_run = plan_sweep(own, tmp_path / "t")
    assert sorted(w.task.min_terms for w in per_run.warmstarts.values()) == [4, 5]


def test_two_warm_starts_per_architecture_alternate_over_run_seeds(tmp_path):
    from dataclasses import replace

    grid = product(axis("model.n_layers", [1, 2]), axis("seed", range(4)))
    plain = experiment(grid, warm=True)

    def two() -> Experiment:
        return replace(plain(), warmstart_seeds=2)

    plan = plan_sweep(two, tmp_path / "s")
    assert len(plan.warmstarts) == 4  # 2 architectures x 2 warm starts
    by_run = {(r.config.model.n_layers, r.config.seed): plan.warmstarts[r.warmstart].seed for r in plan.runs}
    assert by_run == {(layers, s): s % 2 for layers in (1, 2) for s in range(4)}
    single = plan_sweep(plain, tmp_path / "t")
    assert len(single.warmstarts) == 2 and {w.seed for w in single.warmstarts.values()} == {0}
    with pytest.raises(ValueError, match="warmstart_seeds=0"):
        replace(plain(), warmstart_seeds=0)


def test_overrides_parse_strings_by_the_field_type():
    cfg = with_overrides(tiny_train_config("x"), {"optim.lr": "3e-4", "routing_mode": "R2", "keep_every": "none",
                                                  "probes.enabled": "update,noise", "probes.every": "update:4",
                                                  "log.trackers": "", "objective.clip_high": "0.3"})
    assert cfg.optim.lr == 3e-4 and cfg.routing_mode == "R2" and cfg.keep_every is None
    assert cfg.probes.enabled == ("update", "noise") and cfg.probes.every == {"update": 4}
    assert cfg.log.trackers == () and cfg.objective.clip_high == 0.3
    assert coerce("true", bool, "x") is True and coerce(2, float, "x") == 2.0
    assert from_dict(type(cfg), config_to_dict(cfg)) == cfg


@pytest.mark.parametrize("overrides, message", [
    ({"optim.lrr": "1"}, "'optim.lrr' is not a field of TrainConfig; did you mean optim.lr"),
    ({"lr": "1"}, "did you mean optim.lr"),
    ({"model.n_expert": "4"}, "did you mean model.n_experts"),
    ({"optim": "1"}, "'optim' is a group of fields"),
    ({"optim.lr": "fast"}, "optim.lr='fast' is not a valid float"),
    ({"model.n_layers": "2.5"}, "model.n_layers='2.5' is not a valid int"),
    ({"routing_mode": "R4"}, "routing_mode='R4' is not valid; choose one of"),
    ({"optim.lr": "-1"}, "optim: lr=-1.0 must be > 0"),
])
def test_a_bad_override_names_the_field(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        with_overrides(tiny_train_config("x"), overrides)


# --- bad input ----------------------------------------------------------------------------------------------------


def test_unknown_experiment_lists_the_available_ones():
    with pytest.raises(ConfigError, match="unknown experiment 'churn'; available: smoke, churn_repro, "
                                          "objective_comparison, ablations"):
        plan_sweep(get_experiment("churn"), "/tmp/unused")


def test_unknown_experiment_argument_lists_the_arguments():
    with pytest.raises(ConfigError, match="has no argument 'seed'; its arguments: scale='cpu', seeds=5"):
        plan_sweep(get_experiment("objective_comparison"), "/tmp/unused", {"seed": "1"})


def test_override_of_a_missing_field_names_it(tmp_path):
    with pytest.raises(ConfigError, match="--set 'optim.learning_rate' is not a field of TrainConfig"):
        plan_sweep(get_experiment("smoke"), tmp_path, overrides={"optim.learning_rate": "1e-4"})


def test_override_of_a_swept_field_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="--set routing_mode: the experiment sweeps routing_mode over native, R2"):
        plan_sweep(get_experiment("smoke"), tmp_path, overrides={"routing_mode": "R3"})


def test_a_grid_point_with_a_bad_field_names_the_run(tmp_path):
    with pytest.raises(ConfigError, match="run 'lrr=1': 'lrr' is not a field"):
        plan_sweep(experiment([{"lrr": 1}]), tmp_path)


def test_a_sweep_directory_made_by_a_different_grid_is_refused(tmp_path):
    store_plan(plan_sweep(get_experiment("smoke"), tmp_path / "s"))
    store_plan(plan_sweep(get_experiment("smoke"), tmp_path / "s"))  # the same grid again is fine
    with pytest.raises(ConfigError) as err:
        store_plan(plan_sweep(get_experiment("smoke"), tmp_path / "s", {"steps": "3"}))
    message = str(err.value)
    assert "holds a different grid" in message and "total_steps: 2 -> 3" in message
    assert "run its own command: moe-rl sweep smoke" in message and "choose another --sweep-dir" in message
    assert json.loads((tmp_path / "s" / "sweep.json").read_text())["arguments"] == {}  # untouched


def _as_stored_by_an_older_moe_rl(sweep_dir: Path, field: str, old_key: str) -> None:
    """Rewrite sweep.json as a moe-rl without `field` (model.<field>) would have written it: the field absent from
    every run's and warm start's config, and the warm start under another key (its hash covered the config)."""
    data = json.loads((sweep_dir / "sweep.json").read_text())
    (new_key,) = data["warmstarts"]
    data["warmstarts"] = {old_key: data["warmstarts"][new_key]}
    for config in [r["config"] for r in data["runs"]] + list(data["warmstarts"].values()):
        del config["model"][field]
    for run in data["runs"]:
        run["warmstart"] = old_key
    data["hash"] = "0" * 64
    (sweep_dir / "sweep.json").write_text(json.dumps(data))


def test_a_sweep_stored_before_a_field_was_added_continues_with_its_warm_starts(tmp_path):
    """Upgrading moe-rl between sittings of a sweep must not refuse the directory or train its warm starts again:
    a field the stored plan lacks, held at its default, is no change. At another value it is."""
    from moe_rl.sweep.sweepdir import added_since, check_same_grid, read_sweep, with_stored_warm_starts

    grid = axis("seed", [0, 1])
    store_plan(plan_sweep(experiment(grid, warm=True), tmp_path / "s"))
    _as_stored_by_an_older_moe_rl(tmp_path / "s", "init_depth", "L2-E4-K2-D32-older")
    plan = plan_sweep(experiment(grid, warm=True), tmp_path / "s")
    assert added_since(read_sweep(tmp_path / "s"), plan) == {"model.init_depth"} and check_same_grid(plan)
    kept = with_stored_warm_starts(plan)
    assert list(kept.warmstarts) == ["L2-E4-K2-D32-older"]
    assert kept.warmstarts["L2-E4-K2-D32-older"].out_dir == str(tmp_path / "s" / "warmstart" / "L2-E4-K2-D32-older")
    assert all(r.warmstart == "L2-E4-K2-D32-older" and "L2-E4-K2-D32-older" in r.config.init_from for r in kept.runs)
    store_plan(kept)  # accepted, and written again under the stored keys
    assert list(read_sweep(tmp_path / "s")["warmstarts"]) == ["L2-E4-K2-D32-older"]

    _as_stored_by_an_older_moe_rl(tmp_path / "s", "init_depth", "L2-E4-K2-D32-older")
    changed = plan_sweep(experiment(grid, warm=True, model=ModelConfig(**TINY, init_depth=7)), tmp_path / "s")
    assert added_since(read_sweep(tmp_path / "s"), changed) is None
    with pytest.raises(ConfigError, match="holds a different grid"):
        check_same_grid(changed)
    assert with_stored_warm_starts(changed) is changed


def test_a_sweep_stored_before_sft_took_trains_names_continues_with_its_warm_starts(tmp_path):
    """A sweep.json written when the warm start's fields were flat (steps, lr, eval_every, ...) has the same hash
    and warm start keys as the plan now: the directory continues, its warm starts are not trained again."""
    from moe_rl.sweep.plan import sft_key_form
    from moe_rl.sweep.sweepdir import check_same_grid, read_sweep

    plan = plan_sweep(experiment(axis("seed", [0, 1]), warm=True), tmp_path / "s")
    store_plan(plan)
    data = read_sweep(tmp_path / "s")
    old = {key: sft_key_form(config) for key, config in data["warmstarts"].items()}
    assert all("steps" in c and "lr" in c and "optim" not in c and "log" not in c for c in old.values())
    assert grid_hash(data["runs"], old) == grid_hash(data["runs"], data["warmstarts"]) == data["hash"]
    (tmp_path / "s" / "sweep.json").write_text(json.dumps({**data, "warmstarts": old}))
    again = plan_sweep(experiment(axis("seed", [0, 1]), warm=True), tmp_path / "s")
    assert check_same_grid(again) and list(again.warmstarts) == list(plan.warmstarts)


def test_cli_bad_input_exits_2_with_one_line(tmp_path):
    out = moe_rl("sweep", "nope", cwd=tmp_path)
    assert out.returncode == 2 and "available: smoke, churn_repro" in out.stderr and "Traceback" not in out.stderr
    out = moe_rl("sweep", "smoke", "--set", "optim.lrr=1", cwd=tmp_path)
    assert out.returncode == 2 and "'optim.lrr' is not a field of TrainConfig; did you mean optim.lr" in out.stderr
    out = moe_rl("sweep", "smoke", "--set", "optim.lr", cwd=tmp_path)
    assert out.returncode == 2 and "must read key=value" in out.stderr
    assert not (tmp_path / "sweeps").exists()


def test_dry_run_prints_the_plan_and_creates_nothing(tmp_path):
    out = moe_rl("sweep", "objective_comparison", "--dry-run", "--arg", "seeds=2", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "runs (10): 10 start" in out.stdout
    assert "swept routing_mode: native, R2, R3" in out.stdout and "swept seed: 0, 1" in out.stdout
    assert "start    obj=gspo,mode=R2,seed=1" in out.stdout
    assert "dry run: nothing was run or written" in out.stdout
    assert list(tmp_path.iterdir()) == []


def test_a_repeated_arg_adds_to_the_others_and_a_key_given_twice_is_refused(tmp_path):
    """`--arg a=1 --arg b=2` is `--arg a=1 b=2` (a plain tuple option would keep only the last use, silently running
    a different grid than the command line says)."""
    out = moe_rl("sweep", "stability", "--dry-run", "--arg", "axes=lr", "--arg", "methods=grpo,grpo+R2", "seeds=1",
                 cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    # 2 methods x the 7 learning rates of moe_rl.experiments.stability.LRS x 1 seed
    assert "arguments: axes=lr methods=grpo,grpo+R2 seeds=1" in out.stdout and "runs (14): 14 start" in out.stdout
    assert "swept minibatches: 4\n" in out.stdout  # the lr axis only
    out = moe_rl("sweep", "stability", "--dry-run", "--arg", "seeds=3", "--arg", "seeds=5", cwd=tmp_path)
    assert out.returncode == 2 and "--arg gives seeds twice (3 and 5)" in out.stderr
    assert list(tmp_path.iterdir()) == []


# --- running ------------------------------------------------------------------------------------------------------


def test_a_failing_run_does_not_stop_the_others_and_a_rerun_retries_only_it(tmp_path):
    missing = tmp_path / "missing.pt"  # fails at run time: the checkpoint to start from does not exist
    grid = [{"seed": 0}, {"seed": 1}, {"seed": 2, "init_from": str(missing)}]
    plan = plan_sweep(experiment(grid, labels={"init_from": "init"}), tmp_path / "s")
    names = ["base,seed=0", "base,seed=1", "init=missing.pt,seed=2"]
    assert [r.name for r in plan.runs] == names
    lines = []
    index = run_local(plan, workers=2, echo=lines.append)
    assert index["status"].tolist() == ["finished", "finished", "failed"]
    assert "missing.pt" in index["reason"][2] and index["reason"][0] == ""
    assert read_index(tmp_path / "s")["status"].tolist() == ["finished", "finished", "failed"]
    assert len(lines) == 3 and any(line.startswith("[3/3]") for line in lines)
    run_dirs = [Path(r.config.out_dir) for r in plan.runs]
    before = [(d / "manifest.json").read_text() for d in run_dirs[:2]]

    shutil.copy(run_dirs[0] / "checkpoints" / "latest.pt", missing)  # fix the cause, then re-run the sweep
    # the refused --init-from left no directory behind, so the run starts (not restarts)
    assert [planned_action(r)[0] for r in plan.runs] == ["skip", "skip", "start"]
    lines = []
    index = run_local(plan_sweep(experiment(grid, labels={"init_from": "init"}), tmp_path / "s"), workers=2,
                      echo=lines.append)
    assert len(lines) == 1 and "finished init=missing.pt,seed=2" in lines[0]
    assert index["status"].tolist() == ["finished"] * 3
    assert index["attempts"].tolist() == [1, 1, 2]
    assert [(d / "manifest.json").read_text() for d in run_dirs[:2]] == before  # finished runs were not touched
    retried = read_manifest(run_dirs[2])
    assert retried["status"] == "finished" and retried["resumes"] == []  # no checkpoint: started over cleanly
    assert len(metric_lines(run_dirs[2])) == 2 * 4


def test_only_matches_a_field_some_cells_leave_unset_by_the_value_their_config_holds(tmp_path):
    grid = product(axis("optim.lr", (1e-3, 2e-4)), [{}, {"objective.name": "gspo"}])  # as stability's methods
    plan = plan_sweep(experiment(grid), tmp_path / "s")
    grpo = plan.selected({"objective.name": "grpo", "optim.lr": "2e-4"})
    assert grpo == {r.name for r in plan.runs if r.point == {"optim.lr": 2e-4}}
    assert len(grpo) == 1 and plan.selected({"objective.name": "gspo"}) == {r.name for r in plan.runs
                                                                          if "objective.name" in r.point}
    with pytest.raises(ConfigError, match="the runs' values are grpo, gspo"):
        plan.selected({"objective.name": "ppo"})


def test_only_selects_runs_by_their_swept_values_and_leaves_the_others_for_later(tmp_path, capsys):
    grid = product(axis("optim.lr", (1e-3, 2e-4)), [{"seed": 0}, {"seed": 1}])
    plan = plan_sweep(experiment(grid), tmp_path / "s")
    names = [r.name for r in plan.runs]
    assert plan.selected({}) is None
    assert plan.selected({"optim.lr": "2e-4"}) == {n for n in names if "lr=2e-4" in n}  # 2e-4 is 0.0002
    assert plan.selected({"optim.lr": "1e-3,2e-4", "seed": "1"}) == {n for n in names if n.endswith("seed=1")}
    with pytest.raises(ConfigError, match="--only optim.lr=3e-4: the runs' values are 1e-3, 2e-4"):
        plan.selected({"optim.lr": "3e-4"})
    with pytest.raises(ConfigError, match="--only lr: not a swept field; swept: optim.lr, seed"):
        plan.selected({"lr": "1e-3"})
    chosen = plan.selected({"seed": "1"})
    print_plan(plan, existing=False, selected=chosen)
    assert "runs (4): 2 start, 2 later" in capsys.readouterr().out
    index = run_local(plan, workers=1, echo=lambda _: None, selected=chosen)
    ran = {name for name, status in zip(index["name"], index["status"]) if status == "finished"}
    assert ran == chosen
    assert [planned_action(r)[0] for r in plan.runs if r.name not in chosen] == ["start", "start"]


def test_a_free_worker_takes_warm_starts_then_ready_runs_costliest_first():
    from moe_rl.sweep.jobs import Job, _next_job

    small, big = Job("warmstart", "L2", None, 10.0), Job("warmstart", "L8", None, 40.0)
    on_small, on_big = Job("run", "a", "L2", 5.0), Job("run", "b", "L8", 9.0)
    no_warm, cheap = Job("run", "c", None, 1.0), Job("run", "d", "L2", 2.0)
    waiting, unfinished = [small, on_small, big, on_big, no_warm, cheap], {"L2", "L8"}
    picked = []
    for ended in (None, None, None, "L2", None):  # warm start L2 ends after the third pick
        unfinished.discard(ended)
        job = _next_job(waiting, unfinished)
        waiting.remove(job)
        picked.append(job.name)
    assert picked == ["L8", "L2", "c", "a", "d"]  # warm starts first, the costlier first; then runs that can start
    assert _next_job(waiting, {"L8"}) is None and _next_job(waiting, set()) is on_big  # b waits for L8 only


def test_a_run_that_dies_before_its_manifest_is_failed_with_the_jobs_reason(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA, where device='cuda' fails before the run directory exists")
    plan = plan_sweep(experiment([{"device": "cuda"}]), tmp_path / "s")
    store_plan(plan)
    with pytest.raises(ConfigError, match="no CUDA device"):
        execute_job(plan.sweep_dir, "run", "device=cuda")
    row = read_index(plan.sweep_dir).iloc[0]
    assert row["status"] == "failed" and row["reason"].startswith("ConfigError: device='cuda'")
    assert read_record(plan.sweep_dir, "run", "device=cuda")["state"] == "ended"


def test_a_killed_worker_is_failed_with_its_exit_status_and_last_line(tmp_path, monkeypatch):
    import moe_rl.sweep.jobs

    python = tmp_path / "python"  # a worker that is killed before it can note anything, as the OOM killer would
    python.write_text("#!/bin/sh\necho 'allocating 80 GB'\nkill -9 $$\n")
    python.chmod(0o755)
    monkeypatch.setattr(moe_rl.sweep.jobs.sys, "executable", str(python))
    lines = []
    index = run_local(plan_sweep(experiment([{"seed": 0}]), tmp_path / "s"), echo=lines.append)
    assert index["status"].tolist() == ["failed"]
    assert index["reason"][0] == "killed by signal 9: allocating 80 GB"
    assert "failed   base,seed=0" in lines[0] and "killed by signal 9" in lines[0]


def test_diverged_is_a_result_and_is_only_rerun_on_request(tmp_path):
    plan = plan_sweep(experiment([{"seed": 0}], optim=OptimConfig(lr=1e30, grad_clip=0.0)), tmp_path / "s")
    store_plan(plan)
    result = execute_job(plan.sweep_dir, "run", "base,seed=0")
    assert result["status"] == "diverged" and "non-finite" in result["reason"]
    assert run_action(Path(plan.runs[0].config.out_dir))[0] == "skip"
    assert planned_action(plan.runs[0], retry_diverged=True)[0] == "restart"
    assert read_index(plan.sweep_dir)["status"].tolist() == ["diverged"]


# --- the SLURM path, through submitit executors that need no cluster ---------------------------------------------


@pytest.mark.slow
def test_ctrl_c_stops_the_sweep_and_a_rerun_resumes_the_interrupted_runs(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    steps = 25  # long enough that Ctrl-C lands mid-run (it is sent once both runs have their first checkpoint)
    command = [sys.executable, "-m", "moe_rl.cli", "sweep", "smoke", "--arg", f"steps={steps}", "--sweep-dir", "s",
               "--workers", "2"]
    # SIGINT back to its default in the driver: a shell that starts this suite in the background ignores SIGINT,
    # and an ignored SIGINT is inherited, so Ctrl-C would never reach the sweep
    driver = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, start_new_session=True,
                              preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    first = [tmp_path / "s" / "runs" / name / "checkpoints" / "latest.pt" for name in
             ("obj=grpo,mode=native", "obj=grpo,mode=R2")]
    deadline = time.time() + 120
    while not all(path.exists() for path in first):
        assert time.time() < deadline and driver.poll() is None
        time.sleep(0.05)
    os.killpg(driver.pid, signal.SIGINT)  # Ctrl-C in a terminal reaches the driver and its workers
    out, err = driver.communicate(timeout=60)
    assert driver.returncode == 130 and "run the same command again to resume" in err
    assert sorted(p.name for p in (tmp_path / "s" / "runs").iterdir()) == ["obj=grpo,mode=R2", "obj=grpo,mode=native"]
    # On a loaded machine one worker may start seconds after the other, and the first run may finish before the second
    # reaches its first checkpoint (CI on 2 cores, 2026-12-04): only the runs Ctrl-C stopped are resumed.
    interrupted = [path for path in first if read_manifest(path.parents[1])["status"] != "finished"]
    assert interrupted, "Ctrl-C stopped neither run: both finished first"

    again = moe_rl(*command[3:], cwd=tmp_path)
    assert again.returncode == 0, again.stdout + again.stderr
    assert again.stdout.count("resume   obj=grpo") == len(interrupted) and again.stdout.count("start    obj=gspo") == 2
    for path in first:
        run_dir = path.parents[1]
        resumes = 1 if path in interrupted else 0
        assert read_manifest(run_dir)["status"] == "finished" and len(read_manifest(run_dir)["resumes"]) == resumes
        assert [line["step"] for line in metric_lines(run_dir, minibatch=0)] == list(range(steps))


@pytest.mark.slow
def test_smoke_sweep_runs_end_to_end_and_a_rerun_skips_everything(tmp_path):
    out = moe_rl("sweep", "smoke", "--workers", "2", "--sweep-dir", "s", cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    index = read_index(tmp_path / "s")
    assert index["status"].tolist() == ["finished"] * 4
    assert index["name"].tolist() == ["obj=grpo,mode=native", "obj=grpo,mode=R2", "obj=gspo,mode=native",
                                      "obj=gspo,mode=R2"]
    for name in index["name"]:
        assert len(metric_lines(tmp_path / "s" / "runs" / name)) == 2 * 2  # 2 steps x 2 minibatches
    [warm] = (tmp_path / "s" / "warmstart").iterdir()
    assert read_manifest(warm)["status"] == "finished"

    again = moe_rl("sweep", "smoke", "--sweep-dir", "s", cwd=tmp_path)
    assert again.returncode == 0 and "runs (4): 4 skip" in again.stdout and "done     " + warm.name in again.stdout
    assert "summary: 4 finished" in again.stdout


def test_local_workers_run_one_torch_thread_unless_told(tmp_path, monkeypatch):
    """One worker on a many-core machine used to get every core as torch threads, which turns the one-thread CPU
    kernels off; now each worker process gets `threads` (default 1) whatever the core count."""
    import moe_rl.sweep.jobs

    given = []
    monkeypatch.setattr(moe_rl.sweep.jobs, "_pool", lambda sweep_dir, jobs, workers, threads, *rest: given.append(
        (workers, threads)))
    plan = plan_sweep(experiment([{"seed": 0}]), tmp_path / "s")
    run_local(plan, workers=1, echo=lambda line: None)
    run_local(plan, workers=2, echo=lambda line: None, threads=3)
    assert given == [(1, 1), (2, 3)]
    with pytest.raises(ConfigError, match="threads=0"):
        run_local(plan, threads=0)
