"""Speed of the native MoE transformer against Hugging Face Qwen3-MoE of the same size, on CPU (one thread).

Three measures, each with its contenders interleaved in one run (medians of wall and of CPU time, and their ratios):
1. forward+backward of the whole model: native (dispatch 'grouped', and the 'loop' reference) vs HF Qwen3-MoE
   built from a config of the same size (no download; experts implementation 'grouped_mm');
2. sampling: `moe_rl.rl.rollout.generate` vs HF `generate`, batch 64, prompt 16, 64 new tokens, sampling on
   (temperature 1, no top-k, top-p 1), every sequence running the full length (EOS never ends one);
3. the `Experts` module alone on 1,024 tokens, forward+backward, per dispatch kernel, against a dense matmul chain
   of the same FLOPs (x_ND @ W_D2F, h_NF @ W_FD over N = T*K rows): the matmul limit.

What it simplifies: random weights and tokens (routing at init is near-balanced, which favours no kernel in
particular: 'grouped' picks its kernel per call from the actual group sizes). CPU only; the GPU path is checked by
tests/benchmarks/test_gpu.py, not timed here.

    python -m benchmarks.bench_model            # about 3 minutes on a quiet CPU
    python -m benchmarks.bench_model --quick    # fewer repeats
    python -m benchmarks.bench_model --repeat 21    # more repeats, for a shared machine whose speed drifts
Each native contender also runs with every kernel family off ('no kernels', what MOE_RL_NATIVE=0 runs), so that the
table shows what the kernels this machine chose are worth here. Writes results/bench/<machine>/model.md and
model.csv (the class from the CPU and any ISA cap in force: avx512, avx2 or baseline), with the kernel paths taken.
"""

from __future__ import annotations

import argparse
import copy
import platform
from pathlib import Path

import torch

from benchmarks.timing import bench_folder, cpu_class, interleaved, kernels_lines, no_kernels, write_csv
from moe_rl import kernels
from moe_rl.model import ModelConfig, MoETransformer
from moe_rl.model.moe import Experts
from moe_rl.rl.rollout import SamplingConfig, generate

COMMON = dict(d_model=64, n_heads=4, n_kv_heads=2, vocab_size=99, max_seq_len=256)
SHAPES = {
    # name: (ModelConfig kwargs, batch, seq_len) — the three shapes of the performance issue
    "d64 L4 E8 K2 F64": (dict(COMMON, n_layers=4, n_experts=8, top_k=2, d_expert=64), 16, 64),
    "d64 L8 E128 K8 F32": (dict(COMMON, n_layers=8, n_experts=128, top_k=8, d_expert=32), 16, 64),
    "d256 L4 E16 K4 F256": (dict(vocab_size=1024, d_model=256, n_layers=4, n_heads=8, n_kv_heads=4, n_experts=16,
                                 top_k=4, d_expert=256, max_seq_len=256), 8, 128),
}
SAMPLER_SHAPES = ("d64 L4 E8 K2 F64", "d64 L8 E128 K8 F32")
EXPERT_KERNELS = ("grouped", "grouped_mm", "padded", "loop")
EXPERT_COLUMNS = ("grouped", "grouped, no kernels", "grouped_mm", "padded", "loop")


def hf_qwen3_moe(cfg: ModelConfig):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    hf_cfg = Qwen3MoeConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads, head_dim=cfg.head_dim,
        intermediate_size=cfg.d_dense, moe_intermediate_size=cfg.d_expert, num_experts=cfg.n_experts,
        num_experts_per_tok=cfg.top_k, norm_topk_prob=cfg.norm_topk_prob, decoder_sparse_step=1,
        max_position_embeddings=cfg.max_seq_len, output_router_logits=True,
        router_aux_loss_coef=cfg.aux_loss_coef, tie_word_embeddings=False,
    )
    model = Qwen3MoeForCausalLM(copy.deepcopy(hf_cfg))
    model.set_experts_implementation("grouped_mm")
    return model


def without_kernels(fn):
    def run():
        with no_kernels():
            return fn()
    return run


def native_step(model, ids):
    def step():
        model.zero_grad(set_to_none=True)
        out = model(ids)
        (out.logits_BSV.logsumexp(-1).mean() + out.aux_loss).backward()
    return step


def hf_step(model, ids):
    def step():
        model.zero_grad(set_to_none=True)
        out = model(input_ids=ids, use_cache=False)
        (out.logits.logsumexp(-1).mean() + model.config.router_aux_loss_coef * out.aux_loss).backward()
    return step


def bench_fwd_bwd(name: str, repeat: int) -> list[dict]:
    kwargs, batch, seq_len = SHAPES[name]
    cfg = ModelConfig(**kwargs)
    torch.manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq_len))
    native = MoETransformer(cfg, kernels=kernels.machine())
    loop = MoETransformer(ModelConfig(**{**kwargs, "dispatch": "loop"}), kernels=kernels.machine())
    loop.load_state_dict(native.state_dict())
    times = interleaved({"native": native_step(native, ids),
                         "native, no kernels": without_kernels(native_step(native, ids)),
                         "native loop": native_step(loop, ids),
                         "HF Qwen3-MoE": hf_step(hf_qwen3_moe(cfg), ids)}, repeat)
    return [{"section": "fwd_bwd", "shape": name, "tokens": f"{batch}x{seq_len}", "contender": c, **t}
            for c, t in times.items()]


def bench_sampler(name: str, repeat: int, batch=64, prompt_len=16, new_tokens=64) -> list[dict]:
    from transformers import GenerationConfig

    cfg = ModelConfig(**SHAPES[name][0])
    torch.manual_seed(0)
    native = MoETransformer(cfg, kernels=kernels.machine()).eval()
    hf = hf_qwen3_moe(cfg).eval()
    ids = torch.randint(3, cfg.vocab_size, (batch, prompt_len))
    valid = torch.ones_like(ids, dtype=torch.bool)
    sampling = SamplingConfig(max_new_tokens=new_tokens)
    hf_gen = GenerationConfig(do_sample=True, max_new_tokens=new_tokens, min_new_tokens=new_tokens, top_k=0,
                              top_p=1.0, temperature=1.0, eos_token_id=None, pad_token_id=0)

    def run_native():  # EOS id -1 never occurs: every row runs the full length
        generate(native, ids, valid, sampling, eos_id=-1, pad_id=0, generator=torch.Generator().manual_seed(0))

    def run_hf():
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=valid.long(), generation_config=hf_gen)
        assert out.shape == (batch, prompt_len + new_tokens)

    times = interleaved({"native generate": run_native, "native, no kernels": without_kernels(run_native),
                         "HF generate": run_hf}, repeat)
    return [{"section": "sampler", "shape": name, "tokens": f"{batch}x({prompt_len}+{new_tokens})", "contender": c,
             **t, "tok_s_wall": batch * new_tokens / t["wall"], "tok_s_cpu": batch * new_tokens / t["cpu"]}
            for c, t in times.items()]


def bench_experts(name: str, repeat: int, tokens: int = 1024) -> list[dict]:
    cfg = ModelConfig(**SHAPES[name][0])
    D, F, E, K = cfg.d_model, cfg.d_expert, cfg.n_experts, cfg.top_k
    torch.manual_seed(0)
    experts = Experts(E, D, F, "grouped")
    torch.nn.init.normal_(experts.w_gate_up, std=cfg.init_std)
    torch.nn.init.normal_(experts.w_down, std=cfg.init_std)
    x_TD = torch.randn(tokens, D, requires_grad=True)
    scores_TE = torch.randn(tokens, E).softmax(-1)
    ids_TK = scores_TE.topk(K, dim=-1).indices
    weights_TK = scores_TE.gather(-1, ids_TK).requires_grad_()
    fns = {}
    for kernel in EXPERT_KERNELS:
        module = copy.deepcopy(experts)
        module.dispatch = kernel
        fns[kernel] = lambda m=module: m(x_TD, weights_TK, ids_TK, kernels.machine()).sum().backward()
    fns["grouped, no kernels"] = without_kernels(fns["grouped"])
    a_ND = torch.randn(tokens * K, D, requires_grad=True)
    w1 = torch.randn(D, 2 * F, requires_grad=True)
    h_NF = torch.randn(tokens * K, F, requires_grad=True)
    w2 = torch.randn(F, D, requires_grad=True)
    fns["dense limit"] = lambda: ((a_ND @ w1).sum() + (h_NF @ w2).sum()).backward()
    flops = 3 * 2 * tokens * K * (D * 2 * F + F * D)  # forward + backward (2x forward) of both matmuls
    times = interleaved(fns, repeat)
    dense = times["dense limit"]
    return [{"section": "experts", "shape": name, "tokens": str(tokens), "contender": c, **t,
             "gflops_wall": flops / t["wall"] / 1e9, "gflops_cpu": flops / t["cpu"] / 1e9,
             "of_dense_cpu": dense["cpu"] / t["cpu"], "of_dense_wall": dense["wall"] / t["wall"]}
            for c, t in times.items()]


def _ratio(rows, section, shape, ours, theirs, key):
    pick = {r["contender"]: r for r in rows if r["section"] == section and r["shape"] == shape}
    return pick[theirs][key] / pick[ours][key]


def markdown(rows: list[dict], command: str) -> str:
    lines = [
        "# Model, sampler and expert-kernel speed (CPU, 1 thread)", "",
        f"Command: `{command}`  ", f"Machine: {platform.machine()}, {torch.get_num_threads()} torch thread, "
        f"torch {torch.__version__}, CPU class {cpu_class()}. Contenders interleaved; medians of wall and CPU "
        "(process) time. 'native' runs the kernel families this machine's measurement chose (below); 'no kernels' "
        "the torch code everywhere (MOE_RL_NATIVE=0). GPU benchmark: not run here (`make gpu-check`).", "",
        *kernels_lines(), "",
        "## Forward + backward", "",
        "| shape | tokens | native | native, no kernels | native loop | HF Qwen3-MoE | HF / native (wall) "
        "| HF / native (CPU) | no kernels / native (CPU) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for shape in SHAPES:
        pick = {r["contender"]: r for r in rows if r["section"] == "fwd_bwd" and r["shape"] == shape}
        cell = lambda c, pick=pick: f"{pick[c]['wall'] * 1e3:.1f} ms ({pick[c]['cpu'] * 1e3:.1f} CPU)"
        hf_over_native = {key: _ratio(rows, "fwd_bwd", shape, "native", "HF Qwen3-MoE", key) for key in ("wall", "cpu")}
        plain = _ratio(rows, "fwd_bwd", shape, "native", "native, no kernels", "cpu")
        lines.append(f"| {shape} | {pick['native']['tokens']} | {cell('native')} | {cell('native, no kernels')} "
                     f"| {cell('native loop')} | {cell('HF Qwen3-MoE')} | {hf_over_native['wall']:.2f}x "
                     f"| {hf_over_native['cpu']:.2f}x | {plain:.2f}x |")
    lines += ["", "## Sampling: batch 64, prompt 16, 64 new tokens, every sequence full length", "",
              "| shape | native tok/s (wall / CPU) | no kernels tok/s (wall / CPU) | HF generate tok/s (wall / CPU) "
              "| native / HF (wall) | native / HF (CPU) | no kernels / HF (CPU) |", "|---|---|---|---|---|---|---|"]
    for shape in SAMPLER_SHAPES:
        pick = {r["contender"]: r for r in rows if r["section"] == "sampler" and r["shape"] == shape}
        n, p, h = pick["native generate"], pick["native, no kernels"], pick["HF generate"]
        lines.append(f"| {shape} | {n['tok_s_wall']:,.0f} / {n['tok_s_cpu']:,.0f} | {p['tok_s_wall']:,.0f} / "
                     f"{p['tok_s_cpu']:,.0f} | {h['tok_s_wall']:,.0f} / {h['tok_s_cpu']:,.0f} "
                     f"| {n['tok_s_wall'] / h['tok_s_wall']:.2f}x | {n['tok_s_cpu'] / h['tok_s_cpu']:.2f}x "
                     f"| {p['tok_s_cpu'] / h['tok_s_cpu']:.2f}x |")
    lines += ["", "## Expert matmuls: the `Experts` module alone, 1,024 tokens, forward + backward", "",
              "GFLOP/s of CPU time (share of the dense-matmul limit of equal FLOPs). 'grouped' is the default: it "
              "picks grouped_mm or padded per call.", "",
              "| shape | " + " | ".join(EXPERT_COLUMNS) + " | dense limit |",
              "|---|" + "---|" * (len(EXPERT_COLUMNS) + 1)]
    for shape in SHAPES:
        pick = {r["contender"]: r for r in rows if r["section"] == "experts" and r["shape"] == shape}
        cells = [f"{pick[k]['gflops_cpu']:.1f} ({100 * pick[k]['of_dense_cpu']:.0f}%)" for k in EXPERT_COLUMNS]
        lines.append(f"| {shape} | " + " | ".join(cells) + f" | {pick['dense limit']['gflops_cpu']:.1f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer repeats (noisier numbers)")
    parser.add_argument("--repeat", type=int, default=7,
                        help="interleaved runs per contender for forward+backward (the sampler gets half, at least 3; "
                             "the expert kernels twice as many); raise it on a shared machine whose speed drifts")
    parser.add_argument("--out", type=Path, default=None,
                        help="folder for model.md / model.csv (default results/bench/<vendor>_<widest ISA>, with "
                             "_capped_<ISA> under an ISA cap: intel_avx512, intel_avx512_capped_avx2, amd_avx2, ...)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    repeat = 3 if args.quick else args.repeat
    rows = []
    for shape in SHAPES:
        rows += bench_fwd_bwd(shape, repeat)
    for shape in SAMPLER_SHAPES:
        rows += bench_sampler(shape, max(3, repeat // 2))
    for shape in SHAPES:
        rows += bench_experts(shape, repeat * 2)
    command = "python -m benchmarks.bench_model" + (" --quick" if args.quick else "") + \
        (f" --repeat {args.repeat}" if args.repeat != 7 and not args.quick else "")
    args.out = args.out or Path("results/bench") / bench_folder()
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(args.out / "model.csv", rows)
    report = markdown(rows, command)
    (args.out / "model.md").write_text(report)
    print(report)


if __name__ == "__main__":
    main()
