"""Where the time of the `Experts` module goes on a CUDA device: the GPU check (benchmarks/gpu_check.py, part 3) gives
the whole module's forward+backward against a dense matmul chain of equal FLOPs; this splits that gap.

Contenders, forward+backward each, interleaved, bf16 operands, CUDA events, medians:
- 'Experts module': `Experts(dispatch='grouped')` as the trainer calls it (sort, gather, grouped products, SwiGLU,
  gate weights in fp32, index_add into fp32 rows);
- 'grouped products + SwiGLU': the same two `torch._grouped_mm` calls and SwiGLU on rows already sorted by expert
  (no sort, gather, gate weight or combine);
- 'grouped products alone': the two grouped products on independent inputs, the dense chain's exact shapes;
- 'dense matmuls': x_ND @ W_D2F and h_NF @ W_FD over all N = T*K rows (the limit).
Then torch.profiler over a few calls of the whole module: the CUDA kernels that take its time.

What it simplifies: random weights and near-balanced routing (softmax of Gaussian scores), so every expert gets about
T*K/E rows; a trained router's skew would slow the grouped products further.

    python -m benchmarks.gpu_experts                          # Qwen3-30B-A3B's expert shape, 16,384 tokens
    python -m benchmarks.gpu_experts --tokens 4096 --out /tmp # fewer tokens, another folder
Writes <out>/gpu_experts.md (default results/bench/). Without CUDA it prints one line and exits 0, writing nothing.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.gpu_check import NO_CUDA, expert_flops, time_ms
from benchmarks.gpu_report import environment


def contenders(n_experts: int, top_k: int, d_model: int, d_expert: int, tokens: int, device: torch.device) -> dict:
    """name -> a callable running one forward+backward."""
    from moe_rl.model.moe import Experts, sort_slots

    torch.manual_seed(0)
    low = torch.bfloat16
    with device:
        experts = Experts(n_experts, d_model, d_expert, "grouped")
    for w in (experts.w_gate_up, experts.w_down):
        torch.nn.init.normal_(w, std=0.02)
    experts = experts.to(low)
    scores_TE = torch.randn(tokens, n_experts, device=device).softmax(-1)
    ids_TK = scores_TE.topk(top_k, dim=-1).indices
    weights_TK = scores_TE.gather(-1, ids_TK).requires_grad_()
    x_TD = torch.randn(tokens, d_model, device=device, dtype=low, requires_grad=True)

    N = tokens * top_k
    offs_E = sort_slots(ids_TK, n_experts).counts_E.cumsum(0).to(torch.int32)
    leaf = lambda *shape: torch.randn(*shape, device=device, dtype=low, requires_grad=True)  # noqa: E731
    x_ND, h_NF = leaf(N, d_model), leaf(N, d_expert)
    w_ED2F, w_EFD = leaf(n_experts, d_model, 2 * d_expert), leaf(n_experts, d_expert, d_model)
    w_D2F, w_FD = leaf(d_model, 2 * d_expert), leaf(d_expert, d_model)

    # backward from dense random gradients (a .sum()'s expanded gradient has stride 0, which grouped_mm refuses)
    g_TD, g_ND, g_N2F = (torch.randn(*shape, device=device, dtype=low)
                         for shape in ((tokens, d_model), (N, d_model), (N, 2 * d_expert)))

    def products_swiglu():
        gate_NF, up_NF = torch._grouped_mm(x_ND, w_ED2F, offs=offs_E).chunk(2, dim=-1)
        torch._grouped_mm(F.silu(gate_NF) * up_NF, w_EFD, offs=offs_E).backward(g_ND)

    def products_alone():  # the dense chain's shapes: D x 2F on x, F x D on an independent h
        torch.autograd.backward([torch._grouped_mm(x_ND, w_ED2F, offs=offs_E),
                                 torch._grouped_mm(h_NF, w_EFD, offs=offs_E)], [g_N2F, g_ND])

    def dense():
        torch.autograd.backward([x_ND @ w_D2F, h_NF @ w_FD], [g_N2F, g_ND])

    return {"Experts module": lambda: experts(x_TD, weights_TK, ids_TK).backward(g_TD),
            "grouped products + SwiGLU": products_swiglu,
            "grouped products alone": products_alone,
            "dense matmuls": dense}


def kernel_table(fn, calls: int, rows: int) -> list[tuple[str, float, int]]:
    """(CUDA kernel name, ms per call, launches per call) of the `rows` kernels taking most device time."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    events.sort(key=lambda e: e.self_device_time_total, reverse=True)
    return [(e.key, e.self_device_time_total / 1e3 / calls, e.count // calls) for e in events[:rows]]


def report(args: argparse.Namespace, device: torch.device) -> str:
    E, K, D, Fw = args.experts, args.top_k, args.d_model, args.d_expert
    fns = contenders(E, K, D, Fw, args.tokens, device)
    times = time_ms(fns, device, warmup=3, repeat=args.repeat, seconds=60)
    flops = expert_flops(args.tokens, K, D, Fw)
    dense = statistics.median(times["dense matmuls"])
    env = environment(device)
    lines = ["# Expert time on GPU, split", "",
             f"Command: `python -m benchmarks.gpu_experts --tokens {args.tokens} --experts {E} --top-k {K} "
             f"--d-model {D} --d-expert {Fw}`  ",
             f"GPU: {env.get('gpu')} (compute capability {env.get('capability')}); torch {env['torch']}, CUDA "
             f"{env['cuda']}; {env['utc']}.", "",
             f"E{E} K{K} D{D} F{Fw}, {args.tokens:,} tokens ({args.tokens * K:,} token-slots), bf16 operands, "
             "forward+backward; FLOPs as in the GPU check (18 T K D F). Median of interleaved calls (CUDA events).",
             "", "| contender | ms | TFLOP/s | of dense |", "|---|---|---|---|"]
    for name, t in times.items():
        ms = statistics.median(t)
        lines.append(f"| {name} | {ms:.3f} | {flops / ms / 1e9:.1f} | {dense / ms:.0%} |")
    lines += ["", "CUDA kernels of the whole module, per forward+backward (torch.profiler, "
              f"{args.profile_calls} calls):", "", "| kernel | ms | launches |", "|---|---|---|"]
    for name, ms, count in kernel_table(fns["Experts module"], args.profile_calls, args.kernels):
        lines.append(f"| `{name[:110]}` | {ms:.3f} | {count} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_experts", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=16_384)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--d-model", type=int, default=2048)
    parser.add_argument("--d-expert", type=int, default=768)
    parser.add_argument("--repeat", type=int, default=20, help="timed calls per contender")
    parser.add_argument("--profile-calls", type=int, default=5)
    parser.add_argument("--kernels", type=int, default=15, help="rows of the kernel table")
    parser.add_argument("--out", type=Path, default=Path("results/bench"))
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print(NO_CUDA)
        return 0
    text = report(args, torch.device("cuda"))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_experts.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
