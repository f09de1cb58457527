"""What a named experiment returns, and the grid helpers that build its runs.

An experiment (see experiments/) is a Python function returning an `Experiment`: the config every run starts from,
the grid as a list of points (one dict of dotted overrides per run, in run order) and, optionally, the SFT warm
start the runs begin from. The grid is built from three helpers:

    axis("optim.lr", [1e-4, 3e-4])                    -> [{"optim.lr": 1e-4}, {"optim.lr": 3e-4}]
    product(methods, axis("seed", range(3)))          -> every combination, the last axis varying fastest
    union(base_point, axis("minibatches", [1, 2]))    -> the points of several grids, one after the other

`methods` may couple fields: [{"objective.name": "grpo", "routing_mode": "R2"}, ...] is one axis of three values.
Each point is named from its overrides: `obj=grpo,mode=R2,lr=1e-4,seed=0` (labels below; `seed` always last, and a
point that changes nothing but the seed is `base`).
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import PurePath
from typing import Any

from moe_rl.rl.run_config import SFTConfig, TrainConfig

Point = dict[str, Any]

# Short names of often-swept fields, used in run names; any other field appears under its dotted path.
LABELS = {
    "objective.name": "obj",
    "routing_mode": "mode",
    "optim.lr": "lr",
    "optim.warmup_steps": "warmup",
    "minibatches": "mb",
    "model.n_layers": "layers",
    "model.n_experts": "experts",
    "model.top_k": "topk",
    "objective.clip_low": "clip_lo",
    "objective.clip_high": "clip_hi",
    "rollout.group_size": "G",
    "seed": "seed",
}
SAFE = re.compile(r"[^A-Za-z0-9._+-]+")


@dataclass
class Experiment:
    """The runs of a named experiment: `base` changed by each point of `grid`, optionally warm-started."""

    base: TrainConfig
    """The config every run starts from (its out_dir and, with a warm start, init_from are set by the sweep)."""
    grid: list[Point] = field(default_factory=lambda: [{}])
    """One dict of dotted overrides per run, in run order."""
    warmstart: SFTConfig | None = None
    """SFT to run once per distinct model architecture and task before the RL runs; each run's init_from then points
    at the warm start of its own architecture. None: the runs start from base.init_from (or random weights)."""
    labels: dict[str, str] = field(default_factory=dict)
    """Extra short names for run names, on top of LABELS."""
    warmstart_seeds: int = 1
    """Warm starts per architecture: run seed s trains from the warm start of SFT seed (its own seed + s mod
    warmstart_seeds), so that contrasts between architectures carry warm-start variance (and an analysis can
    resample warm starts: moe_rl.analysis.stats.cluster_bootstrap over init_from)."""
    warmstart_own_task: bool = False
    """False: each run's warm start trains on the run's own task. True: on the warm start config's task, whatever
    the runs' (RL on harder problems than the warm start saw, as in a length-generalisation study)."""

    def __post_init__(self) -> None:
        if not isinstance(self.base, TrainConfig):
            raise TypeError(f"Experiment.base must be a TrainConfig, got {type(self.base).__name__}")
        self.grid = [dict(point) for point in self.grid]
        if self.warmstart_seeds < 1:
            raise ValueError(f"Experiment.warmstart_seeds={self.warmstart_seeds} must be >= 1")
        if not self.grid:
            raise ValueError("Experiment.grid is empty: a sweep needs at least one point ({} is the base config)")


def axis(path: str, values: Iterable[Any]) -> list[Point]:
    """One field's values, one point each."""
    return [{path: value} for value in values]


def product(*axes: Sequence[Point]) -> list[Point]:
    """Every combination of one point per axis, merged; the last axis varies fastest."""
    points = []
    for combo in itertools.product(*axes):
        merged: Point = {}
        for point in combo:
            clash = merged.keys() & point.keys()
            if clash:
                raise ValueError(f"product: axes both set {sorted(clash)}")
            merged.update(point)
        points.append(merged)
    return points


def union(*grids: Sequence[Point]) -> list[Point]:
    """The points of each grid in turn; a point equal to an earlier one is kept once."""
    seen, points = set(), []
    for grid in grids:
        for point in grid:
            key = repr(sorted(point.items()))
            if key not in seen:
                seen.add(key)
                points.append(dict(point))
    return points


def run_name(point: Mapping[str, Any], labels: Mapping[str, str] | None = None) -> str:
    """`obj=grpo,mode=R2,lr=1e-4,seed=0`: the point's fields in order, seed last; `base` for no change."""
    labels = {**LABELS, **(labels or {})}
    parts = [f"{labels.get(k, k)}={format_value(v)}" for k, v in point.items() if k != "seed"]
    if not parts:
        parts = ["base"]
    if "seed" in point:
        parts.append(f"seed={format_value(point['seed'])}")
    return ",".join(parts)


NUMBERS_WITH_SLASHES = re.compile(r"\d+(/\d+)+")


def format_value(value: Any) -> str:
    """A short, file-name-safe text for a value: 1e-4, 0.2, true, none, update+noise, 128-8 (for 128/8), a path's
    file name."""
    if value is None or isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return _format_float(value)
    if isinstance(value, (list, tuple)):
        return "+".join(format_value(v) for v in value) or "none"
    if isinstance(value, Mapping):
        return "+".join(f"{k}-{format_value(v)}" for k, v in value.items()) or "none"
    text = str(value)
    if NUMBERS_WITH_SLASHES.fullmatch(text):  # an "E/K" pair such as 128/8, not a path: keep both numbers
        text = text.replace("/", "-")
    elif "/" in text:
        text = PurePath(text).name
    return SAFE.sub("-", text) or "empty"


def _format_float(value: float) -> str:
    if value == 0 or not math.isfinite(value):
        return str(value)
    if abs(value) < 1e-2 or abs(value) >= 1e5:
        mantissa, exponent = f"{value:.6e}".split("e")
        return f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"
    return f"{value:.6g}"
