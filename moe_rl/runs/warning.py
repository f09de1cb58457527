"""The run's optional early warning (`--log.warn-threshold`, `--log.warn-metric`): one line, once per run, the first
time a per-update metric reaches a threshold, e.g. one fitted by `moe-rl early-warning` (analysis/early_warning.py)
on earlier runs whose held-out accuracy collapsed.

It reads the metrics lines after they are written and never touches the model, the generators or the lines, so a run
with the warning on logs the same numbers as without it. The event is kept in manifest.json (`early_warning`), so a
resumed run does not warn twice.

    early warning: routing/update/set_change = 0.0312 reached 0.025 (log.warn_threshold) at rollout step 3, update 13;
      the run goes on (a warning stops nothing)
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass


@dataclass
class EarlyWarning:
    """Watches one metric for a threshold; `fired` once it has warned (in this process or, per the manifest, before
    a resume)."""

    metric: str
    threshold: float | None  # None: off
    fired: bool = False
    checked: bool = False  # whether a step has been checked yet (the metric's name is checked on the first)

    def check(self, lines: Iterable[Mapping]) -> dict | None:
        """The event of the first of a rollout step's lines whose metric is >= the threshold (metric, value,
        threshold, step, update), or None; at most one event per run."""
        if self.threshold is None or self.fired:
            return None
        for line in lines:
            value = line.get(self.metric)
            if isinstance(value, (int, float)) and math.isfinite(value) and value >= self.threshold:
                self.fired = True
                return {"metric": self.metric, "value": float(value), "threshold": self.threshold,
                        "step": line["step"], "update": line["update"]}
        return None

    def unknown_metric(self, lines: Iterable[Mapping]) -> str | None:
        """On the first step checked: a line saying the metric was not logged (a misspelt name never fires)."""
        if self.threshold is None or self.checked:
            return None
        self.checked = True
        if any(self.metric in line for line in lines):
            return None
        return (f"early warning: {self.metric!r} (log.warn_metric) is not among the metrics of the first step, so the "
                "warning cannot fire; docs/metrics.md lists the names")


def warning_line(event: Mapping) -> str:
    """The one line printed when the warning fires."""
    return (f"early warning: {event['metric']} = {event['value']:.4g} reached {event['threshold']:g} "
            f"(log.warn_threshold) at rollout step {event['step']}, update {event['update']}; the run goes on (a "
            "warning stops nothing)")
