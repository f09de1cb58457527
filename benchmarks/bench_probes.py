"""Benchmark the cost of routing instrumentation on CPU (one thread).

1. Recording overhead: one training step (forward, backward, AdamW step) on a minibatch, with and without a
   routing record session around the forward. Target: recording costs at most 3% of a training step.
2. Update-probe cost on the whole batch (`probes.sequences=None`): `Prober.after_update` (what the trainer runs
   after every optimizer step) against one plain no-grad forward of the probed tokens. Target: at most the cost of
   that one forward.

Timings interleave the variants (A B A B ...) and report medians, so drift on a shared machine hits both.
Writes `results/bench/<machine>/probes.json` and `probes.md` (the folder: `benchmarks.timing.bench_folder`) and
prints the table.

    python -m benchmarks.bench_probes
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from contextlib import nullcontext
from pathlib import Path

import torch

from benchmarks.timing import bench_folder
from moe_rl import kernels
from moe_rl.model import ModelConfig, MoETransformer
from moe_rl.rl.policy import policy_forward
from moe_rl.rl.probes import ProbeConfig, Prober
from moe_rl.rl.rollout import SamplingConfig, encode_prompts, generate, to_rollout_batch
from moe_rl.routing.replay import record_routing
from moe_rl.tasks import CharTokenizer


def rollout_batch(model, rows: int, new_tokens: int):
    tok = CharTokenizer()
    prompts = [f"{i % 10}+{(3 * i) % 10}-{(7 * i) % 10}=" for i in range(rows)]
    ids, valid = encode_prompts(prompts, tok, "cpu")
    gen = generate(model, ids, valid, SamplingConfig(max_new_tokens=new_tokens), eos_id=-1, pad_id=tok.pad_id,
                   generator=torch.Generator().manual_seed(0), record=True)
    advantages = torch.randn(rows)
    return to_rollout_batch(gen, advantages, advantages, 8, prompts, [""] * rows)


def train_step(model, optimizer, batch, record: bool):
    ctx = record_routing(model) if record else nullcontext()
    with ctx:
        out = model(batch.input_ids_BS, batch.input_valid_BS)
    logits = out.logits_BSV[:, batch.prompt_len - 1 :]
    logp = logits.log_softmax(-1).gather(-1, batch.response_BN[..., None]).squeeze(-1)
    loss = -(logp * batch.advantages_B[:, None] * batch.response_mask_BN).sum() / batch.response_mask_BN.sum()
    optimizer.zero_grad(set_to_none=True)
    (loss + out.aux_loss).backward()
    optimizer.step()


@torch.no_grad()
def no_grad_forward(model, batch, record: bool):
    with record_routing(model) if record else nullcontext():
        model(batch.input_ids_BS, batch.input_valid_BS)


def interleaved_medians(fns: dict, repeat: int) -> dict[str, float]:
    """Median time of each function, run in alternating order (A B C, C B A, ...) so drift hits all alike."""
    times = {name: [] for name in fns}
    for fn in fns.values():  # warm up
        fn()
    for rep in range(repeat):
        order = list(fns.items()) if rep % 2 == 0 else list(fns.items())[::-1]
        for name, fn in order:
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) for name, ts in times.items()}


def bench(model_cfg: ModelConfig, rows: int, minibatches: int, new_tokens: int, repeat: int) -> dict:
    torch.manual_seed(0)
    model = MoETransformer(model_cfg, kernels=kernels.machine())
    batch = rollout_batch(model, rows, new_tokens)
    chunks = list(torch.arange(rows).tensor_split(minibatches))
    minibatch = batch.rows(chunks[0])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    step_times = interleaved_medians({
        "step_plain": lambda: train_step(model, optimizer, minibatch, record=False),
        "step_recorded": lambda: train_step(model, optimizer, minibatch, record=True),
        "step_plain_again": lambda: train_step(model, optimizer, minibatch, record=False),
    }, repeat)
    forward_times = interleaved_medians({
        "forward_plain": lambda: no_grad_forward(model, minibatch, record=False),
        "forward_recorded": lambda: no_grad_forward(model, minibatch, record=True),
    }, repeat)
    prober = Prober(ProbeConfig(sequences=None), batch, chunks, temperature=1.0, seed=0, step=0)
    prober.start(model, 0, None, None, model_cfg.n_experts)

    def plain_forward():
        with torch.no_grad():
            for chunk in chunks:
                policy_forward(model, batch.rows(chunk), 1.0)

    updates = iter(range(10**6))

    def update_probe():  # as in training: each call follows a new optimizer step, the cached "before" is current
        prober.after_update(model, next(updates), 0)

    probe_times = interleaved_medians({"forward_probed_tokens": plain_forward, "update_probe": update_probe}, repeat)
    return {"rows": rows, "minibatches": minibatches, "new_tokens": new_tokens, **step_times, **forward_times,
            **probe_times,
            "record_forward_overhead": forward_times["forward_recorded"] / forward_times["forward_plain"] - 1,
            "record_overhead": step_times["step_recorded"] / step_times["step_plain"] - 1,
            "noise_floor": step_times["step_plain_again"] / step_times["step_plain"] - 1,
            "probe_vs_forward": probe_times["update_probe"] / probe_times["forward_probed_tokens"]}


SIZES = {
    "tiny (default RL model)": ModelConfig(),
    "small": ModelConfig(d_model=256, n_layers=4, n_heads=8, n_kv_heads=4, n_experts=16, top_k=4, d_expert=256),
}


def markdown(rows: list[dict], command: str) -> str:
    lines = [
        "# Routing instrumentation overhead (CPU, 1 thread)", "", f"Command: `{command}`", "",
        "| model | rollout rows x new tokens | train step | + recording | recording overhead | same step again "
        "(noise floor) | recording overhead, no-grad forward | no-grad forward of probed tokens | update probe "
        "| probe / forward |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['size']} | {r['rows']} x {r['new_tokens']} | {r['step_plain'] * 1e3:.1f} ms "
            f"| {r['step_recorded'] * 1e3:.1f} ms | {100 * r['record_overhead']:+.1f}% "
            f"| {100 * r['noise_floor']:+.1f}% | {100 * r['record_forward_overhead']:+.1f}% "
            f"| {r['forward_probed_tokens'] * 1e3:.1f} ms | {r['update_probe'] * 1e3:.1f} ms "
            f"| {r['probe_vs_forward']:.2f} |"
        )
    lines += ["", "The train step is one minibatch (rows / minibatches); the probe covers the whole rollout batch."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=21, help="timed repetitions per variant")
    parser.add_argument("--out", type=Path, default=None,
                        help="output folder (default results/bench/<vendor>_<widest ISA>[_capped_<ISA>], "
                             "e.g. intel_avx512)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    for size, cfg in SIZES.items():
        rows.append({"size": size, **bench(cfg, rows=128, minibatches=4, new_tokens=16, repeat=args.repeat)})
    command = "python -m benchmarks.bench_probes" + (f" --repeat {args.repeat}" if args.repeat != 21 else "")
    report = markdown(rows, command)
    args.out = args.out or Path("results/bench") / bench_folder()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "probes.json").write_text(json.dumps(rows, indent=2))
    (args.out / "probes.md").write_text(report)
    print(report)


if __name__ == "__main__":
    main()
