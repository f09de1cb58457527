"""Errors that name what is wrong: the config field, the data file and line, the routing layer."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable


class ConfigError(ValueError):
    """A config value is invalid. The message names the field and what is allowed."""


class DataError(ValueError):
    """A data file is malformed. The message names the file and, where known, the line."""


class RoutingError(ValueError):
    """A routing trace does not fit the model it is replayed on. The message names the layer."""


class EngineFailed(RuntimeError):
    """The rollout engine failed mid-run (a vLLM engine that died, ran out of memory, lost a worker): the message
    names the engine, the rollout step and the command that resumes the run from its last checkpoint. Not a user
    error: `moe-rl train` prints it as one line, marks the run failed and exits with status 1."""


class DiskFullError(OSError):
    """The file system ran out of space while a file was written: `str()` is "no space left on device while saving
    <file>" (the file is the one that was being replaced; the old one, if any, is intact)."""

    def __init__(self, path) -> None:
        import errno

        super().__init__(errno.ENOSPC, f"no space left on device while saving {path}")
        self.path = str(path)

    def __str__(self) -> str:
        return self.strerror


# Errors that are the user's input, not a bug: printed as one line, exit status 2. FileNotFoundError covers a missing
# data file and a resume with nothing to resume; FileExistsError a run directory that is already used.
USER_ERRORS = (ConfigError, DataError, RoutingError, FileNotFoundError, FileExistsError)


def check_choice(field: str, value: object, allowed: Iterable[object]) -> None:
    """Refuse `value` for `field` unless it is one of `allowed`, listing the valid choices."""
    allowed = list(allowed)
    if value not in allowed:
        choices = ", ".join(repr(a) for a in allowed)
        raise ConfigError(f"{field}={value!r} is not valid; choose one of: {choices}")


def check_finite(field: str, value: float) -> None:
    """Refuse NaN and +-Inf for `field`: every comparison with NaN is False, so a NaN would pass any bound check
    and silently turn a feature off (`grad_clip > 0`) or surface much later as a divergence of the model."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{field}={value!r} must be a finite number")


def check_finite_fields(config: object, prefix: str = "") -> None:
    """check_finite on every float field of a (nested) config dataclass, named by its dotted path (optim.lr):
    the one place that keeps NaN and Inf out of every command's config."""
    for f in dataclasses.fields(config):
        value, name = getattr(config, f.name), f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            check_finite_fields(value, f"{name}.")
        for item in value if isinstance(value, (tuple, list)) else (value,):
            check_finite(name, item)


def check_positive(field: str, value: float, *, allow_zero: bool = False) -> None:
    """Refuse a negative (or, unless `allow_zero`, a zero) value for `field`, and NaN or Inf."""
    check_finite(field, value)
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ConfigError(f"{field}={value!r} must be {bound}")
