"""Interleaved timing for the benchmarks: contenders run in alternating order (A B C, C B A, ...) so that drift on a
shared machine hits all of them alike; each reports the median wall time and the median CPU time of this process
(CPU time is what one torch thread spends, and is less disturbed by other processes on a loaded machine)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


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


def cpu_class() -> str:
    """The widest vectors the run may use: avx512, avx2 or baseline (the CPU's, less any ISA cap in force)."""
    from moe_rl.kernels import report

    cpu = report()["cpu"]
    features, aten = set(cpu["features"]), cpu["aten_capability"].lower()
    if "avx512f" in features and aten.startswith("avx512") and cpu["kernels_isa"] == "avx512":
        return "avx512"
    wide_aten = aten in ("avx2", "avx512", "avx512_vnni", "avx512_bf16")
    if "avx2" in features and wide_aten and cpu["kernels_isa"] != "baseline":
        return "avx2"
    return "baseline"


def bench_folder() -> str:
    """The default folder under results/bench for this machine: vendor, the widest vectors the CPU has, and the cap in
    force if it narrows them (intel_avx512, intel_avx512_capped_avx2, amd_avx2, ...). Two vendors with the same
    flags get two folders, and a capped run never overwrites the uncapped one."""
    from moe_rl.kernels import report

    cpu = report()["cpu"]
    features = set(cpu["features"])
    widest = "avx512" if "avx512f" in features else "avx2" if "avx2" in features else "baseline"
    running = cpu_class()
    return f"{cpu['vendor']}_{widest}" + (f"_capped_{running}" if running != widest else "")


def no_kernels():
    """Every kernel family off: what MOE_RL_NATIVE=0 (or a machine without a C compiler) runs."""
    from moe_rl import kernels

    return kernels.forced(**{family: False for family in kernels.FAMILIES})


def kernels_lines() -> list[str]:
    """Markdown: the CPU, the caps in force and the path each kernel family took in this run."""
    from moe_rl import kernels

    report = kernels.report()
    cpu = report["cpu"]
    caps = ", ".join(f"{k}={v}" for k, v in cpu["caps"].items()) or "none"
    lines = [f"CPU: {cpu['model']} ({', '.join(cpu['features'])}); torch kernels {cpu['aten_capability']}, MKL "
             f"{'yes' if cpu['mkl'] else 'no'}, moe-rl kernels capped at {cpu['kernels_isa']} (the widest built "
             f"version the CPU runs is picked at load); ISA caps: {caps}.", "",
             "| kernel family | used | why |", "|---|---|---|"]
    lines += [f"| {name} | {'yes' if c['used'] else 'no'} | {c['why']} |" for name, c in report["families"].items()]
    busy = report["measurement"].get("busy_cores")
    if busy is not None:
        lines += ["", f"While the choice was measured, other processes kept {busy:.2f} cores busy on average"
                  + (" (over 0.5: a provisional choice, measured again on the first idle start)."
                     if report["measurement"]["provisional"] else ".")]
    return lines
