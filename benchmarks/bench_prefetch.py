"""What the C kernels' prefetching of the next expert is worth on this CPU: the kernels built with and without it
(`-DMOE_RL_NO_PREFETCH`, native_kernels.c: the product loop's next_block, the fp32 sampler's experts' bring_ahead)
and timed in one process, taking turns.

Why a benchmark of its own: the loop's speed with every operand in cache (what the kernel choice measures, and what
a product timed alone sees) is not its speed in a model's pass, where each layer's expert weights come from memory.
So the products here run over 48 layers' operands (the paper shape's 48 MoE layers, 128 experts, d_model 64, expert
width 32), at the group sizes of an update's minibatch (about 44 slots per expert: 32 sequences of 22 tokens, top-8)
and of a decode step (about 8: 128 rows), and once more over one layer's operands, which stay in cache; the fp32
sampler's experts kernel likewise, at a decode step of the paper's rollout (128 rows, one token each). Then the
paper-shaped RL step of bench_step, the two builds taking turns one rollout step at a time.

    python -m benchmarks.bench_prefetch            # about 3 minutes on a quiet CPU
    python -m benchmarks.bench_prefetch --steps 10  # more rollout steps per build
Both builds must give the same numbers: every output is compared bit for bit, and the run stops if one differs.
The loop's AVX-512 and AVX2 versions both prefetch (the one this CPU and cap run is compared); where the loop does
not run (no AVX2 with FMA, MOE_RL_ISA=baseline) its products are left out and say so. Writes
results/bench/<machine>/prefetch.md and .csv.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
from pathlib import Path

import torch

import moe_rl.rl.trainer
from benchmarks.bench_step import PHASES, _CPUClock, _new_trainer, _timed_step
from benchmarks.bench_step import SHAPES as STEP_SHAPES
from benchmarks.timing import bench_folder, cpu_class, interleaved, kernels_lines, write_csv
from moe_rl.kernels import grouped_gemm, native, sampler
from moe_rl.model.moe import sort_slots
from moe_rl.rl.probes import ProbeConfig

LAYERS, EXPERTS = 48, 128
GROUP_SIZES = {"update minibatch (~44 slots per expert)": 44, "decode step (~8 slots per expert)": 8}
PRODUCTS = {  # name: (mode, D, F) of grouped_gemm's three products at the gate/up and down widths
    "forward, gate/up (64 -> 64)": (0, 64, 64), "forward, down (32 -> 64)": (0, 32, 64),
    "input grad, gate/up": (1, 64, 64), "input grad, down": (1, 32, 64),
    "weight grad, gate/up": (2, 64, 64), "weight grad, down": (2, 32, 64),
}
BUILDS = ("prefetch", "no prefetch")
SAMPLER = {"rows": 128, "d_model": 64, "d_expert": 32, "top_k": 8}  # a decode step of the paper's 16 x 8 rollout


def builds() -> dict[str, object]:
    """The kernel library as it is loaded (with prefetching) and the same source built without it."""
    without = tuple((*flags, "-DMOE_RL_NO_PREFETCH") for flags in native.ISA_CAPS[native.isa_cap()])
    return {"prefetch": native.library(), "no prefetch": native.load(native.build(without))}


@contextlib.contextmanager
def kernels_from(library):
    """grouped_gemm's products (its C loop and its MKL batch calls) and the sampler's experts from `library`."""
    loaded = grouped_gemm.native_library, sampler.native_library
    grouped_gemm.native_library = sampler.native_library = lambda: library
    try:
        yield
    finally:
        grouped_gemm.native_library, sampler.native_library = loaded


def layer_operands(mode: int, d: int, f: int, slots_per_expert: int, layers: int, generator) -> list[tuple]:
    """Per layer: group sizes (Poisson around slots_per_expert) and random a, b; one output tensor per build."""
    operands = []
    for _ in range(layers):
        counts_E = torch.poisson(torch.full((EXPERTS,), float(slots_per_expert)), generator=generator).long()
        shapes = grouped_gemm.operand_shapes(mode, int(counts_E.sum()), EXPERTS, d, f)
        a, b = (torch.randn(shape, generator=generator) for shape in shapes[:2])
        operands.append((counts_E, a, b, {build: torch.zeros(shapes[2]) for build in BUILDS}))
    return operands


def time_products(libraries: dict, repeat: int) -> list[dict]:
    generator = torch.Generator().manual_seed(0)
    rows = []
    for group_name, slots in GROUP_SIZES.items():
        for product, (mode, d, f) in PRODUCTS.items():
            for layers in (LAYERS, 1):
                operands = layer_operands(mode, d, f, slots, layers, generator)
                flops = sum(2 * int(counts.sum()) * d * f for counts, *_ in operands)

                def run(build, operands=operands, mode=mode, d=d, f=f):
                    def products():
                        with kernels_from(libraries[build]):
                            for counts_E, a, b, c in operands:
                                grouped_gemm._expert_products(mode, counts_E, d, f, a, b, c[build])
                    return products

                times = interleaved({build: run(build) for build in BUILDS}, repeat)
                if not all(torch.equal(c["prefetch"], c["no prefetch"]) for *_, c in operands):
                    raise SystemExit(f"{product}, {group_name}: the two builds gave different numbers")
                row = {"section": "products", "group sizes": group_name, "product": product, "layers": layers}
                for build in BUILDS:
                    row[f"{build} GFLOP/s"] = flops / times[build]["cpu"] / 1e9
                row["speed-up"] = times["no prefetch"]["cpu"] / times["prefetch"]["cpu"]
                rows.append(row)
    return rows


def sampler_operands(layers: int, generator) -> list[tuple]:
    """Per layer: a decode step's rows, their routing (top-k of random scores, renormalised) and the expert weights."""
    T, D, F, K = SAMPLER["rows"], SAMPLER["d_model"], SAMPLER["d_expert"], SAMPLER["top_k"]
    operands = []
    for _ in range(layers):
        x_TD = torch.randn(T, D, generator=generator)
        weights_TK, ids_TK = torch.randn(T, EXPERTS, generator=generator).softmax(-1).topk(K, dim=-1)
        w_gate_up = torch.randn(EXPERTS, D, 2 * F, generator=generator) * D**-0.5
        w_down = torch.randn(EXPERTS, F, D, generator=generator) * F**-0.5
        operands.append((x_TD, weights_TK / weights_TK.sum(-1, keepdim=True), sort_slots(ids_TK, EXPERTS), w_gate_up,
                         w_down, {}))
    return operands


def time_sampler(libraries: dict, repeat: int) -> list[dict]:
    """The fp32 sampler's experts kernel over 48 layers' weights and over one layer's, microseconds per layer."""
    generator = torch.Generator().manual_seed(1)
    rows = []
    for layers in (LAYERS, 1):
        operands = sampler_operands(layers, generator)

        def run(build, operands=operands):
            def experts():
                with kernels_from(libraries[build]), torch.inference_mode():
                    for x_TD, weights_TK, slots, w_gate_up, w_down, out in operands:
                        out[build] = sampler.sampler_experts(x_TD, weights_TK, slots, w_gate_up, w_down)
            return experts

        times = interleaved({build: run(build) for build in BUILDS}, repeat)
        if not all(torch.equal(out["prefetch"], out["no prefetch"]) for *_, out in operands):
            raise SystemExit("sampler experts: the two builds gave different numbers")
        row = {"section": "sampler experts", "layers": layers}
        for build in BUILDS:
            row[f"{build} us per layer"] = times[build]["cpu"] / layers * 1e6
        row["speed-up"] = times["no prefetch"]["cpu"] / times["prefetch"]["cpu"]
        rows.append(row)
    return rows


def time_steps(libraries: dict, steps: int) -> list[dict]:
    """The paper-shaped RL step, the builds taking turns (A B, B A, ...) after a warm-up step each."""
    moe_rl.rl.trainer.time = _CPUClock
    with tempfile.TemporaryDirectory() as out_dir:
        trainer = _new_trainer(STEP_SHAPES["paper (d64 L48 E128 K8 F32)"], ProbeConfig(), 2 * steps + 2, out_dir)
        measured = {build: [] for build in BUILDS}
        for build in BUILDS:
            with kernels_from(libraries[build]):
                _timed_step(trainer, "measured")
        for step in range(steps):
            for build in BUILDS if step % 2 == 0 else BUILDS[::-1]:
                with kernels_from(libraries[build]):
                    measured[build].append(_timed_step(trainer, "measured"))
    rows = []
    for build, runs in measured.items():
        rows.append({"section": "step", "build": build,
                     **{name: statistics.median(run[name] for run in runs) for name in runs[0]}})
    rows.append({"section": "step", "build": "per-step ratio, no prefetch / prefetch (step CPU)",
                 "ratios": " ".join(f"{b['step CPU'] / a['step CPU']:.2f}"
                                    for a, b in zip(measured["prefetch"], measured["no prefetch"]))})
    return rows


def markdown(product_rows: list[dict], sampler_rows: list[dict], step_rows: list[dict], command: str) -> str:
    lines = ["# The C kernels' prefetching, on and off (CPU, 1 thread)", "", f"Command: `{command}`  ",
             "The kernels built with and without prefetching the next expert's weights (`-DMOE_RL_NO_PREFETCH`), "
             f"timed in one process, taking turns; CPU class {cpu_class()}. CPU time, medians; the two "
             "builds' outputs compared bit for bit (equal, or the run stops).", "", *kernels_lines(), "",
             f"## grouped_gemm's products, {EXPERTS} experts, over {LAYERS} layers' operands (from memory) and over "
             "one layer's (in cache), GFLOP/s", ""]
    if product_rows:
        lines += ["| group sizes | product | layers | prefetch | no prefetch | speed-up |", "|---|---|---|---|---|---|"]
        for r in product_rows:
            lines.append(f"| {r['group sizes']} | {r['product']} | {r['layers']} | {r['prefetch GFLOP/s']:.1f} | "
                         f"{r['no prefetch GFLOP/s']:.1f} | {r['speed-up']:.2f}x |")
    else:
        lines.append("Not measured: the C product loop does not run here (it needs MKL, one thread and AVX2 with FMA).")
    lines += ["", f"## The fp32 sampler's experts kernel, a decode step ({SAMPLER['rows']} rows, {EXPERTS} experts, "
              f"top-{SAMPLER['top_k']}, d_model {SAMPLER['d_model']}, expert width {SAMPLER['d_expert']}), "
              "microseconds per layer", "", "| layers | prefetch | no prefetch | speed-up |", "|---|---|---|---|"]
    for r in sampler_rows:
        lines.append(f"| {r['layers']} | {r['prefetch us per layer']:.0f} | {r['no prefetch us per layer']:.0f} | "
                     f"{r['speed-up']:.2f}x |")
    lines += ["", "## The paper-shaped RL step (bench_step's: d64 L48 E128 K8 F32, 16 x 8, 4 minibatches), CPU s, "
              "medians", "", "The kernel families this machine's measurement chose (above); a family that is off "
              "runs torch's code in both builds.", "",
              "| build | " + " | ".join(PHASES) + " | step CPU |", "|---|" + "---|" * (len(PHASES) + 1)]
    for r in step_rows:
        if "ratios" in r:
            lines += ["", f"{r['build']}, step by step: {r['ratios']}"]
            continue
        lines.append(f"| {r['build']} | " + " | ".join(f"{r[p]:.3f} s" for p in PHASES) + f" | {r['step CPU']:.2f} s |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6, help="measured rollout steps per build, taken in turns")
    parser.add_argument("--repeat", type=int, default=9, help="interleaved repeats of each kernel measurement")
    parser.add_argument("--out", type=Path, default=None, help="folder for prefetch.md / prefetch.csv (default "
                        "results/bench/<vendor>_<widest ISA>[_capped_<ISA>])")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if native.library() is None:
        print("the C kernels are not built here (or MOE_RL_NATIVE=0): nothing to compare, nothing written")
        return
    libraries = builds()
    loop_runs = grouped_gemm.c_loop_runs() and grouped_gemm.single_threaded_mkl()
    product_rows = time_products(libraries, args.repeat) if loop_runs else []
    sampler_rows, step_rows = time_sampler(libraries, args.repeat), time_steps(libraries, args.steps)
    command = "python -m benchmarks.bench_prefetch" + (f" --steps {args.steps}" if args.steps != 6 else "") + \
        (f" --repeat {args.repeat}" if args.repeat != 9 else "")
    args.out = args.out or Path("results/bench") / bench_folder()
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(args.out / "prefetch.csv", product_rows + sampler_rows + step_rows)
    report = markdown(product_rows, sampler_rows, step_rows, command)
    (args.out / "prefetch.md").write_text(report)
    print(report)


if __name__ == "__main__":
    main()
