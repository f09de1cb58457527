"""The run directory: everything one training run leaves behind, and the readers analysis uses on it.

    runs/<name>/
      config.json                  the resolved config, exactly what ran (rewritten on resume with the allowed changes)
      manifest.json                where and how it ran, and how it ended (see `RunDir`)
      metrics.jsonl                one JSON object per optimizer step: {"step": 12, "wall_time": ..., "loss": ...}
      routing/step_000012.parquet  per-step, per-layer churn tables
      samples/step_000012.parquet  prompts, completions, rewards of sampled steps
      checkpoints/                 latest.pt and step_000100.pt (written by moe_rl.runs.checkpoint)

Writers, used by the trainer on rank 0 only: `RunDir`, `MetricsWriter` (via `RunDir.open_metrics`), `write_table`.
Readers, used by analysis on a path, no RunDir needed: `read_config`, `read_manifest`, `read_metrics`, `read_tables`.
Neighbours: moe_rl.runs.jsonlog (the metrics.jsonl format, NaN policy), moe_rl.runs.provenance (the manifest's facts),
moe_rl.runs.atomic (every whole-file write), moe_rl.runs.trackers (optional TensorBoard / W&B mirrors).

The trainer's side, in short (checkpoint functions from moe_rl.runs.checkpoint):

    run = RunDir(out_dir, cfg, resume=cfg.resume)
    start = restore_training_state(load_latest(run), model, optimizer, ...) if cfg.resume else 0
    with run, run.open_metrics(resume_from_step=start if cfg.resume else None) as metrics:
        for step in range(start + 1, cfg.total_steps + 1):
            ...
            metrics.write({"loss": loss, ...}, step=step)
            if not math.isfinite(loss):
                run.mark_diverged(f"loss is {loss} at step {step}")
                break
            save_checkpoint(run, step, training_state(model, optimizer, ...), keep_every=100)
"""

from __future__ import annotations

import dataclasses
import enum
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from moe_rl.errors import ConfigError, DataError, check_choice
from moe_rl.runs.atomic import atomic_write, atomic_write_text, remove_stale_temp_files
from moe_rl.runs.checkpoint import LATEST, checkpoint_name
from moe_rl.runs.digest import checkpoint_record, text_sha256
from moe_rl.runs.jsonlog import MetricsWriter, read_jsonl
from moe_rl.runs.provenance import environment, utc_now

if TYPE_CHECKING:  # pandas (0.6 s of start-up) is imported by the table functions, the only ones that use it
    import pandas as pd

    from moe_rl.runs.trackers import Tracker

STATUSES = ("running", "finished", "diverged", "failed", "interrupted")
TABLE_KINDS = ("routing", "samples")
# Config fields that may differ between a run and its resume. An entry with a dot names one field
# ("train.total_steps"); an entry without a dot names a field at any depth. Everything else must match, or the
# resumed run would silently be a different experiment than the one its first half belongs to.
# The step budget, the checkpoint and logging cadence (samples/ tables read no random state), quiet, the early
# warning and the mirrors change no result; out_dir: a run directory may be renamed or moved; resume and resume_from
# say how a run was launched (they are never saved: LAUNCH_FIELDS).
RESUMABLE_FIELDS = ("total_steps", "resume", "resume_from", "checkpoint_every", "keep_every", "log.samples_every",
                    "log.samples_per_step", "log.warn_threshold", "log.warn_metric", "trackers", "out_dir", "quiet",
                    "print_every", "log.wandb.project", "log.wandb.entity", "log.wandb.group", "wandb.project",
                    "wandb.entity", "wandb.group")
# How a run was launched, not what it is: config.json holds their defaults (the resumes are in manifest.json).
LAUNCH_FIELDS = {"resume": False, "resume_from": None}
PATH_FIELDS = ("init_from", "out_dir", "path", "eval_path")  # compared as paths: ./x is x
ABSENT = "<absent>"  # a config field that one of two configs lacks


class RunExistsError(FileExistsError):
    """A new run was started in a directory that already holds one."""


# ---------------------------------------------------------------------------------------------------------------------
# Config


def config_to_dict(config: Any) -> dict[str, Any]:
    """The config as plain JSON data: dataclasses (nested) become dicts, tuples lists, paths and dtypes strings."""
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        config = dataclasses.asdict(config)
    if not isinstance(config, Mapping):
        raise TypeError(f"config must be a dataclass instance or a dict, got {type(config).__name__}")
    # A JSON round trip makes a fresh config comparable with one read back from config.json (tuple == list, ...).
    return json.loads(json.dumps(config, default=_json_default))


def _json_default(value: Any) -> Any:
    """Encode the non-JSON types a config may hold."""
    if isinstance(value, (Path, torch.dtype, torch.device)):
        return str(value)
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    raise TypeError(f"cannot write a {type(value).__name__} to JSON: {value!r}")


def flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"optim": {"lr": 1e-3}} -> {"optim.lr": 1e-3}, so that a difference can be named by its dotted path."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, Mapping) and value:
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def config_differences(old: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
    """{dotted key: (old value, new value)} for every field that differs; a missing field reads as ABSENT."""
    old_flat, new_flat = flatten(old), flatten(new)
    pairs = {key: (old_flat.get(key, ABSENT), new_flat.get(key, ABSENT)) for key in old_flat.keys() | new_flat.keys()}
    return {key: pair for key, pair in sorted(pairs.items()) if not _same(key, *pair)}


def _same(key: str, old: Any, new: Any) -> bool:
    """Equal values; a path field also when it names the same path (./runs/sft vs runs/sft)."""
    if old == new:
        return True
    is_path = key.rsplit(".", 1)[-1] in PATH_FIELDS and isinstance(old, str) and isinstance(new, str)
    return is_path and os.path.normpath(old) == os.path.normpath(new)


def _may_change_on_resume(key: str, allowed: Iterable[str]) -> bool:
    leaf = key.rsplit(".", 1)[-1]
    return any(entry == key or ("." not in entry and entry == leaf) for entry in allowed)


def field_defaults(config: Any) -> dict[str, Any]:
    """{dotted key: default} of a (nested) dataclass config's fields that have a default, as JSON data."""
    defaults: dict[str, Any] = {}
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            defaults.update({f"{field.name}.{k}": v for k, v in field_defaults(value).items()})
        elif field.default is not dataclasses.MISSING:
            defaults[field.name] = field.default
        elif field.default_factory is not dataclasses.MISSING:
            defaults[field.name] = field.default_factory()
    return flatten(json.loads(json.dumps(defaults, default=_json_default)))


def check_resumable(saved: Mapping, new: Mapping, may_change: Iterable[str], where: Path,
                    defaults: Mapping[str, Any] | None = None, roots: tuple[Any, Any] = (None, None),
                    source: str = "its config.json") -> dict[str, tuple]:
    """Refuse to resume when the config changed outside `may_change`; return the changes that are allowed. A field
    that the saved config lacks and the new one holds at its default (`defaults`) is one added to moe-rl since the
    run started: the run ran with that default's behaviour, so it is no change. `roots` are the run directories
    the two configs were written for: an absolute path inside a run's parent that moved with it (a sweep's warm
    start) is the same path. One line, naming each field that differs."""
    may_change = tuple(may_change)
    differences = config_differences(saved, new)
    defaults = defaults or {}
    added = {key for key, (old, value) in differences.items()
             if old == ABSENT and key in defaults and _same(key, defaults[key], value)}
    refused = {key: pair for key, pair in differences.items()
               if not _may_change_on_resume(key, may_change) and key not in added
               and not _same_place(key, *pair, roots)}
    if refused:
        shown = "; ".join(f"{key}: the run has {_short(old)}, this command {_short(value)}"
                          for key, (old, value) in refused.items())
        raise ConfigError(
            f"cannot resume {where}: the config differs from {source} in {', '.join(refused)} ({shown}); a resume may "
            "change only the step budget, the checkpoint and logging cadence, quiet and the trackers: restore the "
            "config, or start a new run (another --out-dir) from the run's checkpoint with --init-from "
            f"{Path(where) / 'checkpoints' / 'latest.pt'}"
        )
    return differences


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _same_place(key: str, old: Any, new: Any, roots: tuple[Any, Any]) -> bool:
    """Two absolute paths that lie at the same place relative to their configs' run directories: a run directory
    moved or copied together with what it points at (a sweep directory with its warm starts)."""
    old_root, new_root = roots
    if key.rsplit(".", 1)[-1] not in PATH_FIELDS or not all(isinstance(v, str) and os.path.isabs(v)
                                                           for v in (old, new, old_root, new_root)):
        return False
    return os.path.relpath(old, old_root) == os.path.relpath(new, new_root)


def experiment_record(config: Mapping[str, Any], run_dir: Path, may_change: Iterable[str] = RESUMABLE_FIELDS) \
        -> dict[str, Any]:
    """manifest.json `experiment`: the config's fields that a resume may not change (flat, dotted), their sha256,
    and the absolute run directory they were written for. A resume is checked against it, not against config.json,
    which a hand edit could have changed."""
    may_change = tuple(may_change)
    fields = {key: value for key, value in flatten(config).items() if not _may_change_on_resume(key, may_change)}
    return {"sha256": text_sha256(json.dumps(fields, sort_keys=True)), "out_dir": str(Path(run_dir).absolute()),
            "config": fields}


def without_launch_fields(config: dict[str, Any]) -> dict[str, Any]:
    """The config with resume and resume_from at their defaults: what ran, not how it was last launched."""
    return {**config, **{k: v for k, v in LAUNCH_FIELDS.items() if k in config}}


def _find_seed(config: Mapping[str, Any]) -> Any:
    """The config's one field named `seed`, at any depth; None when there is none or more than one."""
    seeds = [value for key, value in flatten(config).items() if key.rsplit(".", 1)[-1] == "seed"]
    return seeds[0] if len(seeds) == 1 else None


# ---------------------------------------------------------------------------------------------------------------------
# The run directory


class RunDir:
    """One run's directory. Creating it starts the run (or, with resume=True, continues it) and marks it running.

    manifest.json holds: name, status (running | finished | diverged | failed | interrupted), reason, started_at,
    ended_at (UTC ISO), seed, host, device, world_size (data-parallel ranks), command (sys.argv), git {sha, dirty},
    packages {name: version}, interrupted {signal, at_step, resumes_from_step} while the status is interrupted, inputs
    {name: {what, sha256}} (the task data), checkpoints {file name: {step, sha256, metrics {lines, last_step, sha256}}},
    and resumes: one entry per resume with its time, host, device, world size, command, git, the config changes it made
    ({key: [old, new]}), how the run had ended before it (previous) and the checkpoint it continued from (from).

    Use it as a context manager to mark the run failed on an exception and finished on a normal exit. Only one
    process (rank 0) may hold a RunDir for a path.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        config: Any,
        *,
        resume: bool = False,
        seed: int | None = None,
        device: str | torch.device | None = None,
        may_change_on_resume: Sequence[str] = RESUMABLE_FIELDS,
        kind: str | None = None,
    ):
        self.path = Path(path)
        self.kind = kind
        self.defaults = field_defaults(config) if dataclasses.is_dataclass(config) else {}
        self.config = without_launch_fields(config_to_dict(config))
        self.config_path = self.path / "config.json"
        self.manifest_path = self.path / "manifest.json"
        self.metrics_path = self.path / "metrics.jsonl"
        self.checkpoints_dir = self.path / "checkpoints"
        if resume:
            self.manifest = self._continue_run(device, may_change_on_resume)
        else:
            self.manifest = self._start_run(seed, device, may_change_on_resume)
        self.mark_running()

    def __fspath__(self) -> str:
        return str(self.path)

    def _start_run(self, seed: int | None, device: str | torch.device | None,
                   may_change: Sequence[str]) -> dict[str, Any]:
        existing = self._run_files()
        if existing:
            raise RunExistsError(
                f"{self.path} already holds a run ({', '.join(existing)}); "
                "pass --resume to continue it, or choose a new run name"
            )
        seed = _find_seed(self.config) if seed is None else seed
        started = {"status": "running", "reason": None, "started_at": utc_now(), "ended_at": None}
        kind = {"kind": self.kind} if self.kind else {}
        self.manifest = {"name": self.path.name, **kind, **started, "seed": seed, **environment(device),
                         "experiment": experiment_record(self.config, self.path, may_change), "resumes": []}
        # The manifest first: a directory with any other file of the run in it is then known to be a run's
        # (moe_rl.runs.claim refuses a non-empty directory without one).
        self.path.mkdir(parents=True, exist_ok=True)
        self._write_manifest()
        self._make_folders()
        self.metrics_path.touch()
        atomic_write_text(self.config_path, json.dumps(self.config, indent=2) + "\n")
        return self.manifest

    def _continue_run(self, device: str | torch.device | None, may_change: Sequence[str]) -> dict[str, Any]:
        if not self.config_path.exists():
            raise FileNotFoundError(f"nothing to resume in {self.path}: it has no config.json; start a new run instead")
        # Both files are read and checked before either is written: a resume that is refused changes nothing.
        saved = read_config(self.path)
        manifest = read_manifest(self.path)
        here = str(self.path.absolute())
        recorded = manifest.get("experiment")
        if isinstance(recorded, dict) and isinstance(recorded.get("config"), dict):
            # The config the run ran with (config.json may have been edited by hand since).
            check_resumable(recorded["config"], self.config, may_change, self.path, self.defaults,
                            roots=(recorded.get("out_dir"), here), source="the one it ran with (manifest.json)")
            changed = {key: pair for key, pair in config_differences(saved, self.config).items()
                       if _may_change_on_resume(key, may_change)}
        else:  # a run from before the record was kept: its config.json
            changed = check_resumable(saved, self.config, may_change, self.path, self.defaults,
                                      roots=(saved.get("out_dir"), here))
            manifest["experiment"] = experiment_record(self.config, self.path, may_change)
        if self.kind and "kind" not in manifest:
            manifest["kind"] = self.kind
        remove_stale_temp_files(self.path)  # the process that left them is dead: we are resuming its run
        self._make_folders()
        atomic_write_text(self.config_path, json.dumps(self.config, indent=2) + "\n")
        previous = {key: manifest.get(key)
                    for key in ("status", "reason", "ended_at", "interrupted") if key in manifest}
        entry = {"at": utc_now(), **environment(device), "changed": {k: list(v) for k, v in changed.items()},
                 "previous": previous}
        manifest.setdefault("resumes", []).append(entry)
        return manifest

    def _run_files(self) -> list[str]:
        """The files whose presence means a run already lives here."""
        found = [self.metrics_path] if self.metrics_path.exists() else []
        if self.checkpoints_dir.is_dir():
            found += sorted(p for p in self.checkpoints_dir.iterdir() if not p.name.startswith("."))
        return [str(p.relative_to(self.path)) for p in found]

    def _make_folders(self) -> None:
        for folder in (self.checkpoints_dir, *(self.path / kind for kind in TABLE_KINDS)):
            folder.mkdir(parents=True, exist_ok=True)

    # -- status ---------------------------------------------------------------------------------------------------

    @property
    def status(self) -> str:
        return self.manifest["status"]

    def mark_running(self) -> None:
        """Mark the run as in progress (done on creation and on resume)."""
        self.manifest.update(status="running", reason=None, ended_at=None)
        self.manifest.pop("interrupted", None)  # kept in the resume's entry (`previous`)
        self._write_manifest()

    def mark_finished(self, reason: str | None = None) -> None:
        self._end("finished", reason)

    def mark_diverged(self, reason: str) -> None:
        """A NaN or Inf in the loss or gradients; `reason` says which value and at which step."""
        self._end("diverged", reason)

    def mark_failed(self, reason: str) -> None:
        self._end("failed", reason)

    def mark_interrupted(self, signal_name: str, step: int, resumes_from: int | None) -> None:
        """SIGINT or SIGTERM (moe_rl.runs.interrupt) ended the run after `step` steps; a resume continues from the
        checkpoint at `resumes_from` (None: there is none, the run starts over)."""
        if self.status == "running":
            self.manifest["interrupted"] = {"signal": signal_name, "at_step": step, "resumes_from_step": resumes_from}
        self._end("interrupted", f"{signal_name} at step {step}")

    def _end(self, status: str, reason: str | None) -> None:
        check_choice("status", status, STATUSES)
        # The first ending is the true one: a run that diverged and then left its loop normally stays diverged.
        if self.status != "running":
            return
        self.manifest.update(status=status, reason=reason, ended_at=utc_now())
        self._write_manifest()

    def record_checkpoint(self, step: int) -> None:
        """Keep in the manifest the hash of the checkpoint just saved at `step` and of the metrics before it
        (moe_rl.runs.digest), under latest.pt and, when kept, its step_XXXXXX.pt (a hard link: hashed once)."""
        latest = self.checkpoints_dir / LATEST
        record = checkpoint_record(self.path, latest, step)
        records = {LATEST: record}
        kept = self.checkpoints_dir / checkpoint_name(step)
        if kept.is_file():
            records[kept.name] = record if kept.samefile(latest) else checkpoint_record(self.path, kept, step)
        self.manifest.setdefault("checkpoints", {}).update(records)
        self._write_manifest()

    def record_warning(self, event: dict) -> None:
        """Keep the early warning's event (moe_rl.runs.warning) in the manifest, so a resume does not warn again."""
        self.manifest["early_warning"] = event
        self._write_manifest()

    def _write_manifest(self) -> None:
        atomic_write_text(self.manifest_path, json.dumps(self.manifest, indent=2) + "\n")

    def __enter__(self) -> RunDir:
        return self

    def __exit__(self, exc_type, exc, traceback) -> bool:
        if exc is None:
            self.mark_finished()
        elif isinstance(exc, KeyboardInterrupt):  # a signal outside the training loop, which notes its own
            self._end("interrupted", f"{exc or 'SIGINT'} during set-up or teardown")
        else:
            self.mark_failed(f"{exc_type.__name__}: {exc}")
        return False

    # -- writers ----------------------------------------------------------------------------------------------------

    def open_metrics(self, *, resume_from_step: int | None = None, trackers: Iterable[Tracker] = (),
                     tracker_step_key: str | None = None) -> MetricsWriter:
        """The metrics writer; on resume, also drops the routing and sample tables logged after the checkpoint."""
        if resume_from_step is not None:
            prune_tables(self.path, after_step=resume_from_step)
        return MetricsWriter(self.metrics_path, resume_from_step=resume_from_step, trackers=trackers,
                             tracker_step_key=tracker_step_key)


# ---------------------------------------------------------------------------------------------------------------------
# Readers


def resume_command(run_dir: str | os.PathLike, world_size: int = 1) -> str:
    """The command that continues the run in `run_dir` from its last checkpoint, with as many ranks as it had."""
    import shlex

    config = shlex.quote(str(Path(run_dir).absolute() / "config.json"))
    launcher = "moe-rl train" if world_size == 1 else \
        f"torchrun --standalone --nproc_per_node={world_size} -m moe_rl.cli train"
    return f"{launcher} --config-file {config} --resume"


def read_metrics(run_or_file: str | os.PathLike) -> list[dict[str, Any]]:
    """The metrics of a run, given its directory or its metrics.jsonl."""
    path = Path(run_or_file)
    return read_jsonl(path / "metrics.jsonl" if path.is_dir() else path)


def read_config(run_dir: str | os.PathLike) -> dict[str, Any]:
    return read_json_object(Path(run_dir) / "config.json", "the run's config")


def read_manifest(run_dir: str | os.PathLike) -> dict[str, Any]:
    return read_json_object(Path(run_dir) / "manifest.json", "the run's manifest")


def read_json_object(path: Path, what: str) -> dict[str, Any]:
    """A JSON object from `path`; DataError naming the file (and line) when it is cut short, not JSON or not an object
    (FileNotFoundError when it is missing)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as err:
        raise DataError(f"{path} is not UTF-8 text ({err.reason}); it should hold {what}") from None
    except json.JSONDecodeError as err:
        raise DataError(f"{path}:{err.lineno}: not valid JSON ({err.msg}): cut short or edited? It should hold {what}; "
                        "restore it from a copy") from None
    if not isinstance(data, dict):
        raise DataError(f"{path} holds a JSON {type(data).__name__}, not {what} (an object); restore it from a copy")
    return data


# ---------------------------------------------------------------------------------------------------------------------
# Parquet tables: routing/ and samples/


def table_path(run_dir: str | os.PathLike, kind: str, step: int) -> Path:
    check_choice("table kind", kind, TABLE_KINDS)
    return Path(run_dir) / kind / f"step_{step:06d}.parquet"


def write_table(run_dir: str | os.PathLike, kind: str, step: int, rows: Sequence[Mapping] | pd.DataFrame) -> Path:
    """Atomically write one step's rows to <run>/<kind>/step_XXXXXX.parquet, with a `step` column added."""
    import pandas as pd

    path = table_path(run_dir, kind, step)
    frame = pd.DataFrame(rows).copy()
    if "step" not in frame.columns:
        frame.insert(0, "step", step)
    elif (frame["step"] != step).any():
        raise DataError(f"{path}: rows carry steps other than {step}")
    path.parent.mkdir(parents=True, exist_ok=True)
    return atomic_write(path, lambda file: frame.to_parquet(file, index=False))


def _table_files(run_dir: str | os.PathLike, kind: str) -> list[tuple[int, Path]]:
    """(step, file) of one kind of table, in step order."""
    check_choice("table kind", kind, TABLE_KINDS)
    files = (Path(run_dir) / kind).glob("step_*.parquet")
    return sorted((int(path.stem.removeprefix("step_")), path) for path in files)


def read_tables(run_dir: str | os.PathLike, kind: str) -> pd.DataFrame:
    """All of a run's tables of one kind, concatenated in step order; an empty frame when there are none."""
    import pandas as pd

    frames = [_read_table(path) for _, path in _table_files(run_dir, kind)]
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def _read_table(path: Path) -> pd.DataFrame:
    import pandas as pd

    try:
        return pd.read_parquet(path)
    except Exception as err:  # pyarrow's ArrowInvalid and OSError for a cut-short or foreign file
        raise DataError(f"{path} cannot be read as Parquet ({type(err).__name__}): cut short or not a table written "
                        "by moe-rl; delete it, or restore it from a copy") from None


def prune_tables(run_dir: str | os.PathLike, after_step: int) -> list[Path]:
    """Delete the tables of steps after `after_step` (a resumed run writes those steps again)."""
    removed = [path for kind in TABLE_KINDS for step, path in _table_files(run_dir, kind) if step > after_step]
    for path in removed:
        path.unlink()
    return removed
