"""Interleaved timing for the benchmarks: contenders run in alternating order (A B C, C B A, ...) so that drift on a
shared machine hits all of them alike; each reports the median wall time and the median CPU time of this process
(CPU time is what one torch thread spends, and is less disturbed by other processes on a loaded machine)."""

from __future__ import annotations

import statistics
import time
from typing import Callable


def interleaved(fns: dict[str, Callable[[], object]], repeat: int, warmup: int = 1) -> dict[str, dict[str, float]]:
    """{name: {"wall": median seconds, "cpu": median CPU seconds}} over `repeat` interleaved runs of each fn."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    wall: dict[str, list[float]] = {name: [] for name in fns}
    cpu: dict[str, list[float]] = {name: [] for name in fns}
    order = list(fns.items())
    for rep in range(repeat):
        for name, fn in order if rep % 2 == 0 else order[::-1]:
            w0, c0 = time.perf_counter(), time.process_time()
            fn()
            cpu[name].append(time.process_time() - c0)
            wall[name].append(time.perf_counter() - w0)
    return {name: {"wall": statistics.median(wall[name]), "cpu": statistics.median(cpu[name])} for name in fns}


def write_csv(path, rows: list[dict]) -> None:
    """Rows of flat dicts, the union of their keys as columns."""
    import csv

    columns = list(dict.fromkeys(key for row in rows for key in row))
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
