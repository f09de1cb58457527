"""The GPU check: does the native model train, replay and scale on a CUDA device, and how fast? One process (plus one
torchrun sub-process), five parts, each with its own time budget; a part that fails is reported with its error and the
others still run.

1. bf16 training steps of `MoETransformer` at two bench shapes (benchmarks/bench_model.py), under the trainer's CUDA
   autocast (bf16, routers in fp32): the loss is finite, every parameter changes, milliseconds per step (AdamW
   included; CUDA events, median after warm-up).
2. Replay exactness under bf16 autocast: routing recorded on a forward (`moe_rl.routing.replay.record_routing`) and
   replayed (`replay_routing`) must give bit-identical logits and router gradients (`torch.equal`). Measured twice, with
   torch's default kernels and with `torch.use_deterministic_algorithms(True)` (strict; warn-only if some op has no
   deterministic kernel), each beside a second native pass (the floor: CUDA's atomic adds may reorder a sum between
   any two passes, replay or not). The verdict is the deterministic one; a replay of shifted ids must change the
   logits (so a replay that did nothing cannot pass).
3. `grouped_mm` expert throughput: the `Experts` module (dispatch 'grouped', which takes torch._grouped_mm on CUDA)
   forward+backward at E128 K8 D1024 F512 and at Qwen3-30B-A3B's expert shape (E128 K8 D2048 F768), with bf16 weights
   and with fp32 weights under autocast (as the trainer runs it), against a dense matmul chain of equal FLOPs
   (x_ND @ W_D2F, h_NF @ W_FD over N = T*K rows): TFLOP/s of each and the ratio.
4. An FSDP2 run of the real command: torchrun over every visible GPU, `moe-rl train --parallel fsdp2 --device cuda`
   for a few steps; exit status, time, finite losses in metrics.jsonl, and whether the checkpoint says it was sharded.
5. The paper-shaped RL step (`Trainer.rl_step` as in benchmarks/bench_step.py): 48 blocks, E128 K8, d_model 64,
   d_expert 32, 16 prompts x 8 completions, 4 minibatches; seconds per phase, medians of the measured steps after one
   warm-up. The trainer's clock is swapped for one that synchronises the GPU first, so a phase owns its GPU work.

6. The Hugging Face backend (benchmarks/gpu_hf.py), tiny random models of every family under bf16 autocast: record
   and replay give equal logits with deterministic kernels, the routers' own choice under the replay is the recorded
   one, a shifted replay moves the logits; then `moe-rl train --model.backend hf --device cuda` for two steps under R2
   (part 'hf_train').

What it simplifies: random weights, tokens and routing (near-balanced at init); the RL step starts from a fresh model,
so it times the machinery, not learning. With one GPU, torchrun starts one process, for which moe_rl.rl.distributed
forms no process group and `--parallel fsdp2` would change nothing; the torchrun process then joins a group of one
itself (`--fsdp2-worker`), so FSDP2 shards over one rank and its gathers, reduce-scatters and whole-state checkpoint
run.

    python -m benchmarks.gpu_check                 # one GPU or many (parts 1-3, 5 on cuda:0; part 4 on every GPU)
    python -m benchmarks.gpu_check --quick         # smaller everything (8 blocks in part 5)
    python -m benchmarks.gpu_check --parts replay experts    # only some parts (of: train replay experts fsdp2
                                                             # rl_step hf hf_train)
The budgets cap a run near 10 minutes (--quick: 7). On CPU only it prints "gpu_check: no CUDA device; nothing run"
and exits 0, writing nothing. Otherwise it writes results/bench/gpu.md and gpu.json (the raw numbers) after every
part, so a run stopped early keeps what it measured. Exit status 1 when a part failed or a check did not hold.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import math
import os
import signal
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

import torch

from benchmarks.gpu_fsdp2 import fsdp2_step, fsdp2_worker
from benchmarks.gpu_report import autocast, environment, markdown, verdict, write_report  # noqa: F401

# The moe_rl and benchmark imports sit inside the parts, so that a broken import is that part's error in the report.

NO_CUDA = "gpu_check: no CUDA device; nothing run"
PARTS = ("train", "replay", "experts", "fsdp2", "rl_step", "hf", "hf_train")
TRAIN_SHAPES = ("d64 L8 E128 K8 F32", "d256 L4 E16 K4 F256")  # names in benchmarks/bench_model.SHAPES
REPLAY_SHAPE = "d64 L8 E128 K8 F32"  # 128 experts: many near-ties, where a replay that drifted would show
EXPERT_SHAPES = {"E128 K8 D1024 F512": (128, 8, 1024, 512), "E128 K8 D2048 F768 (Qwen3-30B-A3B)": (128, 8, 2048, 768)}


@dataclass(frozen=True)
class Sizes:
    """How much each part does; `QUICK` shrinks everything."""

    train_batch: int = 64
    """Sequences per training step (part 1), of `train_seq` tokens."""
    train_seq: int = 128
    train_steps: int = 10
    """Timed steps per shape, after `warmup`."""
    warmup: int = 3
    replay_batch: int = 16
    replay_seq: int = 64
    expert_tokens: int = 16_384
    expert_repeat: int = 10
    """Timed calls per contender, interleaved."""
    fsdp2_steps: int = 2
    rl_layers: int = 48
    rl_steps: int = 3
    """Measured RL steps after one warm-up."""
    budgets: tuple[tuple[str, float], ...] = (("train", 40), ("replay", 30), ("experts", 30), ("fsdp2", 150),
                                              ("rl_step", 120), ("hf", 15), ("hf_train", 60))
    """Seconds per item of each part (each training shape, each expert shape): a hard limit; the timing loops stop
    adding repeats after 60% of it."""

    def budget(self, part: str) -> float:
        return dict(self.budgets)[part]


DEFAULT = Sizes()
QUICK = Sizes(train_batch=16, train_seq=64, train_steps=3, warmup=1, replay_batch=4, replay_seq=32, expert_tokens=4096,
              expert_repeat=3, rl_layers=8, rl_steps=1,
              budgets=(("train", 20), ("replay", 15), ("experts", 15), ("fsdp2", 120), ("rl_step", 60), ("hf", 15),
                       ("hf_train", 60)))


# ---------------------------------------------------------------------------------------------------------------------
# Timing, limits and comparisons


class PartTimeout(Exception):
    """A part ran past its time budget."""


@contextlib.contextmanager
def time_limit(seconds: float):
    """Raise PartTimeout in the main thread after `seconds` (SIGALRM; the exception lands between Python bytecodes,
    so a single long kernel finishes first)."""
    def expire(signum, frame):
        raise PartTimeout(f"past its budget of {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def elapsed_ms(fn: Callable[[], object], device: torch.device) -> float:
    """Milliseconds of one call: CUDA events around it on the current stream (so it includes the time the host takes
    to queue the work), or wall time on CPU."""
    if device.type != "cuda":
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def time_ms(fns: dict[str, Callable[[], object]], device: torch.device, warmup: int, repeat: int,
            seconds: float) -> dict[str, list[float]]:
    """Milliseconds per call of each fn, interleaved (A B, B A, ...) after `warmup` calls of each; no repeat starts
    once `seconds` have passed since the warm-up (one repeat at least)."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    synchronize(device)
    stop = time.perf_counter() + seconds
    times: dict[str, list[float]] = {name: [] for name in fns}
    order = list(fns.items())
    for rep in range(repeat):
        for name, fn in order if rep % 2 == 0 else order[::-1]:
            times[name].append(elapsed_ms(fn, device))
        if time.perf_counter() > stop:
            break
    return times


def summary_ms(times: list[float]) -> dict[str, float]:
    return {"median_ms": statistics.median(times), "min_ms": min(times), "max_ms": max(times), "n": len(times)}


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def expert_flops(tokens: int, top_k: int, d_model: int, d_expert: int) -> int:
    """FLOPs of one forward+backward of the SwiGLU experts over T*K token-slots: per slot the gate-up product
    (D x 2F) and the down product (F x D) at 2 FLOPs per multiply-add, and the backward twice the forward (the
    gradients of the input and of the weight). The element-wise SwiGLU and the sort are not counted."""
    forward = 2 * tokens * top_k * (d_model * 2 * d_expert + d_expert * d_model)
    return 3 * forward


# ---------------------------------------------------------------------------------------------------------------------
# Part 1: bf16 training steps


def train_steps(shape: str, model_kwargs: dict, batch: int, seq_len: int, steps: int, warmup: int,
                device: torch.device, seconds: float) -> dict:
    """Next-token cross-entropy plus the router losses on one fixed random batch, AdamW (lr 1e-3)."""
    import torch.nn.functional as F

    from moe_rl.model import ModelConfig, MoETransformer

    torch.manual_seed(0)
    cfg = ModelConfig(**{**model_kwargs, "max_seq_len": max(model_kwargs.get("max_seq_len", 0), seq_len)})
    model = MoETransformer(cfg).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids_BS = torch.randint(0, cfg.vocab_size, (batch, seq_len + 1), device=device)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    losses: list[torch.Tensor] = []

    def step():
        optimizer.zero_grad(set_to_none=True)
        with autocast(device):
            out = model(ids_BS[:, :-1])
            logits_NV = out.logits_BSV.float().flatten(0, 1)
            loss = F.cross_entropy(logits_NV, ids_BS[:, 1:].flatten()) + out.aux_loss
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())

    times = time_ms({shape: step}, device, warmup, steps, seconds)[shape]
    loss_values = torch.stack(losses).float().cpu()
    changed = sum(not torch.equal(before[name], p.detach()) for name, p in model.named_parameters())
    finite = bool(loss_values.isfinite().all())
    return {"shape": shape, "tokens": f"{batch}x{seq_len}", "dtype": str(next(model.parameters()).dtype),
            **summary_ms(times), "loss_first": loss_values[0].item(), "loss_last": loss_values[-1].item(),
            "losses_finite": finite, "params_changed": changed, "params": len(before),
            "ok": finite and changed == len(before)}


# ---------------------------------------------------------------------------------------------------------------------
# Part 2: replay exactness


@contextlib.contextmanager
def deterministic_algorithms(warn_only: bool | None):
    """torch.use_deterministic_algorithms for the block: off (None), strict (False: an op without a deterministic
    kernel raises) or warn-only (True); yields the list of warnings caught."""
    was_on, was_warn_only = torch.are_deterministic_algorithms_enabled(), \
        torch.is_deterministic_algorithms_warn_only_enabled()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.use_deterministic_algorithms(warn_only is not None, warn_only=bool(warn_only))
        try:
            yield caught
        finally:
            torch.use_deterministic_algorithms(was_on, warn_only=was_warn_only)


def routed_pass(model, ids_BS: torch.Tensor, device: torch.device, record: bool = False, trace=None):
    """One forward (native, recording, or replaying `trace`) and backward: (logits, router gate gradients per MoE
    layer, the recorded trace or None)."""
    from moe_rl.routing.replay import record_routing, replay_routing

    model.zero_grad(set_to_none=True)
    if record:
        session = record_routing(model)
    elif trace is not None:
        session = replay_routing(model, trace)
    else:
        session = contextlib.nullcontext()
    with session as active, autocast(device):
        out = model(ids_BS)
        loss = out.logits_BSV.float().logsumexp(-1).mean() + out.aux_loss
    loss.backward()
    grads = [layer.router.gate.weight.grad.detach().clone() for layer in model.moe_layers()]
    return out.logits_BSV.detach(), grads, active.trace() if record else None


def compare_passes(a, b) -> dict:
    """Bit-equality and max |difference| of two routed_pass results' logits and router gradients."""
    (logits_a, grads_a, _), (logits_b, grads_b, _) = a, b
    return {"logits_equal": torch.equal(logits_a, logits_b), "logits_max_diff": max_abs_diff(logits_a, logits_b),
            "grads_equal": all(torch.equal(x, y) for x, y in zip(grads_a, grads_b)),
            "grads_max_diff": max(max_abs_diff(x, y) for x, y in zip(grads_a, grads_b))}


def replay_comparison(model, ids_BS: torch.Tensor, device: torch.device, deterministic: bool) -> tuple[dict, tuple]:
    """Record vs replay, and record vs a second native pass (the floor), with torch's default kernels or
    deterministic ones. Deterministic tries strict mode first: with warn_only, SDPA's flash and memory-efficient
    backward stay non-deterministic (they only warn); if some op has no deterministic kernel, warn-only instead.
    Deterministic passes also keep SDPA to flash (deterministic in strict mode) or math, never cuDNN's attention."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    strict_error = None
    for warn_only in (False, True) if deterministic else (None,):
        attention = sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]) if deterministic else \
            contextlib.nullcontext()
        try:
            with deterministic_algorithms(warn_only) as caught, attention:
                native = routed_pass(model, ids_BS, device, record=True)
                again = routed_pass(model, ids_BS, device)
                replayed = routed_pass(model, ids_BS, device, trace=native[2])
            break
        except RuntimeError as exc:
            if warn_only is not False:
                raise
            strict_error = str(exc).splitlines()[0][:300]
    messages = sorted({str(w.message).splitlines()[0][:200] for w in caught})
    kernels = "default" if warn_only is None else \
        "deterministic, " + ("warn only" if warn_only else "strict") + ", SDPA flash or math"
    return {"kernels": kernels, "replay": compare_passes(native, replayed),
            "native_again": compare_passes(native, again), "warnings": messages, "strict_error": strict_error}, native


def replay_exactness(shape: str, model_kwargs: dict, batch: int, seq_len: int, device: torch.device) -> dict:
    from moe_rl.model import ModelConfig, MoETransformer
    from moe_rl.routing.trace import RoutingTrace

    torch.manual_seed(0)
    cfg = ModelConfig(**model_kwargs)
    model = MoETransformer(cfg).to(device)
    ids_BS = torch.randint(0, cfg.vocab_size, (batch, seq_len), device=device)
    result: dict = {"shape": shape, "tokens": f"{batch}x{seq_len}"}
    for mode in ("default", "deterministic"):
        result[mode], native = replay_comparison(model, ids_BS, device, deterministic=mode == "deterministic")
    ids_LBSK = native[2].ids_LBSK
    shifted = RoutingTrace(((ids_LBSK.long() + 1) % cfg.n_experts).to(ids_LBSK.dtype))
    result["shifted_replay_logits_max_diff"] = max_abs_diff(native[0], routed_pass(model, ids_BS, device,
                                                                                   trace=shifted)[0])
    exact = result["deterministic"]["replay"]
    result["ok"] = exact["logits_equal"] and exact["grads_equal"] and result["shifted_replay_logits_max_diff"] > 0
    return result


# ---------------------------------------------------------------------------------------------------------------------
# Part 3: expert throughput


def count_grouped_mm_calls(fn: Callable[[], object]) -> int:
    """How many times `fn` calls torch._grouped_mm from Python (the forward products; autograd's backward calls the
    op from C++ and is not counted)."""
    original = getattr(torch, "_grouped_mm", None)
    if original is None:
        return 0
    calls = [0]

    def counting(*args, **kwargs):
        calls[0] += 1
        return original(*args, **kwargs)

    torch._grouped_mm = counting
    try:
        fn()
    finally:
        torch._grouped_mm = original
    return calls[0]


def expert_throughput(shape: str, n_experts: int, top_k: int, d_model: int, d_expert: int, tokens: int, repeat: int,
                      device: torch.device, seconds: float) -> dict:
    import copy

    from moe_rl.model.moe import Experts

    torch.manual_seed(0)
    low = torch.bfloat16 if device.type == "cuda" else torch.float32  # CPU: fp32 (a run of the bookkeeping only)
    with device:  # made where it runs: no host copy of gigabytes of weights
        experts = Experts(n_experts, d_model, d_expert, "grouped")
    for w in (experts.w_gate_up, experts.w_down):
        torch.nn.init.normal_(w, std=0.02)
    experts_low = copy.deepcopy(experts).to(low)
    scores_TE = torch.randn(tokens, n_experts, device=device).softmax(-1)
    ids_TK = scores_TE.topk(top_k, dim=-1).indices
    weights_TK = scores_TE.gather(-1, ids_TK).requires_grad_()  # the router's output is fp32
    x_TD = torch.randn(tokens, d_model, device=device, dtype=low, requires_grad=True)
    x32_TD = torch.randn(tokens, d_model, device=device, requires_grad=True)  # the trainer's fp32 residual stream

    def under_autocast():
        with autocast(device):
            y_TD = experts(x32_TD, weights_TK, ids_TK)
        y_TD.sum().backward()

    N = tokens * top_k
    a_ND, h_NF = (torch.randn(N, width, device=device, dtype=low, requires_grad=True) for width in (d_model, d_expert))
    w_D2F, w_FD = (torch.randn(*dims, device=device, dtype=low, requires_grad=True)
                   for dims in ((d_model, 2 * d_expert), (d_expert, d_model)))
    low_name = f"experts ({str(low).removeprefix('torch.')} weights)"
    fns = {low_name: lambda: experts_low(x_TD, weights_TK, ids_TK).sum().backward(),
           "experts (fp32 weights, autocast)": under_autocast,
           "dense matmuls": lambda: ((a_ND @ w_D2F).sum() + (h_NF @ w_FD).sum()).backward()}
    with torch.no_grad():
        calls = count_grouped_mm_calls(lambda: experts_low(x_TD, weights_TK, ids_TK))
    times = time_ms(fns, device, warmup=2, repeat=repeat, seconds=seconds)
    flops = expert_flops(tokens, top_k, d_model, d_expert)
    dense_ms = statistics.median(times["dense matmuls"])
    contenders = {name: {**summary_ms(t), "tflops": flops / (statistics.median(t) / 1e3) / 1e12,
                         "of_dense": dense_ms / statistics.median(t)} for name, t in times.items()}
    return {"shape": shape, "tokens": tokens, "flops": flops, "grouped_mm_calls_per_forward": calls,
            "contenders": contenders, "ok": True}


# ---------------------------------------------------------------------------------------------------------------------
# Part 5: the paper-shaped RL step


class SyncedClock:
    """Stands in for the `time` module inside moe_rl.rl.trainer: perf_counter waits for the GPU first, so the trainer's
    time/* metrics give each phase its GPU work, not just the time it took to queue it."""

    def __init__(self, device: torch.device):
        self.device = device

    def perf_counter(self) -> float:
        synchronize(self.device)
        return time.perf_counter()

    def __getattr__(self, name):
        return getattr(time, name)


def rl_step_phases(n_layers: int, steps: int, device: torch.device, seconds: float) -> dict:
    import moe_rl.rl.trainer
    from benchmarks.bench_step import PHASES, phases
    from moe_rl.model import ModelConfig
    from moe_rl.rl.run_config import TrainConfig
    from moe_rl.rl.trainer import Trainer

    model = ModelConfig(d_model=64, n_layers=n_layers, n_experts=128, top_k=8, d_expert=32)
    clock, moe_rl.rl.trainer.time = moe_rl.rl.trainer.time, SyncedClock(device)
    measured, losses = [], []
    try:
        with tempfile.TemporaryDirectory() as out_dir:
            cfg = TrainConfig(out_dir=out_dir, model=model, device=device.type, total_steps=steps + 1, minibatches=4)
            cfg = replace(cfg, rollout=replace(cfg.rollout, prompts_per_step=16, group_size=8))
            trainer = Trainer(cfg, device)
            stop = None
            for step in range(steps + 1):
                lines: list[dict] = []
                synchronize(device)
                t0 = time.perf_counter()
                trainer.rl_step(lines.append)
                synchronize(device)
                wall = time.perf_counter() - t0
                trainer.step += 1
                losses += [line["loss/total"] for line in lines if "loss/total" in line]
                if step == 0:  # warms up the allocator, cuBLAS and the kernels' first launches
                    stop = time.perf_counter() + seconds
                    continue
                measured.append({**phases(lines), "step wall": wall})
                if time.perf_counter() + wall > stop:
                    break
    finally:
        moe_rl.rl.trainer.time = clock
    medians = {key: statistics.median(m[key] for m in measured) for key in measured[0]}
    finite = bool(losses) and all(math.isfinite(x) for x in losses)
    return {"shape": f"d64 L{n_layers} E128 K8 F32", "batch": "16 prompts x 8 completions, 4 minibatches",
            "phases": list(PHASES), "seconds": medians, "measured_steps": len(measured), "losses_finite": finite,
            "ok": finite}


# ---------------------------------------------------------------------------------------------------------------------
# The plan, the report


def plan(sizes: Sizes, device: torch.device, parts: list[str]) -> list[tuple[str, str, Callable[[], dict], float]]:
    """(part, item, function, budget in seconds) in running order."""
    from benchmarks.bench_model import SHAPES

    soft = lambda part: 0.6 * sizes.budget(part)  # noqa: E731
    items = []
    for shape in TRAIN_SHAPES:
        items.append(("train", shape, partial(train_steps, shape, SHAPES[shape][0], sizes.train_batch, sizes.train_seq,
                                              sizes.train_steps, sizes.warmup, device, soft("train"))))
    items.append(("replay", REPLAY_SHAPE, partial(replay_exactness, REPLAY_SHAPE, SHAPES[REPLAY_SHAPE][0],
                                                  sizes.replay_batch, sizes.replay_seq, device)))
    for shape, dims in EXPERT_SHAPES.items():
        items.append(("experts", shape, partial(expert_throughput, shape, *dims, sizes.expert_tokens,
                                                sizes.expert_repeat, device, soft("experts"))))
    nproc = max(1, torch.cuda.device_count()) if device.type == "cuda" else 2
    # torchrun's own limit leaves time to stop it (stop_run) inside the part's budget
    items.append(("fsdp2", f"{nproc} process(es)", partial(fsdp2_step, device.type, nproc, sizes.fsdp2_steps,
                                                          sizes.budget("fsdp2") - 35)))
    items.append(("rl_step", f"L{sizes.rl_layers}", partial(rl_step_phases, sizes.rl_layers, sizes.rl_steps, device,
                                                            soft("rl_step"))))
    if {"hf", "hf_train"} & set(parts):
        from benchmarks.gpu_hf import TRAIN_FAMILY, hf_replay, hf_train
        from moe_rl.model.hf import FAMILIES

        items += [("hf", family, partial(hf_replay, family, device)) for family in FAMILIES]
        items.append(("hf_train", f"{TRAIN_FAMILY} R2", partial(hf_train, device)))
    return [(part, item, fn, sizes.budget(part)) for part, item, fn in items if part in parts]


def run_part(fn: Callable[[], dict], budget: float) -> dict:
    """fn's result, or {"error": ..., "traceback": ...}; with "seconds" it took either way. Frees GPU memory after."""
    t0 = time.perf_counter()
    try:
        with time_limit(budget):
            result = fn()
    except Exception as exc:  # noqa: BLE001 -- every failure is a finding for the report, and the next part runs
        result = {"error": f"{type(exc).__name__}: {exc}"[:2000], "traceback": traceback.format_exc()[-4000:],
                  "ok": False}
    result["part_seconds"] = time.perf_counter() - t0
    gc.collect()
    if torch.cuda.is_available():
        with contextlib.suppress(Exception):  # after a CUDA error this fails too; the next part will say so
            torch.cuda.empty_cache()
    return result


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smaller everything (8 blocks in part 5)")
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS), help="which parts to run")
    parser.add_argument("--out", type=Path, default=Path("results/bench"), help="folder for gpu.md / gpu.json")
    parser.add_argument("--fsdp2-worker", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)  # part 4's ranks
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.fsdp2_worker is not None:
        return fsdp2_worker(args.fsdp2_worker)
    if not torch.cuda.is_available():
        print(NO_CUDA)
        return 0
    # Part 2's deterministic cuBLAS needs this before the first cuBLAS call; 8 x 4 MiB is about the default on Hopper.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    device = torch.device("cuda")
    sizes = QUICK if args.quick else DEFAULT
    command = "python -m benchmarks.gpu_check" + (" --quick" if args.quick else "") + \
        ("" if args.parts == list(PARTS) else " --parts " + " ".join(args.parts))
    report = {"command": command, "sizes": str(sizes), "environment": environment(device), "parts": {}}
    try:
        steps = plan(sizes, device, args.parts)
    except Exception as exc:  # noqa: BLE001
        steps = []
        report["parts"]["train"] = {"plan": {"error": f"{type(exc).__name__}: {exc}", "ok": False}}
    for part, item, _, _ in steps:
        report["parts"].setdefault(part, {})[item] = None
    for part, item, fn, budget in steps:
        print(f"gpu_check: {part} / {item} (budget {budget:g} s) ...", flush=True)
        report["parts"][part][item] = run_part(fn, budget)
        print(f"gpu_check: {part} / {item}: {verdict(report['parts'][part][item])}", flush=True)
        write_report(report, args.out)
    write_report(report, args.out)
    print(markdown(report))
    results = [r for items in report["parts"].values() for r in items.values()]
    return 0 if results and all(r and r.get("ok") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
