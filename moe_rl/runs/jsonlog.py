"""metrics.jsonl: an append-only log of one JSON object per line that survives a killed process.

The writer flushes and fsyncs every line; the reader drops a partial last line (the one a kill interrupted) and
raises on anything else that is not a JSON object, naming the file and line.

NaN and Inf are written as Python's json writes them (`NaN`, `Infinity`, `-Infinity`), not as null: a diverged loss
must stay distinguishable from a metric that was not logged. `json.loads`, `read_jsonl` and
`pandas.read_json(lines=True)` accept these tokens; strict JSON parsers (browsers, jq) do not.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from moe_rl.errors import DataError, DiskFullError
from moe_rl.runs.atomic import atomic_write_text, disk_full

if TYPE_CHECKING:
    from moe_rl.runs.trackers import Tracker

logger = logging.getLogger(__name__)


class MetricsWriter:
    """Appends one JSON object per line to metrics.jsonl, flushed and fsynced before `write` returns.

    A line is {step_key: int, "wall_time": Unix seconds, **metrics}, every metric a number, string, bool or null.

    A SIGKILL therefore loses at most the line being written, and readers drop that partial line.
    resume_from_step: the step of the checkpoint a resumed run starts from. Lines with a larger step were logged
        after that checkpoint and the resumed run logs those steps again, so they are dropped here.
    trackers: optional mirrors (moe_rl.runs.trackers); each line goes to them after it is safe on disk.
    tracker_step_key: the field trackers use as their x axis (default: step_key). The RL trainer writes several
        lines per rollout step and mirrors them at their global optimizer step, "update".
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        resume_from_step: int | None = None,
        step_key: str = "step",
        trackers: Iterable[Tracker] = (),
        tracker_step_key: str | None = None,
        fsync: bool = True,
    ):
        self.path = Path(path)
        self.step_key = step_key
        self.tracker_step_key = tracker_step_key or step_key
        self.trackers = list(trackers)
        self._fsync = fsync  # flush alone survives a killed process; fsync also survives a crashed machine
        self._keep_complete_lines(resume_from_step)
        self._full = False
        self._file = open(self.path, "a", encoding="utf-8")

    def _keep_complete_lines(self, max_step: int | None) -> None:
        """Rewrite the file without a partial last line and, on resume, without lines past `max_step`."""
        if not self.path.exists():
            return
        text = self.path.read_text(encoding="utf-8")
        kept = [line for line, record in _parse_jsonl(text, self.path) if not self._is_after(record, max_step)]
        new_text = "".join(line + "\n" for line in kept)
        if new_text != text:
            atomic_write_text(self.path, new_text)

    def _is_after(self, record: dict, max_step: int | None) -> bool:
        step = record.get(self.step_key)
        return max_step is not None and isinstance(step, (int, float)) and step > max_step

    def write(self, metrics: Mapping[str, Any], step: int | None = None) -> dict[str, Any]:
        """Append one line; `step` may be given here or as metrics[step_key]. Returns the record written."""
        record = self._record(metrics, step)
        try:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
            if self._fsync:
                os.fsync(self._file.fileno())
        except OSError as err:
            if not disk_full(err):
                raise
            self._full = True  # the unwritten rest stays in the buffer: close() must not fail on it again
            raise DiskFullError(self.path) from None
        self._mirror(record)
        return record

    def _record(self, metrics: Mapping[str, Any], step: int | None) -> dict[str, Any]:
        values = {name: to_scalar(name, value) for name, value in metrics.items()}
        logged_step = values.pop(self.step_key, None)
        step = logged_step if step is None else step
        if step is None:
            raise ValueError(f"a metrics line needs its step: pass step= or metrics[{self.step_key!r}]")
        if logged_step is not None and logged_step != step:
            raise ValueError(f"step={step} disagrees with metrics[{self.step_key!r}]={logged_step}")
        return {self.step_key: int(step), "wall_time": time.time(), **values}

    def _mirror(self, record: dict[str, Any]) -> None:
        metrics = {k: v for k, v in record.items() if k not in (self.step_key, self.tracker_step_key)}
        x = record.get(self.tracker_step_key, record[self.step_key])
        for tracker in self.trackers:
            try:
                tracker.log(metrics, x)
            except Exception:  # a mirror outage must not end a run: metrics.jsonl already holds the line
                logger.exception("tracker %s failed to log step %s", type(tracker).__name__, record[self.step_key])

    def close(self) -> None:
        try:
            self._file.close()
        except OSError:
            if not self._full:
                raise  # after a full disk the partial last line is what a reader drops (and a resume rewrites)
        for tracker in self.trackers:
            tracker.close()

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def to_scalar(name: str, value: Any) -> Any:
    """A metric value as a JSON scalar: one-element tensors and numpy values become Python floats, ints or bools."""
    if isinstance(value, torch.Tensor):
        return _single_item(name, value, value.numel())
    if isinstance(value, (np.ndarray, np.generic)):
        return _single_item(name, value, value.size)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"metric {name!r} is a {type(value).__name__}; a metric is one number or string")


def _single_item(name: str, value: Any, size: int) -> Any:
    if size != 1:
        raise TypeError(f"metric {name!r} has {size} elements; log one key per element instead, e.g. churn/L3")
    return value.item()


def _parse_jsonl(text: str, source: Path) -> list[tuple[str, dict]]:
    """(line, record) for each complete line. The last line may be cut short by a kill: it is then dropped."""
    numbered = [(number, line) for number, line in enumerate(text.split("\n"), start=1) if line.strip()]
    parsed = []
    for position, (number, line) in enumerate(numbered):
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            if position == len(numbered) - 1:
                break  # the writer was killed mid-line
            raise DataError(f"{source}:{number}: not valid JSON ({exc.msg})") from exc
        if not isinstance(record, dict):
            raise DataError(f"{source}:{number}: expected a JSON object, got {type(record).__name__}")
        parsed.append((line, record))
    return parsed


def complete_lines(path: str | os.PathLike) -> list[tuple[str, dict[str, Any]]]:
    """(line as written, record) for every complete JSON object of a JSON-lines file."""
    path = Path(path)
    return _parse_jsonl(path.read_text(encoding="utf-8"), path)


def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Every complete JSON object of a JSON-lines file; an empty file gives []."""
    path = Path(path)
    return [record for _, record in _parse_jsonl(path.read_text(encoding="utf-8"), path)]

