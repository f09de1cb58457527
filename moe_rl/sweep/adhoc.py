"""An ad-hoc sweep: a grid given on the command line or in a YAML file instead of a named experiment.

    moe-rl sweep --grid objective.name=grpo,gspo seed=0,1              # 4 runs from train's defaults
    moe-rl sweep --grid optim.lr=1e-4,3e-4 --set total_steps=20        # --set changes every run's base
    moe-rl sweep --grid-file grid.yaml --dry-run     # grid.yaml: {optim.lr: [1e-4, 3e-4], seed: [0, 1]}

Each key is a dotted TrainConfig field as `--set` spells it (`seed` too); every combination of the values runs, the
last key varying fastest. Runs are named from their values (`obj=grpo,seed=0`) and the sweep directory from the
grid (sweeps/grid_obj_grpo+gspo_seed_0+1), so the same command continues the same sweep. The runs start from train's
defaults (no warm start; `--set init_from=...` starts them from a checkpoint).
"""

from __future__ import annotations

import hashlib
import typing
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from moe_rl.errors import ConfigError
from moe_rl.rl.overrides import coerce, field_paths, read_config_file, unknown_field_error
from moe_rl.rl.run_config import TrainConfig
from moe_rl.sweep.grid import LABELS, SAFE, Experiment, axis, format_value, product

ADHOC_NAME = "grid"  # the experiment name an ad-hoc sweep is stored under (sweep.json, the plan's first line)
LONGEST_DIR_NAME = 120


def grid_axes(grid: Mapping[str, str], grid_file: str | None) -> dict[str, list]:
    """{dotted field: typed values} from `--grid key=v1,v2 ...` (comma-separated) and/or `--grid-file` (a mapping
    of field -> list, or one value); a key that is no TrainConfig field, or a value its type refuses, is named."""
    given: dict[str, list] = {key: [v.strip() for v in text.split(",")] for key, text in grid.items()}
    for key, values in _read_grid_file(grid_file).items():
        if key in given:
            raise ConfigError(f"--grid-file {grid_file}: {key} is also in --grid; give it once")
        given[key] = values
    if not given:
        raise ConfigError("--grid and --grid-file give no field to sweep")
    hints = _leaf_hints(TrainConfig)
    axes = {}
    for key, values in given.items():
        if key not in hints:
            raise unknown_field_error(key, TrainConfig, what="--grid ")
        if any(v == "" for v in values) or not values:
            raise ConfigError(f"--grid {key}: an empty value; give key=v1,v2")
        typed = [coerce(v, hints[key], key) for v in values]
        if len(set(map(repr, typed))) < len(typed):
            raise ConfigError(f"--grid {key}: a value is given twice ({', '.join(map(format_value, typed))})")
        axes[key] = typed
    return axes


def _read_grid_file(path: str | None) -> dict[str, list]:
    if path is None:
        return {}
    data = read_config_file(path, flag="--grid-file")
    return {str(key).removeprefix("--").replace("-", "_"): list(v) if isinstance(v, (list, tuple)) else [v]
            for key, v in data.items()}


def _leaf_hints(cls: type) -> dict[str, Any]:
    """{dotted leaf field: its type annotation} of a nested config dataclass."""
    hints = {}
    for path in field_paths(cls):
        owner = cls
        *groups, leaf = path.split(".")
        for group in groups:
            owner = typing.get_type_hints(owner)[group]
        hints[path] = typing.get_type_hints(owner)[leaf]
    return hints


def adhoc_experiment(axes: Mapping[str, list]) -> Callable[[], Experiment]:
    """The experiment function of a grid: train's defaults, every combination of the axes."""

    def grid() -> Experiment:
        return Experiment(TrainConfig(), product(*(axis(key, values) for key, values in axes.items())))

    grid.__name__ = ADHOC_NAME
    return grid


def adhoc_sweep_dir(axes: Mapping[str, list]) -> Path:
    """sweeps/grid_<label>_<v1>+<v2>_...: named from the grid, so that the same --grid finds its sweep again; a name
    past LONGEST_DIR_NAME characters keeps its start and ends with a hash of the whole."""
    parts = [f"{LABELS.get(k, k)}={'+'.join(format_value(v) for v in values)}" for k, values in axes.items()]
    name = SAFE.sub("_", ",".join([ADHOC_NAME, *parts]))
    if len(name) > LONGEST_DIR_NAME:
        name = f"{name[:LONGEST_DIR_NAME - 9]}-{hashlib.sha256(name.encode()).hexdigest()[:8]}"
    return Path("sweeps") / name

