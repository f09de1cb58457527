"""Errors that name what is wrong: the config field, the data file and line, the routing layer."""

from __future__ import annotations

from collections.abc import Iterable


class ConfigError(ValueError):
    """A config value is invalid. The message names the field and what is allowed."""


class DataError(ValueError):
    """A data file is malformed. The message names the file and, where known, the line."""


class RoutingError(ValueError):
    """A routing trace does not fit the model it is replayed on. The message names the layer."""


# Errors that are the user's input, not a bug: printed as one line, exit status 2. FileNotFoundError covers a missing
# data file and a resume with nothing to resume; FileExistsError a run directory that is already used.
USER_ERRORS = (ConfigError, DataError, RoutingError, FileNotFoundError, FileExistsError)


def check_choice(field: str, value: object, allowed: Iterable[object]) -> None:
    """Refuse `value` for `field` unless it is one of `allowed`, listing the valid choices."""
    allowed = list(allowed)
    if value not in allowed:
        choices = ", ".join(repr(a) for a in allowed)
        raise ConfigError(f"{field}={value!r} is not valid; choose one of: {choices}")


def check_positive(field: str, value: float, *, allow_zero: bool = False) -> None:
    """Refuse a negative (or, unless `allow_zero`, a zero) value for `field`."""
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ConfigError(f"{field}={value!r} must be {bound}")
