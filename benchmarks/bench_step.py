"""Where one RL step's time goes, by phase, at the tiny default model and at the paper's shape (CPU, one thread).

Runs the real trainer (`moe_rl.rl.trainer.Trainer.rl_step`, default GRPO on chain_sum, default probes) for one warm-up
rollout step and `--steps` measured ones (3 by default, the contenders of a shape taking turns one step at a time,
so that the machine's drift falls on all of them alike), 16 prompts x 8 completions and 4 minibatches, and splits
each measured step with the trainer's own `time/*` metrics (docs/metrics.md) into: sample (generation and scoring),
old pass, updates (forward, backward, clipping), optimizer (AdamW and scheduler), probes (rollout-level and
per-update). The whole step's wall and CPU time are measured around `rl_step`. The model is freshly initialised (no
warm start), so completions are random text; this times the machinery, not learning.

    python -m benchmarks.bench_step            # tiny and paper shapes (a few minutes on a quiet CPU)
    python -m benchmarks.bench_step --quick    # tiny shape only
Each shape runs with the kernels this machine's measurement chose and with none (MOE_RL_NATIVE=0). Writes
results/bench/<machine>/step.md and step.csv.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
import time
from pathlib import Path

import torch

import moe_rl.rl.trainer
from benchmarks.timing import bench_folder, cpu_class, kernels_lines, no_kernels, write_csv
from moe_rl.model import ModelConfig
from moe_rl.rl.probes import ProbeConfig
from moe_rl.rl.run_config import TrainConfig
from moe_rl.rl.trainer import Trainer

SHAPES = {
    "tiny (default model, L4 E8 K2)": ModelConfig(),
    "paper (d64 L48 E128 K8 F32)": ModelConfig(n_layers=48, n_experts=128, top_k=8, d_expert=32),
}
PHASES = ("sample", "old pass", "updates", "optimizer", "probes")


def phases(lines: list[dict]) -> dict[str, float]:
    """Seconds per phase of one rollout step from its metrics lines (one per optimizer step)."""
    first = lines[0]
    optimizer = sum(line.get("time/optimizer", 0.0) for line in lines)
    return {
        "sample": first["time/rollout"],
        "old pass": first["time/old_pass"],
        "updates": sum(line["time/update"] for line in lines) - optimizer,
        "optimizer": optimizer,
        "probes": first["time/rollout_probes"] + sum(line.get("time/probes", 0.0) for line in lines),
    }


class _CPUClock:
    """Stands in for the `time` module inside moe_rl.rl.trainer, so its time/* metrics count this process's CPU seconds
    (robust on a shared machine) instead of wall seconds."""

    perf_counter = staticmethod(time.process_time)


def _new_trainer(model: ModelConfig, probes: ProbeConfig, steps: int, out_dir: str) -> Trainer:
    cfg = TrainConfig(out_dir=out_dir, model=model, probes=probes, device="cpu", total_steps=steps + 1)
    return Trainer(cfg, torch.device("cpu"))


def _timed_step(trainer: Trainer, kernels: str) -> dict[str, float]:
    """One rollout step: its phases and the whole step's wall and CPU seconds."""
    lines: list[dict] = []
    with no_kernels() if kernels == "none" else contextlib.nullcontext():
        w0, c0 = time.perf_counter(), time.process_time()
        trainer.rl_step(lines.append)
        wall, cpu = time.perf_counter() - w0, time.process_time() - c0
    trainer.step += 1
    return {**phases(lines), "step wall": wall, "step CPU": cpu}


def bench_shape(model: ModelConfig, variants: dict[tuple[str, str], ProbeConfig], steps: int) -> dict:
    """(kernels, probe rows) -> median phases over `steps` measured rollout steps. The contenders take turns, one
    step each, after one warm-up step each (it warms allocators and caches), so that a drift in the machine's speed
    falls on all of them alike and a difference between them is not the minute it was measured in."""
    moe_rl.rl.trainer.time = _CPUClock
    with contextlib.ExitStack() as stack:
        trainers = {key: _new_trainer(model, probes, steps, stack.enter_context(tempfile.TemporaryDirectory()))
                    for key, probes in variants.items()}
        for (kernels, _), trainer in trainers.items():
            _timed_step(trainer, kernels)
        measured: dict = {key: [] for key in trainers}
        for _ in range(steps):
            for (kernels, rows), trainer in trainers.items():
                measured[kernels, rows].append(_timed_step(trainer, kernels))
    return {key: {name: statistics.median(m[name] for m in runs) for name in runs[0]}
            for key, runs in measured.items()}


def markdown(rows: list[dict], command: str) -> str:
    lines = ["# One RL step by phase (CPU, 1 thread)", "", f"Command: `{command}`  ",
             "16 prompts x 8 completions, 4 minibatches, default sampling (16 new tokens). Phase times are CPU "
             "seconds from the trainer's time/* metrics (its clock swapped for process time); the last two columns "
             "time the whole "
             "step (wall and CPU of this process; on a loaded machine wall exceeds CPU). The contenders of a shape "
             "take turns, one rollout step each, after a warm-up step each; medians over the measured steps. "
             f"CPU class {cpu_class()}; 'measured' runs the kernel families this machine's measurement chose "
             "(below), 'none' the torch code everywhere (MOE_RL_NATIVE=0). GPU benchmark: `make gpu-check`.", "",
             *kernels_lines(), "",
             "| shape | kernels | probe rows | " + " | ".join(PHASES) + " | probes share | step wall | step CPU |",
             "|---|---|---|" + "---|" * (len(PHASES) + 3)]
    for r in rows:
        total = sum(r[p] for p in PHASES)
        cells = " | ".join(f"{r[p]:.3f} s" for p in PHASES)
        lines.append(f"| {r['shape']} | {r['kernels']} | {r['probe rows']} | {cells} "
                     f"| {100 * r['probes'] / total:.0f}% "
                     f"| {r['step wall']:.2f} s | {r['step CPU']:.2f} s |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the tiny shape only")
    parser.add_argument("--steps", type=int, default=3,
                        help="measured rollout steps per contender and shape (after one warm-up each), taken in turns")
    parser.add_argument("--out", type=Path, default=None,
                        help="folder for step.md / step.csv (default "
                             "results/bench/<vendor>_<widest ISA>[_capped_<ISA>])")
    args = parser.parse_args()
    torch.set_num_threads(1)
    shapes = list(SHAPES)[:1] if args.quick else list(SHAPES)
    variants = {("measured", "default (32 sequences)"): ProbeConfig(),
                ("none", "default (32 sequences)"): ProbeConfig(),
                ("measured", "whole batch"): ProbeConfig(sequences=None)}
    rows = []
    for shape in shapes:
        medians = bench_shape(SHAPES[shape], variants, args.steps)
        rows += [{"shape": shape, "kernels": kernels, "probe rows": name, **phases_s}
                 for (kernels, name), phases_s in medians.items()]
    command = "python -m benchmarks.bench_step" + (" --quick" if args.quick else "") + \
        (f" --steps {args.steps}" if args.steps != 3 else "")
    args.out = args.out or Path("results/bench") / bench_folder()
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(args.out / "step.csv", rows)
    report = markdown(rows, command)
    (args.out / "step.md").write_text(report)
    print(report)


if __name__ == "__main__":
    main()
