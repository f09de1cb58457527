"""stability: the stability map. Where, as the step size or the staleness grows, does each method stop learning, and
does Routing Replay (R2, R3), GSPO or a rollout correction (TIS, IcePop) move that edge?

Two axes, each with the other held fixed (issue "Science 3", item 3), so that a change in the outcome has one cause:

    learning rate      2.5e-5 .. 1.6e-3, doubling            at 4 minibatches per rollout batch
    staleness          1, 2, 4, 8, 16 minibatches per batch  at lr 2e-4 (m minibatches: m - 1 of m updates are
                                                             off-policy, the last on data m - 1 updates old)

per method: GRPO with native routing, GRPO+R2, GRPO+R3, GSPO, GRPO+TIS (token, cap 2) and GRPO+IcePop (band
[0.5, 2]); the two axes share the cell (2e-4, 4 minibatches). The regime is length_generalisation's (the long-regime
warm start, RL on 7-term running sums, a bf16 sampler so that R3 differs from R2), so that "learns" means more than
sharpening; runs are short (15 rollout steps, evaluations at steps 0, 5, 10 and 15 on 1,024 held-out prompts,
sampled and greedy), since a decline shows early. analysis/stability.py turns the sweep into the map: per cell the
held-out change with its CI, the decline probability and the per-update KL; per method its critical lr and
staleness with CIs; methods compared at matched per-update KL, so that "more stable" cannot mean "takes smaller
steps"; and the figure.

    moe-rl sweep stability --workers 2                               # CPU: 6 methods x 11 cells x 3 seeds
    moe-rl sweep stability --arg axes=lr methods=grpo,grpo+R2        # one axis, two methods
    moe-rl sweep stability --arg n_layers=16                         # the deep arm (its own warm start)
    moe-rl stability sweeps/stability --out results/stability \\
        --baseline sweeps/stability/warmstart/<key>/evaluate
    # one axis at a time into one folder, read together (the shared cell's repeat is dropped):
    moe-rl sweep stability --arg axes=lr --sweep-dir sweeps/stability/lr --workers 2
    moe-rl sweep stability --arg axes=staleness --sweep-dir sweeps/stability/staleness --workers 2
    moe-rl stability sweeps/stability --out results/stability
    moe-rl sweep stability --arg scale=gpu --executor slurm --partition gpu --time 240

CPU, measured (2026-12-01, the learning-rate axis, 2-core AMD EPYC with AVX2, --workers 2, the bf16 sampler's
engine products in fp32 arithmetic, moe_rl/model/precision.py): a 15-step run took 111-367 s, about 3 minutes on
average two at a time (longer while other jobs shared the cores), so the lr axis's 126 runs take about 3.5 hours
and the whole map (198 runs) about 5.5. Run it in several sittings (the sweep resumes), one axis or a few methods
at a time; spend extra seeds near each frontier with `--only` (and `--arg seeds=5` in a sweep folder of its own:
a different grid), as results/stability/PROTOCOL.md did for lr 4e-4.
Second sitting (2026-12-01/02, same machine): 15-step runs took 230-300 s two at a time at lr 1.6e-3.
Third sitting (2026-12-02, the staleness axis at lr 2e-4, a 2-core Intel Xeon VM, kernels off and the ISA capped to
AVX2): 129-256 s per run two at a time, 72 runs in 3.7 core-hours. A warm start rebuilt on another CPU class is
another model (results/stability/PROTOCOL.md, third addendum), so sittings on different CPU classes are analysed
apart. Fourth sitting (2026-12-02, the same Xeon class and caps, seed 2 at 1, 2 and 4 minibatches): 123-220 s per
run two at a time, 18 runs in 0.85 core-hours; the warm start rebuilt there gave the third sitting's numbers.
Fifth sitting (2026-12-03, the same class and caps, the 8-block arm): 7-term 15-step runs of 211-248 s one at a time
beside other work; 8-term runs of 263-575 s (15 steps) and 506-539 s (30 steps) two or three at a time; the
8-block warm start 392 s.
The deep arm with the regime's task (`--arg n_layers=8`) cannot learn: its own warm start scores 0 of 1,024
seven-term prompts at T = 1 and greedy, so every group's rewards are equal and every advantage is 0
(results/README.md, search log, items 4-5). The deep arm is therefore one term further on both sides, the 4-block
regime's lever shifted by one: the warm start trained on 4-7-term sums, RL on 8-term sums (`--arg n_layers=8
terms=8 warm_start_terms=7`; 64 + 8 new tokens). That warm start solves 0.463 of 7-term sums at its best
temperature (no room above it), 0.104 of 8-term sums and none of 9-term sums (search log, items 6-7).

    moe-rl sweep stability --arg axes=lr n_layers=8 terms=8 warm_start_terms=7 --workers 2    # the deep arm
    moe-rl sweep stability --arg axes=lr n_layers=8 terms=8 warm_start_terms=7 d_model=128    # the deep arm, wider
GPU (`scale="gpu"`): the gpu regime with the same grid; not yet run.
"""

from __future__ import annotations

from dataclasses import replace

from moe_rl.errors import ConfigError
from moe_rl.experiments.common import wider
from moe_rl.experiments.correction import ICEPOP, TIS
from moe_rl.experiments.correction import LABELS as CORRECTION_LABELS
from moe_rl.experiments.length_generalisation import MAX_NEW_TOKENS, TERMS, length_generalisation
from moe_rl.sweep.grid import Experiment, product, union

METHODS = {
    "grpo": {"routing_mode": "native"},
    "grpo+R2": {"routing_mode": "R2"},
    "grpo+R3": {"routing_mode": "R3"},
    "gspo": {"objective.name": "gspo", "routing_mode": "native"},
    "grpo+TIS": {"routing_mode": "native", **TIS},
    "grpo+IcePop": {"routing_mode": "native", **ICEPOP},
}
LRS = (2.5e-5, 5e-5, 1e-4, 2e-4, 4e-4, 8e-4, 1.6e-3)
MINIBATCHES = (1, 2, 4, 8, 16)
# Each axis holds the other at these. The staleness axis's lr was 5e-5 until the lr axis had been run: every method
# learns there at 4 minibatches and its frontier lies near 8e-4, so 16 minibatches at 5e-5 (4x the updates per batch)
# could not reach it; at 2e-4, where every method still learns, they can (results/stability/PROTOCOL.md, third
# addendum).
FIXED_LR, FIXED_MINIBATCHES = 2e-4, 4
AXES = ("both", "lr", "staleness")


def stability(scale: str = "cpu", seeds: int = 3, steps: int = 15, axes: str = "both", methods: str = "all",
              n_layers: int = 0, terms: int = 0, warm_start_terms: int = 0, dense_twin: bool = False,
              warm_starts: int = 1, lrs: str = "", d_model: int = 0) -> Experiment:
    """The map's runs: `methods` ("all" or names of METHODS joined by commas) x the cells of `axes` x `seeds`.
    0 keeps the regime's value: `n_layers` its 4 MoE blocks, `terms` its RL problems' length (7 on cpu),
    `warm_start_terms` the longest sums the warm start is trained on (6 on cpu). `dense_twin`: the same map for the
    regime's dense twin (ModelConfig.dense_twin: one always-taken expert of width K x d_expert per MoE layer), from a
    warm start of its own (the sweep trains one per architecture); its routing modes are all native in effect, so
    `methods=grpo,gspo,grpo+TIS,grpo+IcePop` is the useful set. `warm_starts`: warm starts per architecture (SFT
    seeds 0 .. warm_starts - 1); run seed s trains from warm start s mod warm_starts, so seeds nest within warm
    starts, the unit of replication (results/dense_twin/PROTOCOL.md). `lrs`: the lr axis's learning rates joined by
    commas (empty: LRS), e.g. off-grid rates that match another method's step size. `d_model`: the residual width
    (0: the regime's 64), with each expert's width and the head width scaled by the same factor, so the model is the
    regime's shape made wider (issue "Science 6", item 2: the width axis)."""
    chosen = _methods(methods)
    if warm_starts < 1:
        raise ConfigError(f"warm_starts={warm_starts} must be at least 1")
    if axes not in AXES:
        raise ConfigError(f"axes={axes!r} must be one of {', '.join(AXES)}")
    lr_cells = [{"optim.lr": lr, "minibatches": FIXED_MINIBATCHES} for lr in _lrs(lrs)]
    staleness_cells = [{"optim.lr": FIXED_LR, "minibatches": m} for m in MINIBATCHES]
    cells = union(*({"both": (lr_cells, staleness_cells), "lr": (lr_cells,), "staleness": (staleness_cells,)}[axes]))
    regime = length_generalisation(scale, seeds=1, steps=steps, terms=terms and _checked_terms("terms", terms, 2))
    base, warmstart = regime.base, regime.warmstart
    if n_layers:
        base = replace(base, model=replace(base.model, n_layers=n_layers))
    if d_model:
        base = replace(base, model=wider(base.model, d_model))
    if dense_twin:
        base = replace(base, model=base.model.dense_twin())
    if terms:
        base = replace(base, rollout=replace(base.rollout, sampling=replace(
            base.rollout.sampling, max_new_tokens=answer_room(scale, terms))))
    if warm_start_terms:
        warmstart = replace(warmstart, task=replace(warmstart.task, max_terms=_checked_terms(
            "warm_start_terms", warm_start_terms, warmstart.task.min_terms)))
    # Evaluations at 0, 5, 10, 15: a decline is judged over at least three after the start.
    base = replace(base, log=replace(base.log, eval_every=5))
    # Seed first: a sweep stopped part way leaves whole seeds of every cell, the pairs the comparisons need.
    grid = product([{"seed": s} for s in range(seeds)], cells, [METHODS[m] for m in chosen])
    return Experiment(base, grid, warmstart=warmstart, warmstart_own_task=True, labels=CORRECTION_LABELS,
                      warmstart_seeds=warm_starts)


def _lrs(lrs: str) -> tuple[float, ...]:
    if not lrs:
        return LRS
    try:
        values = tuple(float(v) for v in lrs.split(",") if v.strip())
    except ValueError:
        values = ()
    if not values or min(values) <= 0:
        raise ConfigError(f"lrs={lrs!r} must be positive learning rates joined by commas, e.g. 2e-4,4e-4")
    return values


def _checked_terms(name: str, value: int, fewest: int) -> int:
    if value < fewest:
        raise ConfigError(f"{name}={value} must be 0 (the regime's) or at least {fewest}")
    return value


def answer_room(scale: str, terms: int) -> int:
    """New tokens for a `terms`-term worked answer: the regime's room at its own length plus 8 per further term (a
    worked step of one-digit terms takes 6-8 characters)."""
    return MAX_NEW_TOKENS[scale] + 8 * max(terms - TERMS[scale], 0)


def _methods(methods: str) -> list[str]:
    if methods == "all":
        return list(METHODS)
    names = [m.strip() for m in methods.split(",") if m.strip()]
    unknown = [m for m in names if m not in METHODS]
    if unknown or not names:
        raise ConfigError(f"methods={methods!r}: each must be one of {', '.join(METHODS)} (or 'all')")
    return names

