"""A sweep's plan: an experiment expanded into named runs, with the hash that identifies its grid.

Plain data: the sweep directory (sweepdir), the workers (jobs, slurm) and the command all read it; it imports none
of them.
"""

from __future__ import annotations

import hashlib
import json
import math
import shlex
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moe_rl.errors import ConfigError
from moe_rl.rl.run_config import SFTConfig, TrainConfig
from moe_rl.runs.runlog import config_to_dict
from moe_rl.sweep.grid import format_value

# Config fields the sweep sets itself (paths) or that change no result (threads, quiet): left out of the grid hash.
VOLATILE_FIELDS = ("out_dir", "init_from", "resume", "threads", "quiet", "print_every", "wandb", "trackers")
# Nested fields that change no result either: where W&B puts the runs, and the early warning (which only prints).
VOLATILE_GROUPS = (("log", "wandb"), ("log", "warn_threshold"), ("log", "warn_metric"))


@dataclass
class PlannedRun:
    name: str
    point: dict[str, Any]
    """The grid's overrides for this run (typed values)."""
    config: TrainConfig
    warmstart: str | None
    """Key of the warm start it starts from (a folder of <sweep>/warmstart), or None."""


@dataclass
class SweepPlan:
    experiment: str
    arguments: dict[str, Any]
    overrides: dict[str, Any]
    sweep_dir: Path
    runs: list[PlannedRun]
    warmstarts: dict[str, SFTConfig]
    grid: dict[str, list] | None = None
    """An ad-hoc sweep's axes (`--grid`, moe_rl.sweep.adhoc); None for a named experiment."""

    def swept(self) -> dict[str, list]:
        """Each swept field and its distinct values, in order of first appearance."""
        values: dict[str, list] = {}
        for run in self.runs:
            for key, value in run.point.items():
                if value not in values.setdefault(key, []):
                    values[key].append(value)
        if "seed" in values:
            values["seed"] = values.pop("seed")  # last, as in run names
        return values

    def selected(self, only: Mapping[str, str]) -> set[str] | None:
        """Names of the runs whose point takes, for every key of `only`, one of its comma-separated values (numbers
        compare as numbers: 2e-4 is 0.0002); None when `only` is empty (every run). A field that only some cells set
        (stability's `objective.name`, set by its gspo cells alone) matches the other runs by the value their config
        holds, so `objective.name=grpo` selects them. A key the grid does not sweep, or a value no run takes, is
        refused by name, so a typo does not silently select nothing."""
        if not only:
            return None
        swept = self.swept()
        chosen = {}
        for key, text in only.items():
            if key not in swept:
                raise ConfigError(f"--only {key}: not a swept field; swept: {', '.join(swept)}")
            taken = _distinct(run_value(run, key) for run in self.runs)
            wanted = [v.strip() for v in text.split(",") if v.strip()]
            unknown = [v for v in wanted if not any(_same_value(v, value) for value in taken)]
            if unknown or not wanted:
                raise ConfigError(f"--only {key}={text}: the runs' values are "
                                  f"{', '.join(format_value(v) for v in taken)}")
            chosen[key] = wanted
        return {run.name for run in self.runs
                if all(any(_same_value(v, run_value(run, key)) for v in wanted) for key, wanted in chosen.items())}

    def command(self) -> str:
        """The `moe-rl sweep` command line that makes this plan again."""
        args = [f"{k}={_cli_value(v)}" for k, v in self.arguments.items()]
        sets = [f"{k}={_cli_value(v)}" for k, v in self.overrides.items()]
        what = [self.experiment] if self.grid is None else ["--grid", *(
            f"{k}={','.join(map(_cli_value, values))}" for k, values in self.grid.items())]
        return shlex.join(["moe-rl", "sweep", *what, *(["--arg", *args] if args else []),
                           *(["--set", *sets] if sets else [])])

    def to_json(self) -> dict[str, Any]:
        runs = [{"name": r.name, "point": r.point, "warmstart": r.warmstart, "config": config_to_dict(r.config)}
                for r in self.runs]
        warmstarts = {key: config_to_dict(cfg) for key, cfg in self.warmstarts.items()}
        return config_to_dict({
            "experiment": self.experiment, "arguments": self.arguments, "overrides": self.overrides,
            "command": self.command(), "grid": self.swept(), "n_runs": len(self.runs),
            "hash": grid_hash(runs, warmstarts), "runs": runs, "warmstarts": warmstarts,
        })


def _cli_value(value: Any) -> str:
    """A value as `--set` / `--arg` parse it back (moe_rl.rl.overrides.coerce)."""
    if value is None or isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return ",".join(map(_cli_value, value))
    if isinstance(value, Mapping):
        return ",".join(f"{k}:{_cli_value(v)}" for k, v in value.items())
    return str(value)


def grid_hash(runs: list[dict], warmstarts: Mapping[str, dict]) -> str:
    """sha256 of the expanded configs, without the fields the sweep sets (paths) or that change no result (threads)."""
    def stable(entry: dict) -> dict:
        config = stable_config(entry["config"])
        config["init_from"] = f"warmstart:{entry['warmstart']}" if entry["warmstart"] else entry["config"]["init_from"]
        return {"name": entry["name"], "config": config}

    body = {"runs": [stable(r) for r in runs],
            "warmstarts": {k: stable_config(sft_key_form(c)) for k, c in warmstarts.items()}}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


# The warm start's fields under their names before sft took train's (total_steps was steps, optim.lr was lr, ...),
# and the AdamW constants it had then: a warm start's key and the grid hash read that form, so that the keys and
# hashes of existing sweeps and of the committed studies (results/*, e.g. L8-E64-K8-D64-fa72a8a6) stay as they were.
SFT_KEY_FIELDS = {"optim": ("lr", "warmup_steps", "weight_decay", "grad_clip"),
                  "log": ("eval_every", "eval_prompts", "print_every", "trackers", "wandb")}
SFT_OLD_CONSTANTS = {"beta1": 0.9, "beta2": 0.95, "eps": 1e-8}
# Fields a warm start's config gained after those keys were made, with the value that behaves as before: hashed only
# when set to something else, so that adding a field moves no existing key.
SFT_ADDED_FIELDS = {("sampling", "min_new_tokens"): 0}


def sft_key_form(config: Mapping[str, Any]) -> dict[str, Any]:
    """An SFT config's JSON form in the layout its key has always hashed: total_steps as steps, the optim and log
    fields at the top; optim's other fields (betas, eps) only where they differ from the constants of that time, and
    fields added since (SFT_ADDED_FIELDS) only where set. A config in that layout already (an older sweep.json's)
    comes back as it is, less those added fields."""
    config = _without_added_defaults(config)
    if "total_steps" not in config:
        return config
    flat = {("steps" if k == "total_steps" else k): v for k, v in config.items() if k not in SFT_KEY_FIELDS}
    for group, names in SFT_KEY_FIELDS.items():
        flat.update({name: config[group][name] for name in names})
    changed = {k: v for k, v in config["optim"].items() if k in SFT_OLD_CONSTANTS and v != SFT_OLD_CONSTANTS[k]}
    return {**flat, "optim": changed} if changed else flat


def _without_added_defaults(config: Mapping[str, Any]) -> dict[str, Any]:
    """`config` without the SFT_ADDED_FIELDS that hold their behave-as-before value."""
    config = dict(config)
    for (group, name), default in SFT_ADDED_FIELDS.items():
        if isinstance(config.get(group), Mapping) and config[group].get(name, default) == default:
            config[group] = {k: v for k, v in config[group].items() if k != name}
    return config


def stable_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """A config's JSON form without the fields that change no result (VOLATILE_FIELDS, VOLATILE_GROUPS)."""
    stable = {k: v for k, v in config.items() if k not in VOLATILE_FIELDS}
    for group, name in VOLATILE_GROUPS:
        if isinstance(stable.get(group), Mapping):
            stable[group] = {k: v for k, v in stable[group].items() if k != name}
    return stable


def _same_value(text: str, value: Any) -> bool:
    """Whether the command-line `text` names the grid value `value`."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return text == format_value(value) or text == str(value)
    try:
        return math.isclose(float(text), float(value), rel_tol=1e-9, abs_tol=0.0)
    except ValueError:
        return False


def run_value(run: PlannedRun, key: str) -> Any:
    """The value of the dotted config field `key` in `run`: its grid point's where the grid sets it, else its
    config's."""
    if key in run.point:
        return run.point[key]
    value: Any = run.config
    for part in key.split("."):
        value = getattr(value, part, None)
    return value


def _distinct(values) -> list:
    out: list = []
    for value in values:
        if value not in out:
            out.append(value)
    return out
