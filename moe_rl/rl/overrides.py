"""Dotted overrides of nested config dataclasses: `optim.lr=3e-4` on a TrainConfig, typed by the field's annotation.

    with_overrides(cfg, {"optim.lr": "3e-4", "routing_mode": "R2"})   # strings are parsed; typed values checked
    field_paths(TrainConfig)                                          # ["out_dir", ..., "optim.lr", ...]
    from_dict(TrainConfig, json.load(...))                            # rebuild a config from its config.json
    read_config_file("runs/x/config.json")                            # a JSON or YAML mapping, errors with its line

Every new config goes through its dataclass constructor again, so `__post_init__` validates the combination.
An unknown field is named with its nearest matches. Used by `moe-rl sweep --set` and by the sweep grids.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from collections.abc import Iterable, Mapping
from typing import Annotated, Any, Literal, Union

import tyro

from moe_rl.errors import ConfigError

NONE_WORDS = ("none", "null")
TRUE_WORDS, FALSE_WORDS = ("true", "1", "yes"), ("false", "0", "no")


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _is_dataclass_type(hint: Any) -> bool:
    return isinstance(hint, type) and dataclasses.is_dataclass(hint)


def field_paths(cls: type, prefix: str = "") -> list[str]:
    """Every leaf field of a (nested) config dataclass as a dotted path, in declaration order."""
    hints, paths = _hints(cls), []
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        paths += field_paths(hint, f"{prefix}{f.name}.") if _is_dataclass_type(hint) else [f"{prefix}{f.name}"]
    return paths


def get_field(cfg: Any, path: str) -> Any:
    for part in path.split("."):
        cfg = getattr(cfg, part)
    return cfg


def unknown_field_error(path: str, cls: type, what: str = "") -> ConfigError:
    """A ConfigError naming `path` and the nearest existing fields of `cls`."""
    known = field_paths(cls)
    group, _, leaf = path.rpartition(".")
    same_leaf = [p for p in known if p.rsplit(".", 1)[-1] == leaf]
    siblings = [p for p in known if p.rpartition(".")[0] == group]
    near_leaf = difflib.get_close_matches(leaf, [p.rsplit(".", 1)[-1] for p in siblings], n=3, cutoff=0.3)
    near_path = difflib.get_close_matches(path, known, n=3, cutoff=0.6)
    near = list(dict.fromkeys(same_leaf + [f"{group}.{n}" if group else n for n in near_leaf] + near_path))[:3]
    hint = f"; did you mean {', '.join(near)}?" if near else "; no field has a similar name"
    return ConfigError(f"{what}{path!r} is not a field of {cls.__name__}{hint}")


def with_overrides(cfg: Any, overrides: Mapping[str, Any], what: str = "") -> Any:
    """A copy of `cfg` with each dotted field set; string values are parsed by the field's type.
    `what` prefixes error messages (e.g. "--set ")."""
    known = set(field_paths(type(cfg)))
    for path in overrides:
        if path not in known:
            group = [p for p in known if p.startswith(f"{path}.")]
            if group:
                raise ConfigError(f"{what}{path!r} is a group of fields; set one of them, e.g. {sorted(group)[0]}")
            raise unknown_field_error(path, type(cfg), what)
    try:
        return _apply(cfg, overrides, prefix="")
    except ConfigError as err:
        raise ConfigError(f"{what}{err}") from None


def _apply(cfg: Any, overrides: Mapping[str, Any], prefix: str) -> Any:
    grouped: dict[str, dict[str, Any]] = {}
    for path, value in overrides.items():
        head, _, rest = path.partition(".")
        grouped.setdefault(head, {})[rest] = value
    hints, changes = _hints(type(cfg)), {}
    for head, sub in grouped.items():
        if _is_dataclass_type(hints[head]):
            changes[head] = _apply(getattr(cfg, head), sub, f"{prefix}{head}.")
        else:
            changes[head] = coerce(sub[""], hints[head], f"{prefix}{head}")
    try:
        return dataclasses.replace(cfg, **changes)
    except ConfigError as err:
        raise ConfigError(f"{prefix.rstrip('.')}: {err}" if prefix else str(err)) from None


# ---------------------------------------------------------------------------------------------------------------------
# Values


def coerce(value: Any, hint: Any, field: str) -> Any:
    """`value` as the type `hint` describes; a string is parsed ("3e-4", "true", "none", "a,b", "update:4")."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (Union, types.UnionType):
        if type(None) in args and (value is None or (isinstance(value, str) and value.lower() in NONE_WORDS)):
            return None
        members = [a for a in args if a is not type(None)]
        errors = []
        for member in members:
            try:
                return coerce(value, member, field)
            except ConfigError as err:
                errors.append(str(err))
        raise ConfigError(errors[0])
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{field}={value!r} is not valid; choose one of: {', '.join(map(repr, args))}")
        return value
    if origin is tuple:
        return _coerce_tuple(value, args, field)
    if origin is dict:
        return _coerce_dict(value, args, field)
    if hint in (bool, int, float, str):
        return _coerce_scalar(value, hint, field)
    return value


def _coerce_scalar(value: Any, hint: type, field: str) -> Any:
    if isinstance(value, str) and hint is not str:
        return _parse_scalar(value, hint, field)
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if type(value) is not hint:
        raise ConfigError(f"{field}={value!r} must be of type {hint.__name__}, not {type(value).__name__}")
    return value


def _parse_scalar(text: str, hint: type, field: str) -> Any:
    if hint is bool:
        if text.lower() in TRUE_WORDS + FALSE_WORDS:
            return text.lower() in TRUE_WORDS
        raise ConfigError(f"{field}={text!r} must be true or false")
    try:
        return hint(text)
    except ValueError:
        raise ConfigError(f"{field}={text!r} is not a valid {hint.__name__}") from None


def _coerce_tuple(value: Any, args: tuple, field: str) -> tuple:
    if isinstance(value, str):
        value = [part.strip() for part in value.split(",") if part.strip()]
    if not isinstance(value, (list, tuple)):
        raise ConfigError(f"{field}={value!r} must be a list (comma-separated on the command line)")
    item = args[0] if args else Any
    return tuple(coerce(v, item, field) for v in value)


def _coerce_dict(value: Any, args: tuple, field: str) -> dict:
    if isinstance(value, str):
        pairs = [part.split(":", 1) for part in value.split(",") if part.strip()]
        if any(len(pair) != 2 for pair in pairs):
            raise ConfigError(f"{field}={value!r} must read key:value,key:value")
        value = {k.strip(): v.strip() for k, v in pairs}
    if not isinstance(value, Mapping):
        raise ConfigError(f"{field}={value!r} must be a mapping (key:value,... on the command line)")
    key_hint, value_hint = args if args else (Any, Any)
    return {coerce(k, key_hint, field): coerce(v, value_hint, field) for k, v in value.items()}


Assignments = Annotated[tuple[tuple[str, ...], ...], tyro.conf.UseAppendAction]
"""A key=value option that may be given several times, each with one or more items (`--arg axes=lr --arg seeds=5`
is `--arg axes=lr seeds=5`): every use is kept, where a plain tuple option keeps only the last."""


def parse_assignments(items: Iterable[str | Iterable[str]], what: str = "--set") -> dict[str, str]:
    """["optim.lr=3e-4", "seed=1"] -> {"optim.lr": "3e-4", "seed": "1"}; the items of a repeated option
    (Assignments: one tuple per use) count as one list. A malformed item, or a key given twice, is named. Keys may
    be spelled as the train flags spell them: "--optim.warmup-steps=5" is "optim.warmup_steps"."""
    parsed: dict[str, str] = {}
    for item in _flat(items):
        key, sep, value = item.partition("=")
        key = key.strip().removeprefix("--").replace("-", "_")
        if not sep or not key:
            raise ConfigError(f"{what} {item!r} must read key=value (e.g. optim.lr=3e-4)")
        if key in parsed and parsed[key] != value.strip():
            raise ConfigError(f"{what} gives {key} twice ({parsed[key]} and {value.strip()}); give it once")
        parsed[key] = value.strip()
    return parsed


def _flat(items: Iterable[str | Iterable[str]]) -> list[str]:
    return [item for entry in items for item in ([entry] if isinstance(entry, str) else entry)]


# ---------------------------------------------------------------------------------------------------------------------
# Rebuilding a config from JSON


def from_dict(cls: type, data: Mapping[str, Any]) -> Any:
    """The config dataclass `cls` from its JSON form (config_to_dict's output): lists become tuples where the field
    is a tuple, nested dicts become nested configs, and every constructor validates again."""
    hints, kwargs = _hints(cls), {}
    names = {f.name for f in dataclasses.fields(cls)}
    for key, value in data.items():
        if key not in names:
            raise unknown_field_error(key, cls)
        hint = hints[key]
        if not _is_dataclass_type(hint):
            kwargs[key] = coerce(value, hint, key)
            continue
        if not isinstance(value, Mapping):  # `rollout: 5`, `rollout: null`, `optim: [1, 2]`
            raise ConfigError(f"{key!r} is a group of fields ({hint.__name__}): it needs a mapping such as "
                              f"{{{field_paths(hint)[0].split('.')[0]}: ...}}, not {type(value).__name__} {value!r}")
        kwargs[key] = from_dict(hint, value)
    return cls(**kwargs)


def read_config_file(path: str, flag: str = "--config-file") -> dict:
    """A JSON (.json) or YAML (anything else; YAML also reads JSON) mapping; ConfigError naming `flag`, the file and
    the line."""
    import json

    import yaml

    try:
        with open(path, encoding="utf-8") as file:
            text = file.read()
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"{flag} {path}: cannot be read ({type(err).__name__}: {err.args[-1]})") from None
    try:
        data = json.loads(text) if path.endswith(".json") else yaml.safe_load(text)
    except json.JSONDecodeError as err:
        raise ConfigError(f"{flag} {path}:{err.lineno}: not valid JSON ({err.msg})") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f":{mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"{flag} {path}{where}: not valid YAML ({getattr(err, 'problem', None) or err})") \
            from None
    if not isinstance(data, dict):
        raise ConfigError(f"{flag} {path}: expected a mapping of config fields, got {type(data).__name__}")
    return data
