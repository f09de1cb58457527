"""Which kernel families run on this machine: chosen by measurement, once per machine, and recorded.

A family is on only where it is faster than the torch code it replaces, at the shapes it serves, on this CPU. On
first use in a process the choice is read from the cache folder of the compiled kernels (native.cache_folder()),
under a key of the CPU's features, the torch version, the ISA cap, the thread count, the kernels' source and the
measurement's own code; where there is none yet, each available family is timed against the torch reference
(measure.py, about five seconds in all) and the result is written there for every later process. Why by
measurement: the same C code that was 1.3x faster than torch on an AVX-512 CPU was 2-5x slower on an AVX2 one (the
fp32 sampler's experts kernel, whose 16 accumulators of 16 floats spilled AVX2's registers until it got a tiling of
its own), and no rule written on one machine knows that of another.

Every family but two gives exactly the bits of its reference (the module docstrings say why), so the choice changes
speed only. `decode_attention` and `sampler_experts` (the fp32 sampler only; the trainer and the bf16 sampler never
use them) agree with theirs to fp32 rounding: there the choice can change sampled tokens, and a run's manifest says
which was taken (`report()`).

A measurement is only as good as the machine's quiet while it ran. Other processes on the cores (a test suite's
workers, a sweep's runs) change the two contenders' times unequally: on 2026-12-04 a CI run with two pytest workers
timed `mkl_products` at 1.03x the torch time on a Zen 4 where the idle machine reads 0.67x, and cached "off". So the
measurement also counts the CPU time other processes took while it ran (Linux /proc/stat); where they kept more
than BUSY_CORES cores busy on average, its choice is used and cached but marked provisional, and the first process
that starts while the machine is idle (other processes under BUSY_CORES over a sample of IDLE_SAMPLE_S) measures
again. The manifest and benchmarks record how busy the machine was (`report()["measurement"]`).

MOE_RL_KERNELS overrides the measurement: `all` (every available family), `none` (the torch code everywhere, as
MOE_RL_NATIVE=0), or a comma list such as `sampler_experts=off,topk=on` on top of the measured choice.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path

import torch

import moe_rl.kernels.native as native
from moe_rl.kernels.measure import measure_all
from moe_rl.kernels.registry import KernelSet

FAMILIES = {
    "topk": "the router's top-k (C selection; torch.topk's indices)",
    "slots": "token-slots sorted by expert (C counting sort; torch's stable argsort)",
    "rows": "the experts' input rows gathered and their outputs summed (C copies and sums; the torch index ops' bits)",
    "mkl_products": "the experts' grouped products as MKL batch calls (torch._grouped_mm's and bmm's bits)",
    "exact_products": "grouped products as a C loop in MKL's summation order (AVX-512 or AVX2; torch's bits, "
                      "checked at load)",
    "swiglu": "the experts' silu(gate) * up (times the gate weights where they scale the down product's input), "
              "one C pass each way (torch's bits, checked at first use)",
    "rotary": "the rotary embedding, forward and backward (C; the torch ops' bits)",
    "rms_norm": "RMS norm with autograd, its elementwise passes in C (the torch composite's bits)",
    "decode_attention": "the fp32 sampler's one-query attention over the KV cache (C; torch's to fp32 rounding)",
    "sampler_experts": "the fp32 sampler's experts in one C pass (the grouped path's numbers to fp32 rounding)",
}
EXACT_FAMILIES = ("topk", "slots", "rows", "mkl_products", "exact_products", "swiglu", "rotary", "rms_norm")

BUSY_CORES = 0.5  # other processes' average use of the cores during the measurement above which it is provisional
IDLE_SAMPLE_S = 0.2  # how long a process that finds a provisional choice watches the machine before it measures again

_forced: dict[str, bool] = {}  # tests and the measurement itself: family -> on/off, ahead of everything else
_chosen: dict[str, dict] | None = None  # this process's choice: family -> {"used", "why", ...}
_measurement: dict = {}  # how the choice in use was measured: {"busy_cores", "provisional"} (see report())


def enabled(family: str) -> bool:
    """Whether the fast path of `family` runs in this process."""
    if family in _forced:
        return _forced[family]
    return (_chosen or choices())[family]["used"]


@contextlib.contextmanager
def forced(**families: bool):
    """Turn families on or off inside the block, whatever was chosen (tests, benchmarks, the measurement)."""
    unknown = set(families) - set(FAMILIES)
    if unknown:
        raise ValueError(f"unknown kernel families {sorted(unknown)}; known: {', '.join(FAMILIES)}")
    global _forced
    before = _forced
    _forced = {**before, **families}
    try:
        yield
    finally:
        _forced = before


def choices() -> dict[str, dict]:
    """family -> {"used": bool, "why": str, and where measured "fast_s", "reference_s"}, for this process."""
    global _chosen
    if _chosen is None:
        _chosen = _apply_environment(_measured_or_cached())
    return _chosen


def report() -> dict:
    """What a manifest or a benchmark records: the CPU, the ISA caps in force, each family's path, and how busy the
    machine was while the choice was measured ("busy_cores": other processes' average use of the cores, None where
    it could not be read or nothing was measured; "provisional": measured on a busy machine, see the docstring)."""
    families = {name: dict(choice) for name, choice in choices().items()}
    return {"cpu": cpu_description(), "families": families, "measurement": dict(_measurement)}


def reset() -> None:
    """Forget this process's choice (tests that change the environment or the cache folder)."""
    global _chosen, _measurement
    _chosen, _measurement = None, {}


def cpu_description() -> dict:
    """The CPU and the instruction sets torch, MKL, oneDNN and these kernels may use here."""
    flags = _cpu_flags()
    return {
        "model": _cpu_model() or platform.processor() or platform.machine(),
        "vendor": _cpu_vendor(),
        "features": [f for f in ("sse4_2", "avx", "avx2", "fma", "avx512f", "avx512bw", "avx512vl", "amx_tile")
                     if f in flags],
        "aten_capability": torch.backends.cpu.get_cpu_capability(),
        "mkl": torch.backends.mkl.is_available(),
        "kernels_isa": native.isa_cap(),
        "caps": {name: os.environ[name] for name in ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS",
                                                     "ONEDNN_MAX_CPU_ISA", "MOE_RL_ISA") if name in os.environ},
        "threads": torch.get_num_threads(),
    }


def _measured_or_cached() -> dict[str, dict]:
    global _measurement
    if native.library() is None:
        why = native.why_none() or "no C kernels built"
        _measurement = {"busy_cores": None, "provisional": False}
        return {name: {"used": False, "why": why} for name in FAMILIES}
    path = native.cache_folder() / f"kernel_choice_{_machine_key()}.json"
    cached = _read(path)
    if cached is not None and not (cached["measurement"]["provisional"] and machine_idle()):
        _measurement = cached["measurement"]
        return cached["families"]
    families, busy_cores = measured_noting_others()
    _measurement = {"busy_cores": busy_cores, "provisional": busy_cores is not None and busy_cores > BUSY_CORES}
    _write(path, {"families": families, "measurement": _measurement})
    return families


def measured_noting_others() -> tuple[dict[str, dict], float | None]:
    """measure_all's choice, and the cores other processes kept busy on average meanwhile (None without
    /proc/stat)."""
    return _others_busy_cores(lambda: measure_all(forced, KernelSet(enabled)))


def machine_idle() -> bool:
    """Whether other processes keep fewer than BUSY_CORES cores busy now, over a sample of IDLE_SAMPLE_S (False where
    /proc/stat cannot be read). Not the load average: it lags a minute behind, so a test suite's first processes would
    find the machine idle while its workers kept the cores busy."""
    _, busy_cores = _others_busy_cores(lambda: time.sleep(IDLE_SAMPLE_S))
    return busy_cores is not None and busy_cores < BUSY_CORES


def _others_busy_cores(work: Callable[[], object]) -> tuple[object, float | None]:
    """work()'s result, and the machine's busy CPU time while it ran, less this process's own, over the wall time:
    the cores other processes kept busy on average (None without /proc/stat)."""
    busy_before, own_before, wall_before = _machine_busy_seconds(), time.process_time(), time.perf_counter()
    result = work()
    busy_after, own_after, wall_after = _machine_busy_seconds(), time.process_time(), time.perf_counter()
    if busy_before is None or busy_after is None:
        return result, None
    others = (busy_after - busy_before) - (own_after - own_before)
    return result, round(max(others, 0.0) / max(wall_after - wall_before, 1e-9), 2)


def _machine_busy_seconds() -> float | None:
    """CPU seconds all cores spent running anything since boot (user, nice, system, irq, softirq; not idle, iowait or
    time stolen by the hypervisor), from /proc/stat's first line; None where it is not there (not Linux)."""
    try:
        with open("/proc/stat") as stat:
            fields = stat.readline().split()
        user, nice, system, _idle, _iowait, irq, softirq = (int(f) for f in fields[1:8])
        return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def _apply_environment(chosen: dict[str, dict]) -> dict[str, dict]:
    """MOE_RL_KERNELS on top of the measured choice (module docstring)."""
    setting = os.environ.get("MOE_RL_KERNELS", "").strip()
    if not setting or setting == "measured":
        return chosen
    chosen = {name: dict(choice) for name, choice in chosen.items()}
    if setting in ("all", "none"):
        for choice in chosen.values():
            available = not choice["why"].startswith(("unavailable", "no C kernels", "switched off"))
            choice["used"] = setting == "all" and available
            choice["why"] = f"MOE_RL_KERNELS={setting}" + ("" if available or setting == "none" else " (unavailable)")
        return chosen
    for item in setting.split(","):
        name, _, value = item.strip().partition("=")
        if name not in FAMILIES or value not in ("on", "off"):
            raise ValueError(f"MOE_RL_KERNELS: {item!r} is not family=on|off (families: {', '.join(FAMILIES)}; "
                             "or all, none, measured)")
        chosen[name]["used"] = value == "on" and not chosen[name]["why"].startswith("unavailable")
        chosen[name]["why"] = f"MOE_RL_KERNELS {item}"
    return chosen


def _machine_key() -> str:
    facts = [sorted(_cpu_flags()), _cpu_model(), torch.__version__, torch.backends.cpu.get_cpu_capability(),
             native.isa_cap(), torch.get_num_threads(), native.source_hash(), _measurement_hash(),
             *(os.environ.get(name, "") for name in ("MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA"))]
    return hashlib.sha256(json.dumps(facts).encode()).hexdigest()[:16]


def _measurement_hash() -> str:
    """The measurement's own code (its shapes and thresholds) and the Python side of every family it times (what a
    family does around its C call, such as the torch products the MKL path computes again, changes its speed): a
    change to any of them measures again."""
    sources = sorted(Path(__file__).parent.glob("*.py"))
    return hashlib.sha256(b"".join(path.read_bytes() for path in sources)).hexdigest()[:16]


def _read(path: Path) -> dict | None:
    """{"families": family -> choice, "measurement": {"busy_cores", "provisional"}}, or None: no file, or one
    written by another version or damaged (then measured again)."""
    try:
        record = json.loads(path.read_text())
        families, measurement = record["families"], record["measurement"]
        if set(families) == set(FAMILIES) and isinstance(measurement["provisional"], bool):
            return record
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return None


def _write(path: Path, record: dict) -> None:
    """Atomically (sweep workers may measure at once; the last rename wins, each file whole)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        private = path.with_suffix(f".{os.getpid()}.tmp")
        private.write_text(json.dumps(record, indent=1, sort_keys=True))
        os.replace(private, path)
    except OSError:
        pass  # an unwritable cache only means measuring again next time


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _cpu_model() -> str | None:
    return _cpuinfo_field("model name")


# Two CPUs with the same flags (an Intel Xeon and an AMD Zen 4 both offer AVX-512 BW/VL) still round and time
# differently, because MKL picks its kernels and blocking by vendor and cache: results name the vendor too.
_VENDORS = {"GenuineIntel": "intel", "AuthenticAMD": "amd"}


def _cpu_vendor() -> str:
    vendor_id = _cpuinfo_field("vendor_id")
    return _VENDORS.get(vendor_id, vendor_id.lower()) if vendor_id else "unknown"


def _cpuinfo_field(name: str) -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.split(":", 1)[0].strip() == name:
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None
