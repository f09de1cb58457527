"""moe-rl's C kernels (native_kernels.c beside this file): built once per machine, loaded with ctypes.

The kernels serve the routing hot path on CPU: the router's top-k (topk.py), sorting token-slots by expert, gathering
the experts' input rows and adding up their outputs (rows.py), setting up the experts' MKL batch products and computing
them in MKL's own order where a check at load shows the same bits (grouped_gemm.py), their SwiGLU (activation.py,
likewise checked), the rotary embedding and the fp32 sampler's decode attention (attention.py) and experts (sampler.py).
Each gives exactly the numbers of the torch code it replaces (native_kernels.c says why for each), so whether they are
used changes speed only; the exceptions are the fp32 sampler's two kernels, which agree with torch to fp32 rounding.
Which of them run on a machine is measured (selection.py).

MOE_RL_ISA caps the instruction sets of these kernels, as ATEN_CPU_CAPABILITY, MKL_ENABLE_INSTRUCTIONS and
ONEDNN_MAX_CPU_ISA cap torch's: `avx512` (the default: every version, the widest picked at load), `avx2` (one
version compiled for AVX2, no AVX-512 kernels) or `baseline` (one x86-64 baseline version), so that the tests can run
the code an older CPU would run.

The source is compiled with the system's C compiler (`$CC`, else `cc` or `gcc`) into a user cache folder
($XDG_CACHE_HOME or ~/.cache, then moe-rl/), under a name that hashes the source and the compiler flags, so an edited
kernel is rebuilt and an unchanged one is built once. Without a compiler (or with MOE_RL_NATIVE=0) `library()` is
None and every caller runs its torch code instead.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

SOURCE = Path(__file__).with_name("native_kernels.c")
# -O3 for the vectorised group maxima of the top-k; no fused multiply-adds (the sums must be torch's additions, on
# CPUs where FMA is baseline too); no -march=native: the cache folder may be shared by machines with different CPUs
# (a cluster's home directory), so wider vectors come from per-function versions picked at load time instead.
FLAGS = ("-O3", "-ffp-contract=off", "-shared", "-fPIC")
# A toolchain without function multi-versioning (native_kernels.c, WIDEST_VECTORS) builds one baseline version.
ONE_VERSION_FLAGS = (*FLAGS, "-DMOE_RL_ONE_VERSION")
ISA_CAPS = {  # MOE_RL_ISA: the flag sets to try, in order
    "avx512": (FLAGS, ONE_VERSION_FLAGS),
    "avx2": ((*ONE_VERSION_FLAGS, "-mavx2", "-mfma"), ONE_VERSION_FLAGS),
    "baseline": (ONE_VERSION_FLAGS,),
}

_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
_SIGNATURES = {  # name: argument types (every kernel returns an int64 status or count)
    "topk_rows": [_PTR, _I64, _I64, _I64, _PTR],
    "sort_slots": [_PTR, _I64, _I64, _I64, _PTR, _PTR, _PTR, _PTR],
    "expert_sgemm": [_PTR, _I64, _I64, _PTR, _I64, _I64, _I64, _PTR, _PTR, _PTR, _I64, _I64],
    "exact_products": [_I64, _I64, _PTR, _I64, _I64, _I64, _PTR, _PTR, _PTR, _I64, _I64, _I64],
    "expert_rows": [_PTR, _I64, _I64, _PTR, _PTR, _I64, _PTR, _PTR, _PTR, _I64, _PTR, _PTR, _PTR],
    "add_rows": [_PTR, _PTR, _I64, _I64, _PTR, _I64, _PTR],
    "add_rows_backward": [_PTR, _I64, _I64, _PTR, _PTR, _PTR, _I64, _PTR, _PTR],
    "rotate_half": [_PTR, _I64, _I64, _I64, _I64, _PTR, _PTR, _I64, _PTR],
    "rms_norm_rows": [_I64, _PTR, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _PTR, _PTR],
    "decode_attention": [_PTR, _PTR, _PTR, *[_I64] * 10, _PTR, ctypes.c_float, _PTR],
    "sampler_experts": [_PTR, _I64, _I64, _I64, _I64, _PTR, _PTR, _PTR, _PTR, _I64, _PTR, _PTR, _PTR],
    "swiglu": [_I64, _PTR, _I64, _PTR, _PTR, _PTR, _I64, _I64, _PTR, _PTR],
}


def isa_cap() -> str:
    """MOE_RL_ISA, checked: avx512 (default), avx2 or baseline."""
    cap = os.environ.get("MOE_RL_ISA", "avx512").strip().lower() or "avx512"
    if cap not in ISA_CAPS:
        from moe_rl.errors import ConfigError  # a ValueError: one line from the command, before anything is written

        raise ConfigError(f"MOE_RL_ISA={cap!r}: must be one of {', '.join(ISA_CAPS)} (an environment variable)")
    return cap


def torch_cpu_function(name: str) -> int | None:
    """The address of a function that torch's own CPU library exports (the MKL and Sleef linked into x86 wheels), or
    None where it is not there."""
    import torch

    library = {"linux": "libtorch_cpu.so", "darwin": "libtorch_cpu.dylib"}.get(sys.platform, "torch_cpu.dll")
    try:
        function = getattr(ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / library)), name)
    except (OSError, AttributeError):
        return None
    return ctypes.cast(function, ctypes.c_void_p).value


def cache_folder() -> Path:
    """Where the compiled kernels and the measured kernel choice live ($XDG_CACHE_HOME or ~/.cache, then moe-rl)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "moe-rl"


def source_hash() -> str:
    return hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:16]


_why_none: list[str] = []  # why library() is None, once it has been asked


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled kernels with their signatures set, or None (no compiler, a failed build, or switched off; see
    `why_none`). A cached library that does not load (empty, cut short by a full disk or a killed copy, another
    build's file) is deleted and built again, once; if that fails too, a line on stderr says so."""
    if os.environ.get("MOE_RL_NATIVE", "1") == "0" or sys.platform == "win32":
        return _none("switched off (MOE_RL_NATIVE=0)")
    flag_sets = ISA_CAPS[isa_cap()]
    try:
        built = build(flag_sets)
    except (OSError, subprocess.SubprocessError) as err:
        return _none(f"no C kernels built ({_first_line(err)})")
    try:
        return load(built)
    except (OSError, AttributeError) as err:
        broken = f"the cached kernel library {built} does not load ({_first_line(err)})"
    built.unlink(missing_ok=True)
    try:
        return load(build(flag_sets))
    except (OSError, AttributeError, subprocess.SubprocessError) as err:
        reason = f"{broken}, and building it again failed ({_first_line(err)})"
        print(f"moe-rl: {reason}; the C kernels are off, the torch code runs instead", file=sys.stderr, flush=True)
        return _none(reason)


def why_none() -> str:
    """Why `library()` is None ("" when it is not)."""
    library()
    return _why_none[-1] if _why_none else ""


def _none(reason: str) -> None:
    _why_none.append(reason)
    return None


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    if isinstance(err, subprocess.CalledProcessError):
        said = err.stderr.decode(errors="replace") if isinstance(err.stderr, bytes) else str(err.stderr or "")
        text = f"{err.cmd[0]} exited with status {err.returncode}" + (f": {said.strip()}" if said.strip() else "")
    return (text.splitlines() or [type(err).__name__])[0][:200]


def load(built_library: Path) -> ctypes.CDLL:
    """A compiled kernel library with its functions' signatures set."""
    loaded = ctypes.CDLL(str(built_library))
    for name, argtypes in _SIGNATURES.items():
        function = getattr(loaded, name)
        function.argtypes = argtypes
        function.restype = ctypes.c_int64
    return loaded


def build(flag_sets: tuple[tuple[str, ...], ...] = (FLAGS, ONE_VERSION_FLAGS)) -> Path:
    """Compile the kernels unless this exact source was built with these flags before: with the first flag set the
    compiler accepts (a failed one leaves a marker, so later processes skip it). Concurrent processes (sweep workers)
    each build into a private folder and rename the result into place, so none loads a half-written library."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise OSError("no C compiler")
    cache = cache_folder()
    source = SOURCE.read_bytes()
    for number, flags in enumerate(flag_sets, start=1):
        built_library = cache / f"native_{hashlib.sha256(source + ' '.join(flags).encode()).hexdigest()[:16]}.so"
        failed = built_library.with_suffix(".failed")
        if built_library.exists():
            return built_library
        if failed.exists() and number < len(flag_sets):
            continue
        try:
            _compile(compiler, flags, cache, built_library)
            return built_library
        except subprocess.CalledProcessError:
            if number == len(flag_sets):
                raise
            failed.touch()
    raise OSError("no flag set to build with")


def _compile(compiler: str, flags: tuple[str, ...], cache: Path, built_library: Path) -> None:
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as folder:
        private = Path(folder) / "native.so"
        subprocess.run([compiler, *flags, "-o", str(private), str(SOURCE)], check=True, capture_output=True,
                       timeout=120)
        os.replace(private, built_library)
