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

MOE_RL_KERNELS overrides the measurement: `all` (every available family), `none` (the torch code everywhere, as
MOE_RL_NATIVE=0), or a comma list such as `sampler_experts=off,topk=on` on top of the measured choice.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
from pathlib import Path

import torch

import moe_rl.kernels.native as native
from moe_rl.kernels.measure import measure_all

FAMILIES = {
    "topk": "the router's top-k (C selection; torch.topk's indices)",
    "slots": "token-slots sorted by expert (C counting sort; torch's stable argsort)",
    "rows": "the experts' input rows gathered and their outputs summed (C copies and sums; the torch index ops' bits)",
    "mkl_products": "the experts' grouped products as MKL batch calls (torch._grouped_mm's and bmm's bits)",
    "exact_products": "grouped products as a C loop in MKL's summation order (AVX-512 or AVX2; torch's bits, checked at load)",
    "rotary": "the rotary embedding, forward and backward (C; the torch ops' bits)",
    "decode_attention": "the fp32 sampler's one-query attention over the KV cache (C; torch's to fp32 rounding)",
    "sampler_experts": "the fp32 sampler's experts in one C pass (the grouped path's numbers to fp32 rounding)",
}
EXACT_FAMILIES = ("topk", "slots", "rows", "mkl_products", "exact_products", "rotary")

_forced: dict[str, bool] = {}  # tests and the measurement itself: family -> on/off, ahead of everything else
_chosen: dict[str, dict] | None = None  # this process's choice: family -> {"used", "why", ...}


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
    """What a manifest or a benchmark records: the CPU, the ISA caps in force, and each family's path."""
    return {"cpu": cpu_description(), "families": {name: dict(choice) for name, choice in choices().items()}}


def reset() -> None:
    """Forget this process's choice (tests that change the environment or the cache folder)."""
    global _chosen
    _chosen = None


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
    if native.library() is None:
        why = "switched off (MOE_RL_NATIVE=0)" if os.environ.get("MOE_RL_NATIVE") == "0" else "no C kernels built"
        return {name: {"used": False, "why": why} for name in FAMILIES}
    path = native.cache_folder() / f"kernel_choice_{_machine_key()}.json"
    cached = _read(path)
    if cached is not None:
        return cached
    measured = measure_all(forced)
    _write(path, measured)
    return measured


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


def _read(path: Path) -> dict[str, dict] | None:
    try:
        chosen = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(chosen, dict) or set(chosen) != set(FAMILIES):
        return None  # written by another version, or damaged: measured again
    return chosen


def _write(path: Path, chosen: dict[str, dict]) -> None:
    """Atomically (sweep workers may measure at once; the last rename wins, each file whole)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        private = path.with_suffix(f".{os.getpid()}.tmp")
        private.write_text(json.dumps(chosen, indent=1, sort_keys=True))
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
