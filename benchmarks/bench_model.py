"""Benchmark the native MoE transformer and its sampler on CPU.

Measures, on one thread (see README, "Threads"):
1. forward+backward time of the native model with grouped dispatch, with the per-expert loop dispatch, and of
   Hugging Face transformers' Qwen3-MoE built from a config of the same size (no download; each HF model is built
   from its own copy of the config, one per experts implementation);
2. sampler throughput (new tokens per second) with the KV cache and with prefix recomputation, at batch 64 and
   64 new tokens.

Writes `results/bench/model.json` and `results/bench/model.md` and prints the table.

    python -m benchmarks.bench_model            # full benchmark (a few minutes on CPU)
    python -m benchmarks.bench_model --quick    # smaller repeat counts
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from moe_rl.model import ModelConfig, MoETransformer
from moe_rl.rollout import SamplingConfig, generate

SIZES = {
    # name: (ModelConfig kwargs, batch, seq_len)
    "tiny": (dict(vocab_size=99, d_model=64, n_layers=4, n_heads=4, n_kv_heads=2, n_experts=8, top_k=2,
                  d_expert=64, max_seq_len=256), 16, 64),
    "small": (dict(vocab_size=1024, d_model=256, n_layers=4, n_heads=8, n_kv_heads=4, n_experts=16, top_k=4,
                   d_expert=256, max_seq_len=256), 8, 128),
}


def median_time(fn, warmup: int, repeat: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def fwd_bwd_native(model: MoETransformer, ids):
    def step():
        model.zero_grad(set_to_none=True)
        out = model(ids)
        (out.logits_BSV.float().logsumexp(-1).mean() + out.aux_loss).backward()

    return step


def hf_qwen3_moe(cfg: ModelConfig, experts_implementation: str):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    hf_cfg = Qwen3MoeConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads, head_dim=cfg.head_dim,
        intermediate_size=cfg.d_dense, moe_intermediate_size=cfg.d_expert, num_experts=cfg.n_experts,
        num_experts_per_tok=cfg.top_k, norm_topk_prob=cfg.norm_topk_prob, decoder_sparse_step=1,
        max_position_embeddings=cfg.max_seq_len, output_router_logits=True,
        router_aux_loss_coef=cfg.aux_loss_coef, tie_word_embeddings=False,
    )
    model = Qwen3MoeForCausalLM(copy.deepcopy(hf_cfg))  # each model from its own copy of the config
    model.set_experts_implementation(experts_implementation)
    model.config.use_cache = False
    return model


def fwd_bwd_hf(model, ids):
    def step():
        model.zero_grad(set_to_none=True)
        out = model(input_ids=ids, use_cache=False)
        loss = out.logits.float().logsumexp(-1).mean() + model.config.router_aux_loss_coef * out.aux_loss
        loss.backward()

    return step


def bench_fwd_bwd(size: str, warmup: int, repeat: int) -> dict:
    kwargs, batch, seq_len = SIZES[size]
    cfg = ModelConfig(**kwargs)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq_len))
    torch.manual_seed(0)
    grouped = MoETransformer(cfg)
    loop = MoETransformer(ModelConfig(**{**kwargs, "dispatch": "loop"}))
    loop.load_state_dict(grouped.state_dict())
    row = {"size": size, "batch": batch, "seq_len": seq_len, "params": grouped.num_params()}
    row["native_grouped_s"] = median_time(fwd_bwd_native(grouped, ids), warmup, repeat)
    row["native_loop_s"] = median_time(fwd_bwd_native(loop, ids), warmup, repeat)
    for impl in ("grouped_mm", "eager"):
        row[f"hf_{impl}_s"] = median_time(fwd_bwd_hf(hf_qwen3_moe(cfg, impl), ids), warmup, repeat)
    return row


def bench_sampler(batch: int, new_tokens: int, prompt_len: int, repeat: int) -> dict:
    cfg = ModelConfig(**SIZES["tiny"][0])
    torch.manual_seed(0)
    model = MoETransformer(cfg).eval()
    ids = torch.randint(3, cfg.vocab_size, (batch, prompt_len))
    valid = torch.ones_like(ids, dtype=torch.bool)
    # EOS id outside the vocabulary: every sequence runs the full 64 tokens, so both paths do equal work.
    sampling = SamplingConfig(max_new_tokens=new_tokens)
    row = {"batch": batch, "new_tokens": new_tokens, "prompt_len": prompt_len}
    for use_cache in (True, False):
        def run():
            generate(model, ids, valid, sampling, eos_id=-1, pad_id=0,
                     generator=torch.Generator().manual_seed(0), use_cache=use_cache)
        seconds = median_time(run, 1, repeat)
        row["cached_tok_s" if use_cache else "recompute_tok_s"] = batch * new_tokens / seconds
    return row


def markdown(fwd_rows: list[dict], sampler: dict, command: str) -> str:
    lines = [
        "# Model and sampler speed (CPU, 1 thread)", "", f"Command: `{command}`", "",
        f"Machine: {platform.processor() or platform.machine()}, torch {torch.__version__}", "",
        "## Forward + backward (median seconds per step)", "",
        "| size | tokens | params (total / active) | native grouped | native loop | HF Qwen3-MoE grouped_mm "
        "| HF Qwen3-MoE eager | grouped vs HF best |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in fwd_rows:
        hf_best = min(r["hf_grouped_mm_s"], r["hf_eager_s"])
        lines.append(
            f"| {r['size']} | {r['batch']}x{r['seq_len']} | {r['params']['total']:,} / {r['params']['active']:,} "
            f"| {r['native_grouped_s']:.4f} | {r['native_loop_s']:.4f} | {r['hf_grouped_mm_s']:.4f} "
            f"| {r['hf_eager_s']:.4f} | {hf_best / r['native_grouped_s']:.2f}x |"
        )
    speedup = sampler["cached_tok_s"] / sampler["recompute_tok_s"]
    lines += [
        "", f"## Sampler (tiny model, batch {sampler['batch']}, prompt {sampler['prompt_len']}, "
        f"{sampler['new_tokens']} new tokens)", "",
        "| KV cache | recompute prefix | speed-up |", "|---|---|---|",
        f"| {sampler['cached_tok_s']:.0f} tok/s | {sampler['recompute_tok_s']:.0f} tok/s | {speedup:.1f}x |",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer repeats (noisier numbers)")
    parser.add_argument("--out", type=Path, default=Path("results/bench"), help="folder for model.json/model.md")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1; see README)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    warmup, repeat = (1, 3) if args.quick else (2, 7)
    fwd_rows = [bench_fwd_bwd(size, warmup, repeat) for size in SIZES]
    sampler = bench_sampler(batch=64, new_tokens=64, prompt_len=16, repeat=repeat)
    command = "python -m benchmarks.bench_model" + (" --quick" if args.quick else "")
    report = markdown(fwd_rows, sampler, command)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "model.json").write_text(json.dumps({"fwd_bwd": fwd_rows, "sampler": sampler}, indent=2))
    (args.out / "model.md").write_text(report)
    print(report)


if __name__ == "__main__":
    main()
