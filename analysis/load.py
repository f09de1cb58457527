"""Read RL run directories (one run, a folder of runs, or a sweep) into pandas frames.

    data = load_runs("runs/")            # searched recursively; a run is a folder with config.json + manifest.json
    data.runs      one row per run: run, path, status, reason, seed, n_lines, last_step, every config field flattened
                   ("objective.name", "optim.lr", "model.n_layers", ...)
    data.metrics   one row per optimizer step (metrics.jsonl lines with minibatch >= 0)
    data.steps     one row per (run, rollout step): the common grid seeds are aligned on (see `per_step`)
    data.routing   the per-layer churn tables, long: step, update, minibatch, probe, layer, churn, set_change

`metrics`, `steps` and `routing` carry the run columns (run, path, status, reason, seed), the config fields that
differ between the runs, and KEY_CONFIG; `data.with_config(frame, keys)` joins any other config field.

Only RL runs are read (config.json has `routing_mode`); SFT runs in the same folder are skipped. Running, killed
and diverged runs load like finished ones: the reader drops a partial last line, and `status` says how it ended.
Nothing here imports the trainer's modules beyond moe_rl.runs.runlog's readers (nothing flows backwards).
"""

from __future__ import annotations

import functools
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from moe_rl.errors import DataError
from moe_rl.runs.runlog import field_defaults, flatten, read_metrics, read_tables

RUN_COLUMNS = ["run", "path", "status", "reason", "seed"]
INFO_COLUMNS = [*RUN_COLUMNS, "n_lines", "last_step", "git_sha"]  # the columns of `runs` that are not config
ROUTING_COLUMNS = ["run", "step", "update", "minibatch", "probe", "layer", "churn", "set_change"]
# Config fields worth having on every row even when all runs share them (figure axes, legends, tables).
KEY_CONFIG = ["objective.name", "routing_mode", "optim.lr", "model.n_layers", "model.n_experts", "model.top_k",
              "minibatches"]
# Line fields that are bookkeeping, not metrics.
INDEX_FIELDS = ["step", "minibatch", "update", "wall_time"]
# Metrics measured once per rollout step (copied onto each of its lines by the trainer) rather than per update.
ROLLOUT_LEVEL_PREFIXES = ("reward", "frac_reward_zero_std", "completions/", "dapo/", "rollout/", "eval/",
                          "routing/load_cv", "routing/router_entropy", "routing/noise/", "routing/rollout/",
                          "time/rollout", "time/old_pass", "update/skipped")


class NoRunsError(DataError):
    """The folder holds no RL run, or none of its runs has logged a metrics line yet."""


def is_rollout_level(metric: str) -> bool:
    """Whether `metric` is measured once per rollout step (reward, rollout probes) rather than per update."""
    return metric.startswith(ROLLOUT_LEVEL_PREFIXES)


# ---------------------------------------------------------------------------------------------------------------------
# Finding runs


def is_run_dir(path: Path) -> bool:
    return (path / "config.json").is_file() and ((path / "manifest.json").is_file()
                                                 or (path / "metrics.jsonl").is_file())


def find_runs(root: str | os.PathLike) -> list[Path]:
    """Run directories at or under `root`, in path order; run directories are not searched further. Symbolic links
    to folders are followed, each real folder once, so that a folder of links reads several sweeps together (an lr
    sweep and a staleness sweep) without moving them."""
    root = Path(root)
    if not root.is_dir():
        raise NoRunsError(f"{root} is not a directory")
    if is_run_dir(root):
        return [root]
    found, seen = [], set()
    for here, folders, _ in os.walk(root, followlinks=True):
        real = os.path.realpath(here)
        if real in seen:  # a second link to a folder already read, or a link that loops
            folders.clear()
            continue
        seen.add(real)
        if is_run_dir(Path(here)):
            found.append(Path(here))
            folders.clear()
        else:
            folders[:] = sorted(f for f in folders if not f.startswith("."))
    return sorted(found)


# ---------------------------------------------------------------------------------------------------------------------
# One run


def _config_value(value: Any) -> Any:
    """Lists and dicts become JSON text, so config columns hash, group and write to CSV."""
    return json.dumps(value, sort_keys=True) if isinstance(value, (list, dict, tuple)) else value


def _run_info(path: Path, name: str, config: dict, lines: list[dict]) -> dict[str, Any]:
    if (path / "manifest.json").is_file():
        manifest = _read_json(path / "manifest.json")
    else:  # killed between config.json and manifest.json: nothing else is known
        manifest = {"status": "unknown", "reason": "no manifest.json"}
    steps = [line["step"] for line in lines if "step" in line]
    seed = manifest.get("seed", config.get("seed"))
    info = {"run": name, "path": str(path), "status": manifest.get("status", "unknown"),
            "reason": manifest.get("reason"), "seed": seed, "n_lines": len(lines),
            "last_step": max(steps) if steps else None, "git_sha": (manifest.get("git") or {}).get("sha")}
    # A field added to moe-rl after the run was made is absent from its config.json; the run ran with that field's
    # default behaviour, so it reads as the default (else runs before and after the addition would "differ" in it).
    flat = {**_added_field_defaults(), **flatten(config)}
    info.update({key: _config_value(value) for key, value in flat.items()})
    return info


@functools.cache
def _added_field_defaults() -> dict[str, Any]:
    """{dotted key: default} of every TrainConfig field (the RL runs' config)."""
    from moe_rl.rl.run_config import TrainConfig

    return field_defaults(TrainConfig())


def _lines_frame(lines: list[dict], run: str) -> pd.DataFrame:
    """metrics.jsonl lines as a frame, plus `nan_metrics`: the metrics a line logged as NaN (a value that was
    logged as NaN is a fact; a value that was not logged is merely missing, and both read NaN in pandas)."""
    frame = pd.DataFrame.from_records(lines)
    frame.insert(0, "run", run)
    frame["nan_metrics"] = [",".join(k for k, v in line.items() if isinstance(v, float) and math.isnan(v))
                            for line in lines]
    return frame


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise DataError(f"{path}: not valid JSON ({exc.msg})") from exc


# ---------------------------------------------------------------------------------------------------------------------
# Many runs


@dataclass
class RunSet:
    """Every RL run under one folder, as frames (see the module docstring)."""

    root: Path
    runs: pd.DataFrame
    metrics: pd.DataFrame
    steps: pd.DataFrame
    routing: pd.DataFrame
    sweep: dict | None = None  # sweep.json of the root folder, if it has one
    skipped: list[str] = field(default_factory=list)  # run folders that are not RL runs
    missing: list[str] = field(default_factory=list)  # runs sweep.json plans whose directory holds no run (yet)
    group_by: list[str] = field(default_factory=list)  # set by moe_rl.analysis.aggregate.add_groups
    groups: list[str] = field(default_factory=list)  # group labels in plotting order, ditto

    @property
    def config_columns(self) -> list[str]:
        """Flattened config fields ("optim.lr"), in config order."""
        return [c for c in self.runs.columns if c not in INFO_COLUMNS and c != "group"]

    def varying(self) -> list[str]:
        """Config fields whose value differs between runs (any field, including seeds and paths)."""
        return [key for key in self.config_columns if distinct_values(self.runs[key]) > 1]

    def with_config(self, frame: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
        """`frame` with the config fields `keys` joined on `run` (those it lacks)."""
        missing = [key for key in keys if key not in frame.columns]
        if not missing:
            return frame
        return frame.merge(self.runs[["run", *missing]], on="run", how="left")


def distinct_values(column: pd.Series) -> int:
    """How many different values a config column holds, a missing one (None: a field unset in some runs, such as a
    correction's cap where another run has a band) counting as a value of its own. pandas 3's astype(str) keeps
    missing values missing, and nunique would drop them."""
    return column.astype(str).nunique(dropna=False)


def load_runs(root: str | os.PathLike) -> RunSet:
    """Read every RL run at or under `root`. Raises NoRunsError when there is none, or none with metrics yet."""
    root = Path(root)
    infos, frames, tables, skipped = [], [], [], []
    for path in find_runs(root):
        config = _read_json(path / "config.json")
        if "routing_mode" not in config:
            skipped.append(str(path))
            continue
        name = path.relative_to(root).as_posix() if path != root else path.name
        lines = read_metrics(path) if (path / "metrics.jsonl").exists() else []
        infos.append(_run_info(path, name, config, lines))
        frames += [_lines_frame(lines, name)] if lines else []
        table = read_tables(path, "routing")
        tables += [table.assign(run=name)] if len(table) else []
    _check_found(root, infos, frames, skipped)
    runs = pd.DataFrame(infos)
    lines = pd.concat(frames, ignore_index=True)
    routing = pd.concat(tables, ignore_index=True) if tables else pd.DataFrame(columns=ROUTING_COLUMNS)
    sweep = _read_json(root / "sweep.json") if (root / "sweep.json").is_file() else None
    data = RunSet(root, runs, pd.DataFrame(), pd.DataFrame(), pd.DataFrame(), sweep, skipped,
                  missing=missing_planned_runs(root, sweep))
    carried = RUN_COLUMNS + [k for k in KEY_CONFIG + data.varying() if k in runs.columns and k not in RUN_COLUMNS]
    run_cols = runs[list(dict.fromkeys(carried))]
    data.metrics = _with_runs(lines[lines["minibatch"] >= 0], run_cols)
    data.steps = _with_runs(per_step(lines), run_cols)
    data.routing = _with_runs(routing, run_cols)
    return data


def missing_planned_runs(root: Path, sweep: dict | None) -> list[str]:
    """The runs a sweep.json plans whose directory (<sweep>/runs/<name>, wherever the sweep directory now is) holds
    no run: not started yet, or deleted."""
    planned = sweep.get("runs") if isinstance(sweep, dict) else None
    if not isinstance(planned, list):
        return []
    names = [run.get("name") for run in planned if isinstance(run, dict) and isinstance(run.get("name"), str)]
    return [name for name in names if not is_run_dir(root / "runs" / name)]


def _check_found(root: Path, infos: list[dict], frames: list, skipped: list[str]) -> None:
    if not infos:
        hint = f" (skipped non-RL runs: {', '.join(skipped)})" if skipped else ""
        raise NoRunsError(f"no RL runs under {root}: a run directory holds config.json and manifest.json, "
                          f"as `moe-rl train --out-dir` writes them{hint}")
    if not frames:
        names = ", ".join(info["run"] for info in infos)
        raise NoRunsError(f"{len(infos)} run(s) under {root} but none has logged a metrics line yet ({names}); "
                          "analyse them after their first optimizer step")


def _with_runs(frame: pd.DataFrame, run_cols: pd.DataFrame) -> pd.DataFrame:
    """Run columns first, then the frame's own columns, in the frame's row order."""
    return run_cols.merge(frame, on="run", how="right")[[*run_cols.columns, *frame.columns.drop("run")]]


# ---------------------------------------------------------------------------------------------------------------------
# The rollout-step grid


def metric_columns(frame: pd.DataFrame) -> list[str]:
    """Numeric metric columns of a metrics.jsonl frame (not step counters, not run or config columns)."""
    skip = set(INDEX_FIELDS) | {"run", "nan_metrics"}
    return [c for c in frame.columns if c not in skip and pd.api.types.is_numeric_dtype(frame[c])]


def per_step(lines: pd.DataFrame) -> pd.DataFrame:
    """One row per (run, rollout step), the grid on which seeds are compared.

    Rollout-level metrics (reward, rollout and noise probes, router load, eval; `is_rollout_level`) take the
    first value logged in the step; update-level metrics (loss, churn, ratios, clip fractions) the mean over the
    step's optimizer steps. A metric that an optimizer step logged as NaN (a diverged update) makes the step's
    mean NaN rather than being skipped. `update` is the step's first optimizer step, `n_updates` how many it
    made (0 for a step that only holds the final evaluation or that DAPO skipped)."""
    keys = ["run", "step"]
    metrics = metric_columns(lines)
    rollout = [m for m in metrics if is_rollout_level(m)]
    update = [m for m in metrics if not is_rollout_level(m)]
    optimizer_lines = lines[lines["minibatch"] >= 0]
    groups = lines.groupby(keys, sort=True)
    steps = groups.agg(update=("update", "min"), wall_time=("wall_time", "max"))
    steps["n_updates"] = optimizer_lines.groupby(keys).size().reindex(steps.index, fill_value=0)
    steps = steps.join(groups[rollout].first()).join(optimizer_lines.groupby(keys)[update].mean())
    for row in lines[lines["nan_metrics"] != ""].itertuples():
        for name in row.nan_metrics.split(","):
            if name in update:
                steps.loc[(row.run, row.step), name] = float("nan")
    return steps.copy().reset_index()  # copy: one consolidated block instead of hundreds of joined columns
