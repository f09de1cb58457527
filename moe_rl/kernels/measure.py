"""The measurement behind selection.py: each kernel family timed against its torch reference at the shapes it serves.

Shapes: the paper's routing shape at a CPU width (704 tokens, a 32-sequence minibatch; 128 experts, top-8, d_model
64, expert width 32) and a small one (8 experts, top-2, expert width 64), with and without autograd where the family
serves both; the sampler's experts by their call at a decode step of both shapes (64 rows), the sampler's attention
by decode loops of two small models (batch 64, prompt 16, 24 new tokens; the decode kernel's cost grows with the
context, so short contexts would flatter it).

Times are this process's CPU seconds (time.process_time, one torch thread), so a loaded machine slows both
contenders alike instead of whichever it preempts. Each contender runs in alternation with the other, several rounds
(three for the long decode loops); a family is used where the geometric mean over its workloads of its median time over
the reference's is at most FASTER_BY, or INEXACT_FASTER_BY for the two that change rounding (one heavy workload does not
outvote the others, and a machine's drift cancels in each ratio), over the workloads the family serves at all (_served).
The families that give the reference's bits are measured first; the sampler's two are then measured with those choices
in force. A family that runs inside another (HOSTS) is timed inside it. About five seconds in all, once per machine.

The measurement leaves no trace in the run: it uses its own random generators inside torch.random.fork_rng (the
global RNG state is restored), with autograd on and outside autocast and inference mode whatever the caller's
context (the first kernel call may come from inside the sampler or a no-grad pass), on fresh tensors.
"""

from __future__ import annotations

import functools
import math
import statistics
import time
from collections.abc import Callable

import torch

ROUNDS = 7
SAMPLER_ROUNDS = 3  # the decode loops are long enough that three alternations settle them
FASTER_BY = 0.97  # a family is used only where its time is at most this share of the reference's
# ... and one that changes the rounding (the fp32 sampler's two) only where it clearly wins, so that a machine whose
# timings sit near the edge does not sample with one kernel after one measurement and the other after the next.
INEXACT_FASTER_BY = 0.85
INEXACT = ("decode_attention", "sampler_experts")
MIN_SAMPLE_S = 0.002  # each timed sample repeats its work until it lasts at least this long


# A family whose code runs only inside another's: the C loop of the expert products is called from MKL's batch path
# (grouped_gemm._expert_products), so it is timed with its host on in both arms, it is measured before its host so
# that the host is timed with it in force, and it is off wherever its host is. (Timed with the host off, both arms
# ran torch's products: on a Zen 4 the loop read 0.89x by noise, MKL alone 1.05x, and the paper-shaped RL step ran
# torch's products in 6.7 s where the two together took 5.2.)
HOSTS = {"exact_products": "mkl_products"}


def measure_all(forced, kernels) -> dict[str, dict]:
    """family -> {"used", "why", "fast_s", "reference_s"}; `forced(**families)` is selection.forced, the context
    that turns families on and off, and `kernels` the kernel set that follows it (registry.KernelSet), which every
    workload hands to the model's functions."""
    chosen: dict[str, dict] = {}
    off = {family: False for family in _PLANS}
    with torch.random.fork_rng(devices=[]), torch.inference_mode(False), torch.enable_grad(), \
            torch.autocast("cpu", enabled=False):
        for family, (is_available, workloads) in _PLANS.items():
            missing = is_available()
            if missing:
                chosen[family] = {"used": False, "why": f"unavailable: {missing}"}
                continue
            others = {**off, **{name: choice["used"] for name, choice in chosen.items()}}
            if family in HOSTS:
                others[HOSTS[family]] = True
            served = [work for work in workloads(kernels) if _served(forced, family, work, others)]
            if not served:
                chosen[family] = {"used": False, "why": "serves none of the measured shapes"}
                continue
            rounds = SAMPLER_ROUNDS if family in INEXACT else ROUNDS
            times = _race(forced, family, served, others, rounds)
            ratio = math.exp(statistics.fmean(math.log(fast / reference) for fast, reference in times))
            threshold = INEXACT_FASTER_BY if family in INEXACT else FASTER_BY
            chosen[family] = {"used": ratio <= threshold, "why": f"measured: {ratio:.2f}x the torch time",
                              "fast_s": [round(fast, 7) for fast, _ in times],
                              "reference_s": [round(reference, 7) for _, reference in times]}
    for family, host in HOSTS.items():
        if chosen.get(family, {}).get("used") and not chosen.get(host, {}).get("used"):
            chosen[family] = {**chosen[family], "used": False,
                              "why": f"{chosen[family]['why']}, but it runs inside {host}, which is off"}
    return chosen


def _served(forced, family: str, work: Callable[[], object], others: dict[str, bool]) -> bool:
    """Whether `work` reaches the family's code at all (for a hosted family, its host's). A workload that every
    implementation declines (NotImplemented: MKL's batch call with autograd below MKL_MIN_EXPERTS_WITH_GRAD experts)
    would time the reference against itself, and its noise would vote: one such workload at 1.46x outvoted the
    others on a Zen 4. A family without registered implementations counts as served everywhere."""
    from moe_rl.kernels.registry import IMPLEMENTATIONS
    from moe_rl.model.replaceable import REPLACEABLE

    owner = HOSTS.get(family, family)
    names = [name for name, of in REPLACEABLE.items() if of == owner and name in IMPLEMENTATIONS]
    if not names:
        return True
    reached: list[bool] = []
    originals = {name: IMPLEMENTATIONS[name] for name in names}

    def recording(fast):
        @functools.wraps(fast)  # keeps its signature: the kernel set hands itself to those that take `kernels`
        def recorded(*args, **kwargs):
            out = fast(*args, **kwargs)
            reached.append(out is not NotImplemented)
            return out
        return recorded

    try:
        IMPLEMENTATIONS.update({name: recording(fast) for name, fast in originals.items()})
        with forced(**{**others, family: True}):
            work()
    finally:
        IMPLEMENTATIONS.update(originals)
    return any(reached)


def _race(forced, family: str, workloads: list[Callable[[], object]], others: dict[str, bool],
          rounds: int = ROUNDS) -> list[tuple[float, float]]:
    """Per workload, the median time with the family on and off (the other families as given)."""
    times = []
    for work in workloads:
        with forced(**{**others, family: True}):
            work()  # warm-up: first-call set-up (plans, caches) is not what is measured
            repeat = max(1, int(MIN_SAMPLE_S / max(_once(work), 1e-7)))
        samples = {True: [], False: []}
        for _ in range(rounds):
            for on in (True, False):
                with forced(**{**others, family: on}):
                    samples[on].append(_once(work, repeat) / repeat)
        times.append((statistics.median(samples[True]), statistics.median(samples[False])))
    return times


def _once(work: Callable[[], object], repeat: int = 1) -> float:
    """CPU seconds of `repeat` calls: this process's time on a core, not the wall clock, so that other jobs sharing
    the machine (a sweep's workers while a run starts) do not decide the choice by when they take the core away.
    (Measured on the 2-core AVX2 machine with two sweep runs on it: by the wall clock exact_products came out at 1.52x
    the reference and was switched off; by CPU time it is faster, as on a quiet machine.)"""
    start = time.process_time()
    for _ in range(repeat):
        work()
    return time.process_time() - start


def _generator(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# --- workloads ----------------------------------------------------------------------------------------------------

PAPER = dict(tokens=704, experts=128, top_k=8, d_model=64, d_expert=32)
SMALL = dict(tokens=512, experts=8, top_k=2, d_model=64, d_expert=64)


def _routing(tokens, experts, top_k, **_):
    scores_TE = torch.randn(tokens, experts, generator=_generator()).softmax(-1)
    return scores_TE, scores_TE.topk(top_k, dim=-1).indices


def _topk_workloads(kernels):
    from moe_rl.model.moe import topk_indices

    work = []
    for shape in (PAPER, SMALL):
        scores_TE, _ = _routing(**shape)
        work.append(lambda s=scores_TE, k=shape["top_k"]: topk_indices(s, k, kernels=kernels))
    return work


def _slots_workloads(kernels):
    from moe_rl.model.moe import sort_slots

    work = []
    for shape in (PAPER, SMALL):
        ids = _routing(**shape)[1]
        work.append(lambda ids=ids, e=shape["experts"]: sort_slots(ids, e, kernels=kernels))
    return work


def _rows_workloads(kernels):
    from moe_rl.model.moe import combine_rows, combine_weighted_rows, expert_rows, sort_slots

    work = []
    for shape in (PAPER, SMALL):
        scores_TE, ids_TK = _routing(**shape)
        weights_TK = scores_TE.gather(-1, ids_TK)
        slots = sort_slots.reference(ids_TK, shape["experts"])
        x_TD = torch.randn(shape["tokens"], shape["d_model"], generator=_generator(1))

        def no_grad(x_TD=x_TD, weights_TK=weights_TK, slots=slots):
            with torch.no_grad():
                rows = expert_rows(x_TD, weights_TK, slots, kernels=kernels)
                combine_rows(rows.x_RD, rows.token_R, x_TD.shape[0], kernels=kernels)
                combine_weighted_rows(rows.x_RD, rows.weight_R, rows.token_R, x_TD.shape[0], kernels=kernels)

        def with_grad(x_TD=x_TD, weights_TK=weights_TK, slots=slots):
            x, weights = x_TD.clone().requires_grad_(), weights_TK.clone().requires_grad_()
            rows = expert_rows(x, weights, slots, kernels=kernels)
            y_RD = rows.x_RD * 2
            (combine_rows(y_RD, rows.token_R, x.shape[0], kernels=kernels)
             + combine_weighted_rows(y_RD, rows.weight_R, rows.token_R, x.shape[0], kernels=kernels)).backward(x_TD)

        work += [no_grad, with_grad]
    return work


def _products_workloads(kernels):
    from moe_rl.model.moe import grouped_mm, sort_slots

    work = []
    for shape in (PAPER, SMALL):
        _, ids_TK = _routing(**shape)
        counts_E = sort_slots.reference(ids_TK, shape["experts"]).counts_E
        N, D, F = ids_TK.numel(), shape["d_model"], shape["d_expert"]
        x_ND = torch.randn(N, D, generator=_generator(2))
        w_EDF = torch.randn(shape["experts"], D, 2 * F, generator=_generator(3))

        def no_grad(x_ND=x_ND, w_EDF=w_EDF, counts_E=counts_E):
            with torch.no_grad():
                grouped_mm(x_ND, w_EDF, counts_E, kernels=kernels)

        grad_NF = torch.randn(N, 2 * F, generator=_generator(4))

        def with_grad(x_ND=x_ND, w_EDF=w_EDF, counts_E=counts_E, grad_NF=grad_NF):
            x, w = x_ND.clone().requires_grad_(), w_EDF.clone().requires_grad_()
            grouped_mm(x, w, counts_E, kernels=kernels).backward(grad_NF)

        work += [no_grad, with_grad]
    return work


def _swiglu_workloads(kernels):
    """The activation of the experts' rows at both shapes (every slot's row: tokens x top-k), without and with
    autograd, as the experts call it there: times the gate weights at the paper shape (expert width < d_model)."""
    from moe_rl.model.moe import swiglu, weighted_swiglu

    work = []
    for shape in (PAPER, SMALL):
        N, F = shape["tokens"] * shape["top_k"], shape["d_expert"]
        gate_up_N2F = torch.randn(N, 2 * F, generator=_generator(9))
        grad_NF = torch.randn(N, F, generator=_generator(10))
        weight_N = torch.rand(N, generator=_generator(14))
        if F < shape["d_model"]:
            def no_grad(gate_up_N2F=gate_up_N2F, weight_N=weight_N):
                weighted_swiglu(gate_up_N2F, weight_N, kernels=kernels)

            def with_grad(gate_up_N2F=gate_up_N2F, weight_N=weight_N, grad_NF=grad_NF):
                weighted_swiglu(gate_up_N2F.clone().requires_grad_(), weight_N.clone().requires_grad_(),
                                kernels=kernels).backward(grad_NF)
        else:
            def no_grad(gate_up_N2F=gate_up_N2F):
                swiglu(gate_up_N2F, kernels=kernels)

            def with_grad(gate_up_N2F=gate_up_N2F, grad_NF=grad_NF):
                swiglu(gate_up_N2F.clone().requires_grad_(), kernels=kernels).backward(grad_NF)

        work += [no_grad, with_grad]
    return work


def _swiglu_missing() -> str | None:
    from moe_rl.kernels.activation import exact_variant

    if _library_missing():
        return _library_missing()
    if torch.get_num_threads() != 1:
        return "it serves one torch thread"
    if exact_variant(PAPER["d_expert"]) is None and exact_variant(SMALL["d_expert"]) is None:
        return "no way of the C pass gives torch's bits at the measured widths with this torch build and CPU"
    return None


def _rotary_workloads(kernels):
    from moe_rl.model.layers import Rotary, apply_rotary

    x_BSHDh = torch.randn(32, 22, 4, 16, generator=_generator(4))
    cos, sin = Rotary(16, 10000.0).cos_sin(torch.arange(22).expand(32, 22))

    def with_grad():
        x = x_BSHDh.clone().requires_grad_()
        apply_rotary(x, cos, sin, kernels=kernels).backward(x_BSHDh)

    return [lambda: apply_rotary(x_BSHDh, cos, sin, kernels=kernels), with_grad]


def _rms_norm_workloads(kernels):
    """A norm's forward+backward over a minibatch's activations at both shapes' width (the family serves autograd
    only)."""
    from moe_rl.model.layers import rms_norm

    work = []
    for shape in (PAPER, SMALL):
        x_TD = torch.randn(shape["tokens"], shape["d_model"], generator=_generator(11))
        weight_D = 1 + 0.1 * torch.randn(shape["d_model"], generator=_generator(12))
        grad_TD = torch.randn(shape["tokens"], shape["d_model"], generator=_generator(13))

        def with_grad(x_TD=x_TD, weight_D=weight_D, grad_TD=grad_TD):
            rms_norm(x_TD.clone().requires_grad_(), weight_D.clone().requires_grad_(), 1e-6,
                     kernels=kernels).backward(grad_TD)

        work.append(with_grad)
    return work


def _sampler_experts_workloads(kernels):
    """The sampler's experts call at a decode step (64 rows, one token each, inference mode), at both shapes.

    Timed alone rather than inside a decode loop: in the loops (below) the attention, router and norms, the same in
    both arms, diluted the kernel's 0.50-0.56x (its call alone) to 0.82-0.88x on a Zen 4, astride INEXACT_FASTER_BY,
    so that one measurement sampled with the kernel and the next without (2026-12-04)."""
    from moe_rl.model.moe import routed_experts, sort_slots

    work = []
    for shape in (PAPER, SMALL):
        shape = {**shape, "tokens": 64}
        scores_TE, ids_TK = _routing(**shape)
        weights_TK = scores_TE.gather(-1, ids_TK)
        weights_TK = weights_TK / weights_TK.sum(-1, keepdim=True)
        slots = sort_slots.reference(ids_TK, shape["experts"])
        E, D, F = shape["experts"], shape["d_model"], shape["d_expert"]
        x_TD = torch.randn(shape["tokens"], D, generator=_generator(6))
        w_gate_up = torch.randn(E, D, 2 * F, generator=_generator(7)) * D**-0.5
        w_down = torch.randn(E, F, D, generator=_generator(8)) * F**-0.5

        def decode_step(x_TD=x_TD, weights_TK=weights_TK, slots=slots, w_gate_up=w_gate_up, w_down=w_down):
            with torch.inference_mode():
                routed_experts(x_TD, weights_TK, slots, w_gate_up, w_down, kernels=kernels)

        work.append(decode_step)
    return work


def _sampler_workloads(kernels):
    """Decode loops as the sampler runs them (inference mode, a KV cache made there, one token per step)."""
    from moe_rl.model import ModelConfig, MoETransformer

    work = []
    for experts, top_k, d_expert in ((PAPER["experts"], PAPER["top_k"], PAPER["d_expert"]), (8, 2, 64)):
        cfg = ModelConfig(vocab_size=99, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64,
                          n_experts=experts, top_k=top_k, d_expert=d_expert)
        torch.manual_seed(0)  # inside fork_rng: the caller's RNG state is restored afterwards
        model = MoETransformer(cfg, kernels=kernels).eval()
        prompts_BP = torch.randint(1, 99, (64, 16), generator=_generator(5))
        work.append(lambda model=model, prompts_BP=prompts_BP: _decode(model, prompts_BP, new_tokens=24))
    return work


def _decode(model, prompts_BP: torch.Tensor, new_tokens: int) -> None:
    with torch.inference_mode():
        cache = model.new_cache(prompts_BP.shape[0], prompts_BP.shape[1] + new_tokens)
        logits_BV = model(prompts_BP, cache=cache).logits_BSV[:, -1]
        for _ in range(new_tokens):
            next_B1 = logits_BV.argmax(-1, keepdim=True)
            logits_BV = model(next_B1, cache=cache).logits_BSV[:, -1]


# --- availability ---------------------------------------------------------------------------------------------------

def _library_missing() -> str | None:
    from moe_rl.kernels.native import library

    return None if library() is not None else "the C kernels are not built"


def _mkl_missing() -> str | None:
    from moe_rl.kernels.grouped_gemm import single_threaded_mkl

    if _library_missing():
        return _library_missing()
    return None if single_threaded_mkl() else "MKL's batched GEMM needs this torch build's MKL and one thread"


def _exact_missing() -> str | None:
    from moe_rl.kernels.grouped_gemm import _FORWARD, c_loop_runs, exact_plan

    if _mkl_missing():
        return _mkl_missing()
    if not c_loop_runs():
        return "the C loop needs AVX-512 or AVX2 with FMA (and a kernel build that has them)"
    if exact_plan(_FORWARD, PAPER["d_model"], 2 * PAPER["d_expert"]) is None:
        return "MKL does not sum as the C loop's one chain at the paper widths on this CPU: no group sizes to serve"
    return None


_PLANS = {  # family: (what is missing, or None; the workloads), in the order they are measured
    "topk": (_library_missing, _topk_workloads),
    "slots": (_library_missing, _slots_workloads),
    "rows": (_library_missing, _rows_workloads),
    "exact_products": (_exact_missing, _products_workloads),  # before its host (HOSTS)
    "mkl_products": (_mkl_missing, _products_workloads),
    "swiglu": (_swiglu_missing, _swiglu_workloads),
    "rotary": (_library_missing, _rotary_workloads),
    "rms_norm": (_library_missing, _rms_norm_workloads),
    "decode_attention": (_library_missing, _sampler_workloads),
    "sampler_experts": (_library_missing, _sampler_experts_workloads),
}
