"""Checkpoints: save the whole training state atomically, load the newest one, capture and restore every RNG.

    <run>/checkpoints/latest.pt        the newest state, replaced atomically at every save
    <run>/checkpoints/step_000100.pt   kept every `keep_every` steps: a hard link to what latest.pt was then

A checkpoint is one dict written with torch.save. `training_state` builds the usual one:
    {"model": state_dict, "optimizer": state_dict, "scheduler": state_dict | None, "data_position": any,
     "rng": capture_rng_state(...), "step": int, "format": 1, "saved_at": UTC ISO}
It loads with torch.load(weights_only=True): the numpy RNG key is stored as a list of ints, not as an ndarray,
so resuming never needs to unpickle arbitrary objects.

Resume is exact when everything random goes through the captured sources: python `random`, the numpy global RNG,
torch's CPU and CUDA default generators, and the named torch.Generators passed in (the sampler's, the data's).
"""

from __future__ import annotations

import os
import random
import shutil
import warnings
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from moe_rl.errors import DataError, check_positive
from moe_rl.runs.atomic import TEMP_SUFFIX, atomic_write
from moe_rl.runs.provenance import utc_now

CHECKPOINTS = "checkpoints"
LATEST = "latest.pt"
FORMAT_VERSION = 1


class NoCheckpointError(FileNotFoundError):
    """A resume was asked for where no checkpoint was saved."""


def checkpoint_name(step: int) -> str:
    return f"step_{step:06d}.pt"


# ---------------------------------------------------------------------------------------------------------------------
# Save and load


def save_checkpoint(
    run_dir: str | os.PathLike, step: int, state: Mapping[str, Any], keep_every: int | None = None
) -> Path:
    """Write `state` (plus step, format, time) to <run>/checkpoints/latest.pt; keep a copy every `keep_every` steps."""
    if keep_every is not None:
        check_positive("keep_every", keep_every)
    if state.get("step", step) != step:
        raise ValueError(f"save_checkpoint(step={step}) was given a state whose step is {state['step']}")
    folder = Path(run_dir) / CHECKPOINTS
    folder.mkdir(parents=True, exist_ok=True)
    full_state = {**state, "step": step, "format": FORMAT_VERSION, "saved_at": utc_now()}
    latest = atomic_write(folder / LATEST, lambda file: torch.save(full_state, file))
    if keep_every is not None and step % keep_every == 0:
        link_copy(latest, folder / checkpoint_name(step))
    return latest


def link_copy(source: Path, target: Path) -> None:
    """Hard-link `source` as `target` (latest.pt as step_XXXXXX.pt, or back), costing no disk. This is safe because
    a save replaces latest.pt by a new file (os.replace), so a linked file is never written to again."""
    temp = target.with_name(f".{target.name}.{os.getpid()}{TEMP_SUFFIX}")
    temp.unlink(missing_ok=True)
    try:
        os.link(source, temp)
    except OSError:  # file systems without hard links
        shutil.copyfile(source, temp)
    os.replace(temp, target)


def kept_checkpoints(run_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    """(step, file) of a run's kept checkpoints/step_XXXXXX.pt, in step order (read from the names)."""
    found = []
    for path in (Path(run_dir) / CHECKPOINTS).glob("step_*.pt"):
        digits = path.stem.removeprefix("step_")
        if digits.isdigit():
            found.append((int(digits), path))
    return sorted(found)


def load_checkpoint(path: str | os.PathLike, map_location: str | torch.device = "cpu", *, mmap: bool = False,
                    what: str = "checkpoint", require: tuple[str, ...] = ()) -> dict[str, Any]:
    """One checkpoint file, loaded without unpickling arbitrary objects (weights_only=True). Anything that is not a
    checkpoint dict raises DataError naming the file and what is wrong with it, never torch's own paragraph (which
    suggests weights_only=False, the one thing a user must not do with a file of unknown origin)."""
    path = Path(path)
    if path.is_dir():
        raise DataError(f"{what} {path} is a directory, not a checkpoint file (e.g. {path / CHECKPOINTS / LATEST})")
    if not path.is_file():
        raise DataError(f"{what} {path} does not exist")
    if not zipfile.is_zipfile(path):
        raise DataError(f"{what} {path} is not a torch checkpoint (not a zip archive: a text file, random bytes, or "
                        "a file cut short)")
    try:
        state = torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except Exception as err:  # UnpicklingError, RuntimeError from a corrupt zip, ...: torch's text is not shown
        raise DataError(f"{what} {path} cannot be loaded safely ({type(err).__name__}): it is corrupt or holds "
                        "objects other than tensors and plain data") from None
    if not isinstance(state, dict):
        raise DataError(f"{what} {path} is not a moe-rl checkpoint: it holds a {type(state).__name__}, not a dict")
    missing = [key for key in require if key not in state]
    if missing:
        raise DataError(f"{what} {path} is not a moe-rl checkpoint: it has no {', '.join(map(repr, missing))} "
                        f"(its keys: {', '.join(sorted(map(str, state))[:8])})")
    return state


def checkpoint_step(run_dir: str | os.PathLike) -> int | None:
    """The step of a run's latest checkpoint, or None without one; memory-mapped, so no tensor is read. DataError,
    naming the file, when it is not a readable checkpoint."""
    path = Path(run_dir) / CHECKPOINTS / LATEST
    if not path.is_file():
        return None
    state = load_checkpoint(path, mmap=True, what="the run's checkpoint", require=("step",))
    return int(state["step"])


def load_latest(run_dir: str | os.PathLike, map_location: str | torch.device = "cpu",
                require: tuple[str, ...] = ("step",)) -> dict[str, Any]:
    """The newest checkpoint of a run; NoCheckpointError, naming the directory, when there is none; DataError when
    it is not a checkpoint holding the keys in `require`."""
    run_dir = Path(run_dir)
    path = run_dir / CHECKPOINTS / LATEST
    if not path.is_file():
        problem = "the directory does not exist" if not run_dir.exists() else f"it has no {CHECKPOINTS}/{LATEST}"
        raise NoCheckpointError(
            f"cannot resume from {run_dir}: {problem}. Resume needs a run that saved a checkpoint; "
            "start a new run without --resume, or check the run name"
        )
    return load_checkpoint(path, map_location, what="the checkpoint to resume from", require=require)


# ---------------------------------------------------------------------------------------------------------------------
# The training state


def training_state(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    scheduler: Any | None = None,
    data_position: Any = None,
    generators: Mapping[str, torch.Generator] | None = None,
) -> dict[str, Any]:
    """Everything a resumed run needs to continue as if it had never stopped (save_checkpoint adds the step)."""
    return {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": None if scheduler is None else scheduler.state_dict(),
        "data_position": data_position,
        "rng": capture_rng_state(generators),
    }


TRAINING_STATE_KEYS = ("model", "optimizer", "scheduler", "rng", "step")  # what restore_training_state reads


def restore_training_state(
    state: Mapping[str, Any],
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    scheduler: Any | None = None,
    generators: Mapping[str, torch.Generator] | None = None,
) -> int:
    """Load a `training_state` into live objects; returns the step it was saved at (state["data_position"] has
    the data position)."""
    try:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
    except (RuntimeError, ValueError, KeyError) as err:  # a missing or mis-shaped weight: name it, not torch's report
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise DataError(f"the checkpoint does not fit this model and optimizer: {first[:300]}") from None
    if scheduler is not None:
        if state["scheduler"] is None:
            raise ValueError("a scheduler was passed, but the checkpoint was saved without one")
        scheduler.load_state_dict(state["scheduler"])
    restore_rng_state(state["rng"], generators)
    return state["step"]


# ---------------------------------------------------------------------------------------------------------------------
# RNG states


def capture_rng_state(generators: Mapping[str, torch.Generator] | None = None) -> dict[str, Any]:
    """The state of every random source a run draws from, including the named generators."""
    return {
        "python": random.getstate(),
        "numpy": _numpy_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        "generators": {name: generator.get_state() for name, generator in (generators or {}).items()},
    }


def restore_rng_state(state: Mapping[str, Any], generators: Mapping[str, torch.Generator] | None = None) -> None:
    """Put every random source back where `capture_rng_state` found it."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    _set_numpy_state(state["numpy"])
    # .cpu(): RNG states must be CPU byte tensors, whatever map_location the checkpoint was loaded with
    torch.set_rng_state(state["torch"].cpu())
    _restore_cuda(state["cuda"])
    _restore_generators(state["generators"], generators or {})


def _numpy_state() -> dict[str, Any]:
    state = np.random.get_state(legacy=False)
    state["state"]["key"] = state["state"]["key"].tolist()  # an ndarray would need weights_only=False to load
    return state


def _set_numpy_state(state: Mapping[str, Any]) -> None:
    inner = {**state["state"], "key": np.asarray(state["state"]["key"], dtype=np.uint32)}
    np.random.set_state({**state, "state": inner})


def _restore_cuda(states: list[torch.Tensor] | None) -> None:
    if states is None:
        return
    if not torch.cuda.is_available():
        warnings.warn("the checkpoint holds CUDA RNG states but CUDA is not available here; they are not restored",
                      stacklevel=2)
        return
    for index in range(min(len(states), torch.cuda.device_count())):
        torch.cuda.set_rng_state(states[index].cpu(), device=index)


def _restore_generators(saved: Mapping[str, torch.Tensor], generators: Mapping[str, torch.Generator]) -> None:
    # Both directions matter: a generator left out would draw different numbers after the resume, silently.
    if set(saved) != set(generators):
        raise ValueError(
            f"the checkpoint has RNG states for generators {sorted(saved)}, but {sorted(generators)} were passed; "
            "pass the same named generators to save and restore"
        )
    for name, generator in generators.items():
        generator.set_state(saved[name].cpu())
