"""Provenance for manifest.json: when, where, on what device and from which code and packages a run ran.

Every function here tolerates what a laptop, a container or a cluster node may lack (no git, no CUDA, a package that
is not installed) by reporting None instead of failing: a missing fact must never stop a run from starting.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import socket
import subprocess
import sys
from collections.abc import Iterable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

# The packages whose version can change a result; python and CUDA are always recorded.
VERSIONED_PACKAGES = (
    "moe-rl", "torch", "numpy", "pandas", "pyarrow", "transformers", "datasets", "reasoning-gym", "tyro",
)


def utc_now() -> str:
    """The current time as UTC ISO 8601, e.g. 2025-07-24T09:30:00+00:00."""
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def git_state(folder: str | os.PathLike, ignore: Iterable[str] = ()) -> dict[str, Any]:
    """{"sha", "dirty"} of the git checkout holding `folder`; both None outside git or where git is missing.

    Untracked files count as dirty: a new module that was never committed can change what ran. `ignore` names
    top-level paths whose changes do not count (a report's own output folder, say).
    """
    sha = _git(folder, "rev-parse", "HEAD")
    if sha is None:
        return {"sha": None, "dirty": None}
    pathspec = ["--", ":/", *(f":(top,exclude){path}" for path in ignore)] if ignore else []
    status = _git(folder, "status", "--porcelain", *pathspec)
    return {"sha": sha, "dirty": None if status is None else bool(status)}


def _git(folder: str | os.PathLike, *args: str) -> str | None:
    try:
        done = subprocess.run(
            ["git", "-C", str(folder), *args], capture_output=True, text=True, timeout=10, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip()


def package_versions(names: Iterable[str] = VERSIONED_PACKAGES) -> dict[str, str | None]:
    """Installed versions of python and of `names`; None for a package that is not installed."""
    versions: dict[str, str | None] = {"python": platform.python_version(), "cuda": torch.version.cuda}
    for name in names:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def describe_device(device: str | torch.device | None = None) -> str:
    """"cpu" or "cuda:0 (NVIDIA H200)"; with no device given, the one a run would pick."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type != "cuda":
        return str(device)
    index = torch.cuda.current_device() if device.index is None else device.index
    return f"cuda:{index} ({torch.cuda.get_device_name(index)})"


# Facts that packages above this floor add to every CPU run's manifest: name -> fact(). moe_rl.kernels registers
# "kernels" (the CPU, its caps and the path each kernel family takes) when it is imported.
CPU_FACTS: dict[str, Any] = {}


def environment(device: str | torch.device | None) -> dict[str, Any]:
    """What may differ between a run and its resume: machine, device, code version, command line, and on CPU the
    kernel paths (CPU_FACTS)."""
    facts = {
        "host": socket.gethostname(),
        "device": describe_device(device),
        "world_size": _world_size(),
        "command": list(sys.argv),
        "git": git_state(Path(__file__).parent),
        "packages": package_versions(),
    }
    if describe_device(device) == "cpu":
        facts.update({name: fact() for name, fact in CPU_FACTS.items()})
    return facts


def _world_size() -> int:
    """Data-parallel ranks (torchrun processes) of the run; 1 without a process group."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
