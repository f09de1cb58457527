"""torch.compile (Inductor, CPU) against the C kernels and against plain torch, on the shapes an RL run sees
(one thread).

Three arms, interleaved in one process (benchmarks.timing.interleaved: A B C, C B A, ...), medians of wall and CPU time:
'plain torch' (every kernel family off, what MOE_RL_NATIVE=0 runs), 'C kernels' (the families this machine's
measurement chose, the default) and 'compiled' (torch.compile of the plain-torch model: kernel families off inside it,
Inductor's CPU backend, `dynamic=True`, so that sizes are symbolic from the first compile and a new batch or sequence
length need not recompile; the first call's time is the compile a run pays). Three workloads:
1. forward+backward of the whole model at the three shapes of benchmarks/bench_model.py, over a fixed sequence of
   minibatch shapes (batch and sequence length drawn from a seeded generator around the bench shape, as an RL run's
   minibatches vary with prompt and completion lengths). One timed call is one pass over the sequence;
2. the sampler's decode loop: `moe_rl.rl.rollout.generate` with a KV cache (batch 64, prompt 16, 64 new tokens, every
   sequence full length) at bench_model's SAMPLER_SHAPES. What is compiled is the model's `forward`, which generate
   calls for the prefill and every decode step; the loop and the drawing of tokens stay eager;
3. the paper-shaped RL step (benchmarks/bench_step.py's "paper" shape, `Trainer.rl_step`: GRPO on chain_sum, 16
   prompts x 8 completions, 4 minibatches, default probes), with the trainer's model's `forward` compiled (sampler,
   old pass, updates and probes all call it).

Per workload the table gives each arm's steady-state median, the compiled arm's first-call time less its steady
time (the compile, in CPU seconds of this process and of the C++ compiler Inductor runs), the break-even number of steps
(compile / time saved per step against each other arm), what Dynamo did (frames compiled, recompiles, graph breaks) and
whether the compiled arm's numbers are plain torch's bits (`torch.equal` on logits and gradients; sampled tokens and
log-probs for the sampler).

What it simplifies: random weights and tokens, as bench_model; CPU only. `torch._grouped_mm` (the experts' products
of the plain-torch model) has no CPU meta function for fp32 in this torch, so Dynamo cannot trace it: it is marked
`disallow_in_graph` and runs eagerly between compiled graphs (a graph break), as do the data-dependent steps
(`bincount`, `.item()`, boolean indexing). Compile times depend on Inductor's on-disk cache: the script points it at a
fresh temporary folder for each workload and empties Dynamo's caches between workloads, so each pays the cold compile
a first RL run of that model on a machine pays, and its recompiles are its own.

    python -m benchmarks.bench_compile              # 20 minutes on a 2-core VM loaded by two test suites
    python -m benchmarks.bench_compile --quick      # the smallest shape, fewer repeats, no RL step (about 2 minutes)
    python -m benchmarks.bench_compile --no-step    # skip the RL step
Writes results/bench/<machine>/compile.md and compile.csv (or --out), with the kernel paths taken, the command,
the git commit and the load average at start and end.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import logging
import os
import platform
import random
import subprocess
import tempfile
import time
import warnings
from pathlib import Path

import torch

from benchmarks.bench_model import SAMPLER_SHAPES, SHAPES, native_step, without_kernels
from benchmarks.timing import bench_folder, cpu_class, interleaved, kernels_lines, no_kernels, write_csv
from moe_rl import kernels
from moe_rl.model import ModelConfig, MoETransformer
from moe_rl.rl.rollout import SamplingConfig, generate

ARMS = ("plain torch", "C kernels", "compiled")
RL_STEP_SHAPE = "paper (d64 L48 E128 K8 F32)"


# ---------------------------------------------------------------------------------------------------------------
# Dynamo set-up and bookkeeping


class DynamoEvents(logging.Handler):
    """Counts Dynamo's 'Recompiling function' messages (TORCH_LOGS=recompiles) and keeps the first reason of each."""

    def __init__(self):
        super().__init__()
        self.reasons: list[str] = []

    def emit(self, record):
        message = record.getMessage()
        if message.startswith("Recompiling function"):
            lines = [line.strip() for line in message.splitlines()]
            function = lines[0].split(" in ")[0][len("Recompiling function "):]
            self.reasons.append(f"{function}: {recompile_kind(lines[-1])}")


def recompile_kind(reason: str) -> str:
    """A guard failure in a few words: what changed between the cached graph and this call."""
    for words, kind in (("grad_mode", "grad mode"), ("dispatch key set", "autograd or inference mode of an input"),
                        ("Guard failed on a parameter", "a parameter's shape"), ("<= ", "a size of 0 or 1"),
                        ("size mismatch", "a tensor's size"), ("___check_obj_id", "another object"),
                        ("== ", "a Python value")):
        if words in reason:
            return kind
    return reason[:60]


def set_up_dynamo(cache_dir: str) -> DynamoEvents:
    """Inductor's caches in `cache_dir` (a cold compile) and its compile in this process (no worker pool, whose CPU
    time process_time would miss), the experts' grouped product left eager, recompiles counted."""
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    import torch._dynamo
    import torch._inductor.config

    torch._inductor.config.compile_threads = 1  # compile in this process, so that its CPU time counts the compile
    torch._dynamo.disallow_in_graph(torch._grouped_mm)  # no fp32 CPU meta function: see the module docstring
    torch._dynamo.config.cache_size_limit = 64  # 48 layers share one code object: let every layer's frame compile
    torch._logging.set_logs(recompiles=True)
    events = DynamoEvents()
    recompiles = logging.getLogger("torch._dynamo.guards.__recompiles")
    recompiles.addHandler(events)
    recompiles.propagate = False
    logging.getLogger("torch._dynamo").setLevel(logging.ERROR)  # graph-break warnings: counted instead
    warnings.filterwarnings("ignore", message=".*Dynamo does not know how to trace.*")
    return events


def fresh_compiler(cache_dir: Path) -> None:
    """Each workload compiles cold, as a run of one model would: Dynamo's caches emptied, a new Inductor cache folder
    (otherwise a workload would count as recompiles the guards of another model's shapes, and reuse its kernels)."""
    import torch._dynamo

    torch._dynamo.reset()
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir)


def dynamo_counts() -> dict[str, int]:
    from torch._dynamo.utils import counters

    breaks = counters["graph_break"]
    return {"frames compiled": counters["frames"]["ok"], "graph breaks": sum(breaks.values()),
            "recompile limit hits": sum(n for kind, n in breaks.items() if "recompile limit" in kind.lower())}


@contextlib.contextmanager
def dynamo_delta(events: DynamoEvents, into: dict):
    """Frames compiled, recompiles and graph breaks while the block ran, written into `into`."""
    before, reasons_before = dynamo_counts(), len(events.reasons)
    yield
    after = dynamo_counts()
    into.update({key: after[key] - before[key] for key in after})
    reasons = events.reasons[reasons_before:]
    into["recompiles"] = len(reasons)
    into["recompile reasons"] = ", ".join(f"{reason} ({reasons.count(reason)})" for reason in sorted(set(reasons)))


def compiled_copy(model: MoETransformer) -> MoETransformer:
    """A copy of `model` (same weights) whose forward is torch.compile'd (Inductor, dynamic shapes)."""
    twin = copy.deepcopy(model)
    twin.forward = torch.compile(twin.forward, dynamic=True)
    return twin


def cpu_seconds() -> float:
    """This process's CPU time and that of its finished children (Inductor runs the C++ compiler as one)."""
    t = os.times()
    return time.process_time() + t.children_user + t.children_system


def timed(fn) -> dict[str, float]:
    w0, c0 = time.perf_counter(), cpu_seconds()
    fn()
    return {"wall": time.perf_counter() - w0, "cpu": cpu_seconds() - c0}


# ---------------------------------------------------------------------------------------------------------------
# Workloads


def minibatch_shapes(batch: int, seq_len: int, count: int, seed: int = 0) -> list[tuple[int, int]]:
    """`count` (batch, sequence length) pairs as an RL run's minibatches: batch 1/2 to 1 of `batch`, length 1/2 to 1
    of `seq_len`, from a fixed seed."""
    rng = random.Random(seed)
    return [(rng.choice((batch // 2, 3 * batch // 4, batch)), rng.randint(seq_len // 2, seq_len)) for _ in range(count)]


def fwd_bwd_pass(model, batches: list[torch.Tensor]):
    steps = [native_step(model, ids) for ids in batches]

    def run():
        for step in steps:
            step()
    return run


def logits_and_grads(model, ids) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    out = model(ids)
    (out.logits_BSV.logsumexp(-1).mean() + out.aux_loss).backward()
    return out.logits_BSV.detach(), [p.grad.clone() for p in model.parameters()]


def same_bits_fwd_bwd(plain, compiled, ids) -> dict:
    with no_kernels():
        logits_a, grads_a = logits_and_grads(plain, ids)
        logits_b, grads_b = logits_and_grads(compiled, ids)
    same = torch.equal(logits_a, logits_b) and all(torch.equal(a, b) for a, b in zip(grads_a, grads_b))
    diff = max([(logits_a - logits_b).abs().max().item()]
               + [(a - b).abs().max().item() for a, b in zip(grads_a, grads_b)])
    return {"bit-identical": "yes" if same else "no", "max abs diff": diff}


def three_arms(plain_fn, kernels_fn, compiled_fn, repeat: int, events: DynamoEvents, dynamo: dict) -> dict:
    """First calls (the compiled arm's includes its compile), then `repeat` interleaved calls of each arm."""
    first = {"plain torch": timed(without_kernels(plain_fn)), "C kernels": timed(kernels_fn)}
    with dynamo_delta(events, dynamo):
        first["compiled"] = timed(without_kernels(compiled_fn))
        steady = interleaved({"plain torch": without_kernels(plain_fn), "C kernels": kernels_fn,
                              "compiled": without_kernels(compiled_fn)}, repeat, warmup=0)
    return {arm: {**steady[arm], "first wall": first[arm]["wall"], "first cpu": first[arm]["cpu"]} for arm in ARMS}


def bench_fwd_bwd(name: str, n_batches: int, repeat: int, events: DynamoEvents) -> list[dict]:
    kwargs, batch, seq_len = SHAPES[name]
    cfg = ModelConfig(**kwargs)
    torch.manual_seed(0)
    shapes = minibatch_shapes(batch, seq_len, n_batches)
    batches = [torch.randint(0, cfg.vocab_size, shape) for shape in shapes]
    model = MoETransformer(cfg, kernels=kernels.machine())
    compiled = compiled_copy(model)
    dynamo: dict = {}
    times = three_arms(fwd_bwd_pass(model, batches), fwd_bwd_pass(model, batches), fwd_bwd_pass(compiled, batches),
                       repeat, events, dynamo)
    bits = same_bits_fwd_bwd(model, compiled, batches[0])
    return rows_of("forward+backward", name, " ".join(f"{b}x{s}" for b, s in shapes), n_batches, times, dynamo, bits)


def bench_sampler(name: str, repeat: int, events: DynamoEvents, batch=64, prompt_len=16, new_tokens=64) -> list[dict]:
    cfg = ModelConfig(**SHAPES[name][0])
    torch.manual_seed(0)
    model = MoETransformer(cfg, kernels=kernels.machine()).eval()
    compiled = compiled_copy(model)
    ids = torch.randint(3, cfg.vocab_size, (batch, prompt_len))
    valid = torch.ones_like(ids, dtype=torch.bool)
    sampling = SamplingConfig(max_new_tokens=new_tokens)

    def sample(m):  # EOS id -1 never occurs: every row runs the full length
        return lambda: generate(m, ids, valid, sampling, eos_id=-1, pad_id=0,
                                generator=torch.Generator().manual_seed(0))

    dynamo: dict = {}
    times = three_arms(sample(model), sample(model), sample(compiled), repeat, events, dynamo)
    with no_kernels():
        a, b = sample(model)(), sample(compiled)()
    same = torch.equal(a.tokens_BS, b.tokens_BS) and torch.equal(a.logprobs_BN, b.logprobs_BN)
    tokens = "equal" if torch.equal(a.tokens_BS, b.tokens_BS) else "differ"
    bits = {"bit-identical": "yes" if same else f"no (tokens {tokens})",
            "max abs diff": (a.logprobs_BN - b.logprobs_BN).abs().max().item()}
    return rows_of("sampler decode", name, f"{batch}x({prompt_len}+{new_tokens})", new_tokens, times, dynamo, bits)


def bench_rl_step(steps: int, events: DynamoEvents) -> list[dict]:
    """The paper-shaped `Trainer.rl_step`, three trainers of the same seed (so the same weights and prompts), one per
    arm; the compiled one's model has its forward compiled. Steps taken in turns, as benchmarks/bench_step.py."""
    from benchmarks.bench_step import SHAPES as STEP_SHAPES
    from benchmarks.bench_step import _new_trainer
    from moe_rl.rl.probes import ProbeConfig

    dynamo: dict = {}
    with contextlib.ExitStack() as stack:
        trainers = {arm: _new_trainer(STEP_SHAPES[RL_STEP_SHAPE], ProbeConfig(), steps + 1,
                                      stack.enter_context(tempfile.TemporaryDirectory())) for arm in ARMS}
        trainers["compiled"].model.forward = torch.compile(trainers["compiled"].model.forward, dynamic=True)

        def step(arm):
            def run():
                trainers[arm].rl_step(lambda line: None)
                trainers[arm].step += 1
            return run if arm == "C kernels" else without_kernels(run)

        first = {arm: timed(step(arm)) for arm in ARMS[:2]}
        with dynamo_delta(events, dynamo):
            first["compiled"] = timed(step("compiled"))
            steady = interleaved({arm: step(arm) for arm in ARMS}, steps, warmup=0)
        same = all(torch.equal(a, b) for a, b in zip(trainers["plain torch"].model.parameters(),
                                                      trainers["compiled"].model.parameters()))
    times = {arm: {**steady[arm], "first wall": first[arm]["wall"], "first cpu": first[arm]["cpu"]} for arm in ARMS}
    bits = {"bit-identical": "yes (weights after the steps)" if same else "no (weights after the steps differ)",
            "max abs diff": float("nan")}
    return rows_of("RL step", RL_STEP_SHAPE, "16 prompts x 8, 4 minibatches", 1, times, dynamo, bits)


def rows_of(workload: str, shape: str, tokens: str, steps_per_call: int, times: dict, dynamo: dict, bits: dict):
    """One csv row per arm; the compiled arm's carries the compile, the break-even and Dynamo's counts."""
    compile_cpu = times["compiled"]["first cpu"] - times["compiled"]["cpu"]
    compile_wall = times["compiled"]["first wall"] - times["compiled"]["wall"]
    rows = []
    for arm in ARMS:
        row = {"workload": workload, "shape": shape, "tokens": tokens, "steps per call": steps_per_call, "arm": arm,
               "wall": times[arm]["wall"], "cpu": times[arm]["cpu"], "first wall": times[arm]["first wall"],
               "first cpu": times[arm]["first cpu"]}
        if arm == "compiled":
            row.update({"compile cpu": compile_cpu, "compile wall": compile_wall, **dynamo, **bits})
            for other in ARMS[:2]:
                saved = times[other]["cpu"] - times[arm]["cpu"]  # per call
                row[f"break-even calls vs {other}"] = compile_cpu / saved if saved > 0 else float("inf")
        rows.append(row)
    return rows


# ---------------------------------------------------------------------------------------------------------------
# Report


def git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, check=False).stdout.strip()
        return out.stdout.strip() + (" (with uncommitted changes)" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def cpu_line() -> str:
    info = {}
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            key, _, value = line.partition(":")
            info.setdefault(key.strip(), value.strip())
    flags = info.get("flags", "").split()
    return (f"{info.get('model name', platform.processor())}, family {info.get('cpu family', '?')}, model "
            f"{info.get('model', '?')}, avx512f {'yes' if 'avx512f' in flags else 'no'}")


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds < 10 else f"{seconds:.1f} s"


def cell(pick: dict, arm: str) -> str:
    return f"{ms(pick[arm]['cpu'])} ({ms(pick[arm]['wall'])})"


def steps_text(calls: float, steps_per_call: int) -> str:
    return "never" if calls == float("inf") else f"{calls * steps_per_call:,.0f}"


def markdown(rows: list[dict], command: str, load: dict, commit: str) -> str:
    lines = [
        "# torch.compile against the C kernels and plain torch (CPU, 1 thread)", "",
        f"Command: `{command}`  ", f"Commit: {commit}  ",
        (f"Machine: {platform.machine()}, {cpu_line()}; {torch.get_num_threads()} torch thread, torch "
         f"{torch.__version__}, CPU class {cpu_class()}.  "),
        f"Load average (1, 5, 15 min): at start {load['start']}, at end {load['end']}.", "",
        ("Arms interleaved; medians of CPU (process) time per call, wall in brackets. 'plain torch': every kernel "
        "family off; 'C kernels': the families this machine's measurement chose (below); 'compiled': "
        "torch.compile(model.forward, dynamic=True), Inductor CPU, kernel families off inside it, torch._grouped_mm "
        "left eager. 'compile' is the compiled arm's first call less its steady call (CPU seconds of this process and "
        "of the C++ compiler it runs; a cold Inductor cache); 'break-even' is how many "
        "steps (minibatch forward+backward, decode steps, RL steps) the compile takes to pay back against each arm."),
        "", *kernels_lines(), "",
        ("| workload | shape | tokens per call | plain torch | C kernels | compiled | compiled / C kernels (CPU) "
        "| compile | break-even steps vs plain / vs C | frames compiled | recompiles | graph breaks | bit-identical "
        "to plain torch | max abs diff |"),
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for i in range(0, len(rows), len(ARMS)):
        pick = {r["arm"]: r for r in rows[i:i + len(ARMS)]}
        c = pick["compiled"]
        c_steps = c["steps per call"]
        lines.append(
            f"| {c['workload']} | {c['shape']} | {c['tokens']} | {cell(pick, 'plain torch')} "
            f"| {cell(pick, 'C kernels')} "
            f"| {cell(pick, 'compiled')} | {c['cpu'] / pick['C kernels']['cpu']:.2f}x | {c['compile cpu']:.1f} s "
            f"({c['compile wall']:.1f} s wall) | {steps_text(c['break-even calls vs plain torch'], c_steps)} / "
            f"{steps_text(c['break-even calls vs C kernels'], c_steps)} | {c['frames compiled']} | {c['recompiles']} "
            f"| {c['graph breaks']} | {c['bit-identical']} | {c['max abs diff']:.3g} |")
    reasons = [f"- {r['workload']}, {r['shape']}: {r['recompile reasons']}" for r in rows if r.get("recompile reasons")]
    if reasons:
        lines += ["", "Recompiles by function and what changed (the first failing guard of each), with their counts:",
                  "", *reasons]
    hits = [f"{r['workload']}, {r['shape']}: {r['recompile limit hits']}"
            for r in rows if r.get("recompile limit hits")]
    if hits:
        lines += ["", "Frames that reached Dynamo's recompile limit and run eagerly from then on: " + "; ".join(hits)]
    return "\n".join(lines) + "\n"


def load_average() -> str:
    return ", ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="the smallest shape, fewer repeats, 16 new tokens, no RL step")
    parser.add_argument("--repeat", type=int, default=5, help="interleaved calls per arm (forward+backward, sampler)")
    parser.add_argument("--batches", type=int, default=6, help="minibatch shapes per forward+backward pass")
    parser.add_argument("--steps", type=int, default=2, help="measured RL steps per arm, after one first step each")
    parser.add_argument("--no-step", action="store_true", help="skip the paper-shaped RL step")
    parser.add_argument("--out", type=Path, default=None,
                        help="folder for compile.md / compile.csv (default results/bench/<vendor>_<widest ISA>"
                             "[_capped_<ISA>])")
    args = parser.parse_args()
    torch.set_num_threads(1)
    load = {"start": load_average()}
    commit = git_commit()
    repeat = 3 if args.quick else args.repeat
    command = "python -m benchmarks.bench_compile" + " ".join(
        [""] + (["--quick"] if args.quick else []) + (["--no-step"] if args.no_step else [])
        + [f"--{k} {v}" for k, v, d in (("repeat", args.repeat, 5), ("batches", args.batches, 6),
                                        ("steps", args.steps, 2)) if v != d]
        + ([f"--out {args.out}"] if args.out else []))
    args.out = args.out or Path("results/bench") / bench_folder()
    args.out.mkdir(parents=True, exist_ok=True)
    workloads = [lambda s=shape: bench_fwd_bwd(s, 3 if args.quick else args.batches, repeat, events)
                 for shape in (list(SHAPES)[:1] if args.quick else SHAPES)]
    workloads += [lambda s=shape: bench_sampler(s, repeat, events, new_tokens=16 if args.quick else 64)
                  for shape in (SAMPLER_SHAPES[:1] if args.quick else SAMPLER_SHAPES)]
    if not (args.quick or args.no_step):
        workloads.append(lambda: bench_rl_step(args.steps, events))
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="inductor-") as cache_dir:
        events = set_up_dynamo(cache_dir)
        # the files are rewritten after each: a long run leaves what it measured
        for i, workload in enumerate(workloads):
            fresh_compiler(Path(cache_dir) / str(i))
            rows += workload()
            load["end"] = load_average()
            write_csv(args.out / "compile.csv", rows)
            report = markdown(rows, command, load, commit)
            (args.out / "compile.md").write_text(report)
    print(report)

if __name__ == "__main__":
    main()
