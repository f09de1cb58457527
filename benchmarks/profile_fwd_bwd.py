"""Where a forward+backward's CPU time goes, native model against Hugging Face Qwen3-MoE of the same size, op by op.

bench_model times the two; this says why they differ (or do not): torch.profiler over a few steps of each, taking
turns (after warm-up, one thread, the kernel families this machine's measurement chose), self CPU time per aten op
and per moe-rl kernel Function, side by side. The profiler adds a few microseconds per op, so the totals run above
bench_model's times, most for the model with more ops; read the shares and the op rows, not the totals, as the
measurement. The kernel Functions that call the C kernels through ctypes read high under the profiler: at the paper
shape (d64 L48 E128 K8, a Zen 4) it put 5.0 ms per call on the grouped products' backward where timing the call gave 1.5
ms. At the d256 shape those calls are a small share; where they are not, time them directly.

    python -m benchmarks.profile_fwd_bwd                          # the d256 bench shape
    python -m benchmarks.profile_fwd_bwd --shape "d64 L8 E128 K8 F32" --steps 3
Writes results/bench/<machine>/profile_<shape>.md (the shape's name with spaces as underscores).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.bench_model import SHAPES, hf_qwen3_moe, hf_step, native_step
from benchmarks.timing import bench_folder, kernels_lines
from moe_rl import kernels
from moe_rl.model import ModelConfig, MoETransformer


def self_times(steps_by_model: dict[str, object], steps: int) -> dict[str, dict[str, tuple[float, int]]]:
    """model -> op name -> (self CPU ms per step, calls per step). The models take turns, one profiled step each, so
    that a drift in the machine's speed (+-25% within minutes on the 2-core VMs here) falls on both alike."""
    sums: dict[str, dict[str, list[float]]] = {name: {} for name in steps_by_model}
    for step in steps_by_model.values():
        for _ in range(3):
            step()
    for _ in range(steps):
        for name, step in steps_by_model.items():
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                step()
            for e in prof.key_averages():
                ms_calls = sums[name].setdefault(e.key, [0.0, 0])
                ms_calls[0] += e.self_cpu_time_total / 1e3
                ms_calls[1] += e.count
    return {name: {op: (ms / steps, calls // steps) for op, (ms, calls) in ops.items()}
            for name, ops in sums.items()}


def markdown(shape: str, tables: dict[str, dict], steps: int, rows: int) -> str:
    totals = {name: sum(ms for ms, _ in table.values()) for name, table in tables.items()}
    ops = sorted(set().union(*tables.values()), key=lambda op: -max(t.get(op, (0, 0))[0] for t in tables.values()))
    lines = [f"# Forward+backward, op by op: {shape}", "",
             f"Command: `python -m benchmarks.profile_fwd_bwd --shape \"{shape}\" --steps {steps}`  ",
             f"torch.profiler, self CPU time per step (mean of {steps} steps each after 3 of warm-up, the models "
             "taking turns), one thread (the Functions that call C kernels through ctypes read high under the "
             "profiler: see the module docstring); "
             "profiled totals: " + ", ".join(f"{name} {total:.1f} ms" for name, total in totals.items()) + ".", "",
             *kernels_lines(), "", "| op | " + " | ".join(f"{name} ms (share, calls)" for name in tables) + " |",
             "|---|" + "---|" * len(tables)]
    for op in ops[:rows]:
        cells = [f"{t.get(op, (0, 0))[0]:.2f} ({t.get(op, (0, 0))[0] / totals[name]:.0%}, {t.get(op, (0, 0))[1]})"
                 for name, t in tables.items()]
        lines.append(f"| `{op[:60]}` | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.profile_fwd_bwd", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="d256 L4 E16 K4 F256", choices=list(SHAPES))
    parser.add_argument("--steps", type=int, default=5, help="profiled steps per model")
    parser.add_argument("--rows", type=int, default=25, help="ops in the table")
    parser.add_argument("--out", type=Path, default=None, help="folder (default results/bench/<machine>)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    kwargs, batch, seq_len = SHAPES[args.shape]
    cfg = ModelConfig(**kwargs)
    torch.manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq_len))
    tables = self_times({"native": native_step(MoETransformer(cfg, kernels=kernels.machine()), ids),
                         "HF Qwen3-MoE": hf_step(hf_qwen3_moe(cfg), ids)}, args.steps)
    out = args.out or Path("results/bench") / bench_folder()
    out.mkdir(parents=True, exist_ok=True)
    text = markdown(args.shape, tables, args.steps, args.rows)
    (out / f"profile_{args.shape.replace(' ', '_')}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
