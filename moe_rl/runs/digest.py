"""Content hashes that let a resume verify what it continues (manifest.json `inputs` and `checkpoints`).

    file_sha256("data/train.jsonl")           a file's bytes
    metrics_digest(run_dir, before_step=4)    {"lines", "last_step", "sha256"} of the metrics.jsonl lines of steps < 4
    check_resumable_dir(run_dir, step, manifest, checkpoint)   refuse a resume whose past is gone or changed

A checkpoint at step s holds the state after steps 0 .. s-1, so the metrics it belongs to are the lines of those
steps; a resume drops the others and logs them again. The checks here read files only: a refused resume leaves the
directory as it was.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

from moe_rl.errors import ConfigError
from moe_rl.runs.checkpoint import LATEST
from moe_rl.runs.jsonlog import complete_lines

METRICS = "metrics.jsonl"


def file_sha256(path: str | os.PathLike) -> str:
    with open(path, "rb") as file:
        return hashlib.file_digest(file, "sha256").hexdigest()


def text_sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def metrics_digest(run_dir: str | os.PathLike, before_step: int) -> dict[str, Any] | None:
    """The complete metrics.jsonl lines of steps < `before_step`: how many, the last step among them and the hash of
    their text (each line as written, newline-terminated). None when the file does not exist."""
    path = Path(run_dir) / METRICS
    if not path.is_file():
        return None
    kept = [(line, record["step"]) for line, record in complete_lines(path)
            if isinstance(record.get("step"), int) and record["step"] < before_step]
    last = max((step for _, step in kept), default=None)
    return {"lines": len(kept), "last_step": last, "sha256": text_sha256("".join(line + "\n" for line, _ in kept))}


def check_resumable_dir(run_dir: Path, step: int, manifest: dict[str, Any], checkpoint: Path) -> None:
    """Refuse to continue `run_dir` from `checkpoint` (at `step`) when it is not the file the run saved under that
    name, or when the metrics of the steps before it are missing, shorter or changed (manifest `checkpoints`). A run
    without records (from before they were kept) is checked for missing and short metrics only."""
    fresh = f"start a new run (another --out-dir) from it with --init-from {checkpoint}"
    last = _last_saved_step(manifest)
    if checkpoint.name == LATEST and last is not None and last > step:
        raise ConfigError(f"cannot resume {run_dir}: {checkpoint} is at step {step}, but the run saved step {last} "
                          f"last (manifest.json): it was replaced by an older file. Put the newest back, or {fresh}")
    if last is not None and step > last:  # newer than every save the run recorded: its own only if a kill came
        metrics = metrics_digest(run_dir, step)  # between the save and its record, after the step's metrics
        logged = None if metrics is None else metrics["last_step"]
        if logged is None or logged < step - 1:
            held = "no step" if logged is None else f"steps up to {logged}"
            raise ConfigError(f"cannot resume {run_dir}: {checkpoint} is at step {step}, but the run saved checkpoints "
                              f"up to step {last} (manifest.json) and logged {held} ({METRICS}): it is not this "
                              f"run's checkpoint (copied from another run?). Put the run's own file back, or {fresh}")
    saved = _saved_record(manifest, checkpoint.name, step)
    if saved.get("sha256") not in (None, file_sha256(checkpoint)):
        raise ConfigError(f"cannot resume {run_dir}: {checkpoint} is not the checkpoint this run saved at step {step} "
                          f"(its sha256 differs from the manifest's); put the run's own file back, or {fresh}")
    if step > 0:
        _check_metrics(run_dir, step, saved.get("metrics"), fresh)


def _saved_record(manifest: dict[str, Any], name: str, step: int) -> dict[str, Any]:
    """The manifest's record of checkpoint `name` if it was saved at `step` (an older one was overwritten), else {}.
    A kill between a save and its record leaves a newer checkpoint than the record: it is then not checked."""
    records = manifest.get("checkpoints")
    record = records.get(name) if isinstance(records, dict) else None
    return record if isinstance(record, dict) and record.get("step") == step else {}


def _last_saved_step(manifest: dict[str, Any]) -> int | None:
    records = manifest.get("checkpoints")
    steps = [r.get("step") for r in records.values() if isinstance(r, dict)] if isinstance(records, dict) else []
    return max((s for s in steps if isinstance(s, int)), default=None)


def _check_metrics(run_dir: Path, step: int, recorded: dict[str, Any] | None, fresh: str) -> None:
    metrics = metrics_digest(run_dir, step)
    if metrics is None:
        raise ConfigError(f"cannot resume {run_dir}: {METRICS} is missing, but the checkpoint is at step {step}: "
                          f"steps 0-{step - 1} would have no metrics. Restore {run_dir / METRICS}, or {fresh}")
    if metrics["last_step"] is None or metrics["last_step"] < step - 1:
        held = "no step" if metrics["last_step"] is None else f"steps up to {metrics['last_step']}"
        raise ConfigError(f"cannot resume {run_dir}: {METRICS} holds {held}, but the checkpoint is at step {step} "
                          f"(steps 0-{step - 1} were logged); restore the file, or {fresh}")
    if isinstance(recorded, dict) and recorded.get("sha256") != metrics["sha256"]:
        raise ConfigError(f"cannot resume {run_dir}: the {METRICS} lines of steps 0-{step - 1} changed since the "
                          f"checkpoint was saved ({recorded.get('lines')} lines then, {metrics['lines']} now); "
                          f"restore the file, or {fresh}")


def checkpoint_record(run_dir: Path, checkpoint: Path, step: int) -> dict[str, Any]:
    """What manifest.json keeps of one checkpoint: its step, the hash of its bytes and of the metrics before it."""
    return {"step": step, "sha256": file_sha256(checkpoint), "metrics": metrics_digest(run_dir, step)}


def input_changes(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """The inputs (manifest `inputs`: {name: {"what": ..., "sha256": ...}}) whose content differs, described."""
    changed = []
    for name in sorted(saved.keys() & now.keys()):
        old, new = saved[name], now[name]
        if isinstance(old, dict) and old.get("sha256") != new.get("sha256"):
            changed.append(f"{new.get('what', name)} changed since the run started (sha256 "
                           f"{str(old.get('sha256'))[:12]} then, {new['sha256'][:12]} now)")
    return changed
