"""moe-rl sweep: run a named experiment (experiments/) as a sweep of runs, locally or on SLURM, resumably.

    moe-rl sweep smoke                                          # the CI sweep: seconds on CPU
    moe-rl sweep churn_repro --dry-run                          # the plan: runs, swept values, skip / resume
    moe-rl sweep churn_repro --workers 2                        # 2 runs at a time, each in its own process
    moe-rl sweep objective_comparison --arg seeds=5 --set optim.lr=3e-4 total_steps=100
    moe-rl sweep churn_repro --arg scale=gpu --executor slurm --partition gpu --gpus-per-job 1 --time 240
    moe-rl sweep --grid objective.name=grpo,gspo seed=0,1        # an ad-hoc grid from train's defaults (sweep/adhoc.py)

The sweep directory (default sweeps/<experiment>):

    sweep.json          experiment, arguments, overrides, the swept values, a hash of the expanded run configs, and
                        every run's resolved config (what the jobs run)
    index.csv           one row per run: name, swept fields (dotted), status, reason, warmstart, attempts, run_dir
    warmstart/<key>/    one SFT run per distinct model architecture and task; each run's init_from points at its own
    runs/<name>/        one run directory each (docs/design.md section 7)
    jobs/               per job: <name>.json (attempts, last error) and <name>.log (its stdout and stderr)

Re-running the same command skips finished and diverged runs, resumes interrupted or failed runs that saved a
checkpoint (`resume=True`), and starts the others over. A diverged run is a result: it is only run again with
--retry-diverged. A directory made by a different grid is refused. What it simplifies on purpose: one sweep process
per directory, and a warm start is an SFT run that is restarted, not resumed, if it was interrupted.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import json
import os
import shlex
import signal
import sys
import typing
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from moe_rl.errors import ConfigError, DataError
from moe_rl.model import ModelConfig
from moe_rl.model.config import NON_ARCHITECTURE_FIELDS
from moe_rl.rl.overrides import coerce, get_field, parse_assignments, with_overrides
from moe_rl.rl.run_config import SFTConfig, TrainConfig
from moe_rl.runs.checkpoint import CHECKPOINTS, LATEST
from moe_rl.runs.claim import check_out_dir
from moe_rl.runs.runlog import config_to_dict
from moe_rl.sweep.adhoc import adhoc_experiment, adhoc_sweep_dir, grid_axes
from moe_rl.sweep.config import SweepConfig
from moe_rl.sweep.grid import Experiment, format_value, run_name
from moe_rl.sweep.jobs import run_local
from moe_rl.sweep.plan import PlannedRun, SweepPlan, sft_key_form, stable_config
from moe_rl.sweep.sweepdir import (
    INDEX_CSV,
    RUNS,
    SWEEP_JSON,
    WARMSTART,
    check_same_grid,
    planned_action,
    todo,
    warmstart_done,
    with_stored_warm_starts,
)


def experiment_arguments(fn: Callable, given: Mapping[str, Any]) -> dict[str, Any]:
    """`given` checked against fn's keyword arguments and parsed by their annotations."""
    params = inspect.signature(fn).parameters
    hints = typing.get_type_hints(fn)
    args = {}
    for key, value in given.items():
        if key not in params:
            listed = ", ".join(f"{p.name}={p.default!r}" for p in params.values())
            raise ConfigError(f"experiment {fn.__name__!r} has no argument {key!r}; its arguments: {listed or 'none'}")
        args[key] = coerce(value, hints.get(key, Any), key)
    return args


def default_sweep_dir(experiment: str, arguments: Mapping[str, Any]) -> Path:
    suffix = "".join(f",{k}={format_value(v)}" for k, v in arguments.items())
    return Path("sweeps") / f"{experiment}{suffix}"


def plan_sweep(experiment: Callable[..., Experiment], sweep_dir: str | os.PathLike | None = None,
               arguments: Mapping[str, Any] | None = None, overrides: Mapping[str, Any] | None = None) -> SweepPlan:
    """Expand an experiment (a function returning an Experiment, e.g. moe_rl.experiments.get_experiment(name)) into
    named runs; runs nothing.

    `arguments` go to the experiment function; `overrides` (dotted, as `--set`) change every run, and `sft.<field>`
    changes the warm start. Strings are parsed by the field's type."""
    fn = experiment
    args = experiment_arguments(fn, arguments or {})
    spec = fn(**args)
    if not isinstance(spec, Experiment):
        raise TypeError(f"experiment {fn.__name__!r} returned {type(spec).__name__}, not an Experiment")
    sweep_dir = Path(sweep_dir or default_sweep_dir(fn.__name__, args)).absolute()
    base, warm, overrides = _apply_overrides(spec, dict(overrides or {}))
    runs, warmstarts = [], {}
    for point in spec.grid:
        name = run_name(point, spec.labels)
        cfg = with_overrides(base, point, what=f"experiment {fn.__name__!r}, run {name!r}: ")
        cfg = dataclasses.replace(cfg, out_dir=str(sweep_dir / RUNS / name), resume=False)
        cfg = in_wandb_group(cfg, sweep_dir.name)
        key = None
        if warm is not None:
            seeded = warm if spec.warmstart_seeds == 1 else dataclasses.replace(
                warm, seed=warm.seed + cfg.seed % spec.warmstart_seeds)
            key, sft_cfg = warmstart_for(seeded, cfg, sweep_dir, own_task=spec.warmstart_own_task)
            sft_cfg = in_wandb_group(sft_cfg, sweep_dir.name)
            warmstarts[key] = sft_cfg
            cfg = dataclasses.replace(cfg, init_from=str(Path(sft_cfg.out_dir) / CHECKPOINTS / LATEST))
        runs.append(PlannedRun(name, point, cfg, key))
    _check_distinct(runs)
    return SweepPlan(fn.__name__, args, overrides, sweep_dir, runs, warmstarts)


def _apply_overrides(spec: Experiment, overrides: dict[str, Any]):
    """(base, warm start, typed overrides) after `--set`; a swept field or one the sweep sets itself is refused."""
    swept = {key for point in spec.grid for key in point}
    sft_sets = {k.removeprefix("sft."): v for k, v in overrides.items() if k.startswith("sft.")}
    train_sets = {k: v for k, v in overrides.items() if not k.startswith("sft.")}
    for key in train_sets:
        if key in swept:
            values = list(dict.fromkeys(format_value(p[key]) for p in spec.grid if key in p))
            raise ConfigError(f"--set {key}: the experiment sweeps {key} over {', '.join(values)}; change the "
                              "experiment's arguments (--arg) or write an experiment that sweeps other values")
        if key in ("out_dir", "resume"):
            raise ConfigError(f"--set {key}: the sweep sets {key} itself (runs live in <sweep_dir>/runs/<name>)")
    base = with_overrides(spec.base, train_sets, what="--set ")
    warm = spec.warmstart
    if "init_from" in train_sets:
        warm = None  # the runs start from the given checkpoint instead of a warm start
    if sft_sets:
        if warm is None:
            raise ConfigError("--set sft.*: this sweep has no warm start to change")
        warm = with_overrides(warm, sft_sets, what="--set sft.")
    typed = {k: get_field(base, k) for k in train_sets} | {f"sft.{k}": get_field(warm, k) for k in sft_sets}
    return base, warm, typed


def in_wandb_group(cfg, group: str):
    """`cfg` (train's or sft's: both keep it under log.wandb) with its W&B group set to the sweep's name, unless
    `--set log.wandb.group=...` chose one."""
    if cfg.log.wandb.group:
        return cfg
    return dataclasses.replace(cfg, log=dataclasses.replace(cfg.log, wandb=dataclasses.replace(cfg.log.wandb,
                                                                                             group=group)))


def warmstart_for(sft_cfg: SFTConfig, run_cfg: TrainConfig, sweep_dir: Path,
                  own_task: bool = False) -> tuple[str, SFTConfig]:
    """The warm start a run needs: the SFT config with the run's architecture and device, and the run's task (or,
    with `own_task`, the SFT config's own), and its key."""
    arch = {f.name: getattr(run_cfg.model, f.name) for f in dataclasses.fields(ModelConfig)
            if f.name not in NON_ARCHITECTURE_FIELDS}
    cfg = dataclasses.replace(sft_cfg, model=dataclasses.replace(sft_cfg.model, **arch),
                              task=sft_cfg.task if own_task else run_cfg.task, device=run_cfg.device)
    stable = stable_config(sft_key_form(config_to_dict(cfg)))
    digest = hashlib.sha256(json.dumps(stable, sort_keys=True).encode()).hexdigest()[:8]
    m = cfg.model
    key = f"L{m.n_layers}-E{m.n_experts}-K{m.top_k}-D{m.d_model}-{digest}"
    return key, dataclasses.replace(cfg, out_dir=str(sweep_dir / WARMSTART / key))


def _check_distinct(runs: list[PlannedRun]) -> None:
    seen: dict[str, PlannedRun] = {}
    for run in runs:
        if run.name in seen:
            raise ConfigError(f"two grid points are both named {run.name!r}: {seen[run.name].point} and {run.point}; "
                              "give the field a label (Experiment.labels) or make the values distinct")
        seen[run.name] = run
    configs: dict[str, str] = {}
    for run in runs:
        body = json.dumps({k: v for k, v in config_to_dict(run.config).items() if k != "out_dir"}, sort_keys=True)
        if body in configs:
            raise ConfigError(f"runs {configs[body]!r} and {run.name!r} have the same config; drop one of the points")
        configs[body] = run.name


def sweep_command(cfg: SweepConfig, experiments: Mapping[str, Callable[..., Experiment]]) -> None:
    """`moe-rl sweep`: plan, print, then run locally or submit; exits 1 when a run of the sweep failed.

    `experiments` maps names to experiment functions (the cli passes experiments.EXPERIMENTS), so that this package
    never imports the experiments written on top of it."""
    experiment, axes = chosen_experiment(cfg, experiments)
    if cfg.sweep_dir is not None:
        if not cfg.sweep_dir.strip():
            raise ConfigError("--sweep-dir is empty: give the sweep's folder, or leave the flag out for "
                              "sweeps/<experiment>")
        cfg = dataclasses.replace(cfg, sweep_dir=os.path.expanduser(cfg.sweep_dir))
        check_out_dir(cfg.sweep_dir, "--sweep-dir")
    sweep_dir = cfg.sweep_dir or (adhoc_sweep_dir(axes) if axes is not None else None)
    plan = plan_sweep(experiment, sweep_dir, parse_assignments(cfg.arg, "--arg"), parse_assignments(cfg.set))
    plan = dataclasses.replace(plan, grid=axes)
    check_out_dir(plan.sweep_dir, "--sweep-dir")
    check_sweep_folder(plan.sweep_dir)
    plan = with_stored_warm_starts(plan)  # a sweep stored by an older moe-rl keeps its warm start folders
    selected = plan.selected(parse_assignments(cfg.only, "--only"))
    print_plan(plan, check_same_grid(plan), cfg.retry_diverged, selected)
    if cfg.dry_run:
        print("dry run: nothing was run or written")
        return
    if cfg.executor == "local":
        try:
            index = run_local(plan, cfg.workers, cfg.retry_diverged, threads=cfg.threads, selected=selected)
        except KeyboardInterrupt as err:  # the workers were told too, and stopped at a checkpoint
            print(f"interrupted; run the same command again to resume: {plan.command()} --sweep-dir "
                  f"{shlex.quote(str(plan.sweep_dir))}", file=sys.stderr)
            raise SystemExit(128 + getattr(err, "signum", signal.SIGINT)) from None
    else:
        try:
            from moe_rl.sweep.slurm import make_executor, submit, wait_for
        except ImportError as err:
            raise ConfigError(f"--executor {cfg.executor} needs submitit: pip install 'moe-rl[cluster]' ({err})") \
                from None

        executor = make_executor(cfg, plan.sweep_dir)
        jobs = submit(plan, executor, threads=cfg.cpus_per_job if cfg.executor == "slurm" else None,
                      retry_diverged=cfg.retry_diverged, selected=selected)
        if not cfg.wait:
            print(f"submitted {len(jobs)} jobs; index.csv is updated as they end, and `{plan.command()} --dry-run` "
                  "shows where each run stands")
            return
        index = wait_for(jobs, plan.sweep_dir)
    counts = index["status"].value_counts().to_dict()
    print("summary: " + ", ".join(f"{n} {s}" for s, n in counts.items()) + f"  -> {plan.sweep_dir / INDEX_CSV}")
    # A run of this invocation that was interrupted (its worker got a signal, not the sweep) did not finish either.
    stopped = index[(index["status"] == "interrupted") & (index["name"].isin(selected) if selected is not None
                                                            else True)]
    if counts.get("failed") or len(stopped):
        raise SystemExit(1)


def chosen_experiment(cfg: SweepConfig, experiments: Mapping[str, Callable[..., Experiment]]):
    """(the experiment function, None) for a named experiment; (an ad-hoc grid's function, its axes) for --grid or
    --grid-file (moe_rl.sweep.adhoc). A name and a grid together, or neither, is refused."""
    if cfg.grid or cfg.grid_file is not None:
        if cfg.experiment or cfg.arg:
            raise ConfigError(f"--grid and --grid-file make their own experiment: give them without an experiment "
                              f"name or --arg (got {cfg.experiment or '--arg'!r})")
        axes = grid_axes(parse_assignments(cfg.grid, "--grid"), cfg.grid_file)
        return adhoc_experiment(axes), axes
    if cfg.experiment not in experiments:
        what = f"unknown experiment {cfg.experiment!r}" if cfg.experiment else "name an experiment (or --grid)"
        raise ConfigError(f"{what}; available: {', '.join(experiments)}")
    return experiments[cfg.experiment], None


def check_sweep_folder(sweep_dir: Path) -> None:
    """A sweep directory is new, empty, a sweep's (it holds sweep.json), or holds only warmstart/: finished warm
    starts copied in from another sweep of the same model and task (their folder names are their configs' keys, so
    a sweep uses one only where it would have trained the same), to spend one SFT on several sweeps. A run
    directory or a folder of the user's files is refused before anything is written into it."""
    from moe_rl.runs.claim import is_run_manifest
    from moe_rl.runs.runlog import read_json_object

    for folder in (sweep_dir, *sweep_dir.parents):
        if (folder / "manifest.json").is_file():
            try:
                manifest = read_json_object(folder / "manifest.json", "a manifest")
            except DataError:
                continue
            if is_run_manifest(manifest):
                raise ConfigError(f"--sweep-dir {sweep_dir} is {'a run' if folder == sweep_dir else 'inside the run'} "
                                  f"{folder}: a sweep needs a folder of its own; choose a new or empty directory")
    if not sweep_dir.is_dir() or (sweep_dir / SWEEP_JSON).exists():
        return
    names = sorted(p.name for p in sweep_dir.iterdir() if p.name not in (".lock", ".index.lock", WARMSTART))
    if names:
        shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        raise ConfigError(f"--sweep-dir {sweep_dir} is not empty and holds no {SWEEP_JSON} (it holds {shown}): it is "
                          "not a sweep's folder; nothing was written: choose a new or empty directory")


def print_plan(plan: SweepPlan, existing: bool, retry_diverged: bool = False,
               selected: set[str] | None = None) -> None:
    print(f"sweep {plan.experiment!r} -> {plan.sweep_dir} ({'continuing' if existing else 'new'})")
    if plan.arguments:
        print("  arguments: " + " ".join(f"{k}={v}" for k, v in plan.arguments.items()))
    if plan.overrides:
        print("  overrides: " + " ".join(f"{k}={v}" for k, v in plan.overrides.items()))
    for key, values in plan.swept().items():
        print(f"  swept {key}: {', '.join(format_value(v) for v in values)}")
    keys, _ = todo(plan, retry_diverged, selected)
    if plan.warmstarts:
        print(f"  warm starts ({len(plan.warmstarts)}):")
        for key in plan.warmstarts:
            done = warmstart_done(Path(plan.warmstarts[key].out_dir))
            print(f"    {'start' if key in keys else 'done' if done else 'later':<8} {key}")
    actions = [(run, *planned_action(run, retry_diverged)) for run in plan.runs]
    if selected is not None:  # --only: what this invocation would run but leaves for another
        actions = [(run, "later", "not in --only") if action in ("start", "resume", "restart")
                   and run.name not in selected else (run, action, why) for run, action, why in actions]
    tally = {a: sum(1 for _, b, _ in actions if b == a)
             for a in ("start", "resume", "restart", "skip", "busy", "later")}
    print(f"  runs ({len(plan.runs)}): " + ", ".join(f"{n} {a}" for a, n in tally.items() if n))
    width = max(len(run.name) for run in plan.runs)
    for run, action, why in actions:
        print(f"    {action:<8} {run.name:<{width}}  {why}".rstrip())


