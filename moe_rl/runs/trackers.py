"""Optional mirrors of metrics.jsonl to TensorBoard or Weights & Biases. Off by default; the local file is the truth.

A tracker imports its library only when it is created, so neither library is a dependency of moe-rl; a missing one
gives an ImportError that names the extra to install. Trackers receive each metrics line after it is safe on disk
(see `MetricsWriter(trackers=...)`), and a tracker that fails is logged and skipped rather than ending the run.
"""

from __future__ import annotations

import importlib
import os
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

from moe_rl.errors import ConfigError, check_choice

TRACKING_EXTRA = "pip install 'moe-rl[tracking]'"
TRACKER_NAMES = ("tensorboard", "wandb")
TRACKER_MODULES = {"tensorboard": ("torch.utils.tensorboard", "tensorboard"), "wandb": ("wandb", "wandb")}


class Tracker(ABC):
    """A mirror of the metrics log: `log` one step's metrics, `close` at the end of the run."""

    @abstractmethod
    def log(self, metrics: Mapping[str, Any], step: int) -> None: ...

    @abstractmethod
    def close(self) -> None: ...


def import_optional(module: str, package: str, feature: str) -> ModuleType:
    """Import `module` for `feature`, or fail with the pip command that installs `package`."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise missing_package(package, feature) from None


class MissingPackageError(ConfigError, ImportError):
    """An optional package a config asks for is not installed (a user error: the CLI prints it as one line)."""


def missing_package(package: str, feature: str) -> MissingPackageError:
    return MissingPackageError(f"{feature} needs the '{package}' package, which is not installed; install it with: "
                       f"{TRACKING_EXTRA} (or pip install {package})")


def check_trackers_installed(names: Iterable[str], flag: str = "--log.trackers") -> None:
    """Refuse, before a run starts, a tracker whose package is missing (ConfigError with the pip command)."""
    for name in names:
        check_choice("trackers", name, TRACKER_NAMES)
        import_optional(*TRACKER_MODULES[name], f"{flag} {name}")


def numeric_items(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The metrics a tracker can plot: numbers (NaN and Inf included), not strings or None."""
    return {name: float(value) for name, value in metrics.items() if isinstance(value, (int, float))}


class TensorBoardTracker(Tracker):
    """Scalars to a TensorBoard event file in `log_dir` (by default <run>/tensorboard)."""

    def __init__(self, log_dir: str | os.PathLike):
        tensorboard = import_optional("torch.utils.tensorboard", "tensorboard", "the TensorBoard tracker")
        self._writer = tensorboard.SummaryWriter(log_dir=str(log_dir))

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        for name, value in numeric_items(metrics).items():
            self._writer.add_scalar(name, value, global_step=step)

    def close(self) -> None:
        self._writer.close()


class WandbTracker(Tracker):
    """Scalars to a Weights & Biases run. To continue the same W&B run after a resume, pass id=... and
    resume="allow" in `init_kwargs` (they go to wandb.init unchanged)."""

    def __init__(self, project: str, *, name: str | None = None, config: Mapping | None = None, **init_kwargs: Any):
        wandb = import_optional("wandb", "wandb", "the Weights & Biases tracker")
        self._run = wandb.init(project=project, name=name, config=dict(config or {}), **init_kwargs)

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        self._run.log(numeric_items(metrics), step=step)

    def close(self) -> None:
        self._run.finish()


def make_trackers(
    names: Iterable[str], run_dir: str | os.PathLike, *, config: Mapping | None = None,
    wandb: Mapping[str, Any] | None = None, run_id: str | None = None,
) -> list[Tracker]:
    """The trackers a config asks for by name ("tensorboard", "wandb"); none by default. `wandb` holds project, entity
    and group (WandbConfig); `run_id` names the W&B run, so that a resumed run continues the same one."""
    run_dir = Path(run_dir)
    trackers: list[Tracker] = []
    for name in names:
        check_choice("trackers", name, TRACKER_NAMES)
        if name == "tensorboard":
            trackers.append(TensorBoardTracker(run_dir / "tensorboard"))
        else:
            where = dict(wandb or {})
            resume = {"id": run_id, "resume": "allow"} if run_id else {}
            trackers.append(WandbTracker(where.get("project") or "moe-rl", name=run_dir.name, config=config,
                                         entity=where.get("entity"), group=where.get("group"), dir=str(run_dir),
                                         **resume))
    return trackers
