"""churn_repro: how many activated experts change per RL update, per layer, as learning rate, depth, number of
experts and top-k vary, with seeds, in a regime where RL learns?

The GSPO paper (arXiv 2507.18071, section 5.3) reports that about 10% of the experts activated for the same rollout
tokens change after each gradient update of a 48-layer MoE (128 experts, top-8), and more in deeper models. Every
run here records, per optimizer step, the policy change (`update/kl`) and the routing change in both readings
(docs/design.md section 5): slot churn (`routing/update/churn`, the share of a token's K experts that change),
set change (`routing/update/set_change`, the share of (token, layer) decisions whose top-K set changed) and
`routing/update/token_any`, per layer in the routing tables. One sweep gives churn as a function of lr, depth and
(E, K) for the same size of policy change; `moe-rl report` fits the churn scaling law (analysis/scaling.py) and
tabulates the held-out reward before and after RL per cell, so that "where RL learns" is read off the runs.
GRPO with native routing (the setting the paper measured), warm started per architecture.

The task, model width, warm start and RL settings come from `regime()`: the one place to change when the learning
regime changes (Science 1's long-completion task).

    moe-rl sweep churn_repro --workers 2                          # CPU: 3 seeds x 2 lr x 2 depths x 2 (E, K) = 24 runs
    moe-rl sweep churn_repro --arg full=true --workers 2          # 3 seeds x 3 lr x 3 depths x 3 (E, K) = 81 runs
    moe-rl sweep churn_repro --arg paper=true --workers 2         # + 48 MoE blocks, 128 experts, top-8, width 64/32
    moe-rl sweep churn_repro --arg lrs=1e-4,3e-4 layers=4 experts=64/8 seeds=5   # a slice
    moe-rl sweep churn_repro --arg scale=gpu --executor slurm --partition gpu --time 120

CPU (default): 24 runs x 30 rollout steps (120 updates each) plus 4 warm starts (300 SFT steps each). Measured
on the current regime (chain_sum, the default tiny model) on a 2-core machine shared with five other jobs, with
--workers 2: runs of 4 blocks took 97-165 s each and warm starts 93-130 s (a 4-run, 2-warm-start slice: 399 s),
so the default grid takes about 25 minutes there and less on an idle machine; a longer-completion regime makes
each step slower, so re-time the grid (and lower `steps`) when `regime()` changes, to keep `make reproduce` under
30 minutes. `full=true` (81 runs, 9 warm starts) is about 3-4 times the default. `paper=true` adds 3 seeds x 2
lrs of a 48-block, 128-expert model: about 30 s per rollout step and 3.5 s per SFT step on the same machine (3
steps: 125 s; 10 SFT steps: 46 s), so about an hour for the arm with --workers 2. GPU (`scale="gpu"`): 64 experts
top-8 | 128 experts top-8, depths 12 | 24 | 48, lr 1e-6..1e-4; not yet run. Numbers and their CIs:
results/churn_repro/README.md, made by `make reproduce`.
"""

from __future__ import annotations

from moe_rl.config import SFTConfig, TrainConfig
from moe_rl.errors import ConfigError
from moe_rl.sweep.grid import Experiment, Point, axis, product, union

from experiments.long_regime import regime_base, regime_warm_start

# Swept values per scale: (default grid, full=true grid).
LRS = {"cpu": ((5e-5, 1.5e-4), (5e-5, 1.5e-4, 4e-4)), "gpu": ((1e-6, 1e-5, 1e-4), (1e-6, 3e-6, 1e-5, 3e-5, 1e-4))}
LAYERS = {"cpu": ((4, 8), (2, 4, 8)), "gpu": ((12, 24, 48), (12, 24, 48))}
EXPERTS = {"cpu": (("8/2", "64/8"), ("8/2", "32/4", "64/8")), "gpu": (("64/8", "128/8"), ("64/8", "128/8"))}
STEPS = {"cpu": 20, "gpu": 100}
# The paper-shaped depth arm: the GSPO paper's 48 MoE blocks, 128 experts, top-8, at a width CPUs can train.
PAPER_MODEL = {"model.n_layers": 48, "model.n_experts": 128, "model.top_k": 8, "model.d_model": 64,
               "model.d_expert": 32}
PAPER_LRS = {"cpu": (5e-5, 1.5e-4), "gpu": (1e-5, 1e-4)}


def regime(scale: str, steps: int) -> tuple[TrainConfig, SFTConfig]:
    """The learning regime every cell starts from: the RL run (task, model width, batch, evaluation) and its SFT
    warm start: the long-completion regime of experiments/long_regime.py (running sums with worked solutions, a
    noisy-demonstrator warm start, an emulated bf16 sampler). Change the task or warm start here, in one place."""
    return regime_base(scale, steps=steps), regime_warm_start(scale)


def _moe(entries: tuple[str, ...], active_width: int) -> list[Point]:
    """One point per "E/K" entry, each expert d_expert = active_width // K wide, so every (E, K) has the same
    active expert width per token (K * d_expert) and the cells differ in how finely it is split, as Qwen3-MoE's
    128 narrow experts differ from Mixtral's 8 wide ones, not in compute."""
    points = []
    for entry in entries:
        try:
            experts, top_k = (int(v) for v in entry.split("/"))
        except ValueError:
            raise ConfigError(f"experts={entry!r}: write each entry as E/K, e.g. 8/2,64/8") from None
        if top_k < 1 or active_width % top_k:
            raise ConfigError(f"experts={entry!r}: top-k must divide the active expert width {active_width}")
        points.append({"model.n_experts": experts, "model.top_k": top_k, "model.d_expert": active_width // top_k})
    return points


def _architectures(layers: tuple[int, ...], moe: list[Point], full: bool) -> list[Point]:
    """Every depth x (E, K) with `full`; otherwise an L-shaped grid: every depth at the last (finest) (E, K), and
    every (E, K) at the first depth. The depth arm and the granularity arm share their corner cell, and the grid
    costs the sum of the two arms instead of their product."""
    depths = axis("model.n_layers", layers)
    if full:
        return product(depths, moe)
    return union(product(depths, moe[-1:]), product(depths[:1], moe))


def churn_repro(scale: str = "cpu", steps: int = 0, seeds: int = 3, lrs: tuple[float, ...] = (),
                layers: tuple[int, ...] = (), experts: tuple[str, ...] = (), full: bool = False,
                paper: bool = False, paper_lrs: tuple[float, ...] = ()) -> Experiment:
    """Update churn over lr x architecture x seeds; `experts` entries read "E/K" (e.g. 8/2,64/8), each at the same
    active expert width (see _moe). The architectures are the L-shaped grid of _architectures (every depth at the
    last E/K entry, every E/K entry at the first depth), or every depth x E/K with `full`.

    Empty values take the scale's defaults (LRS, LAYERS, EXPERTS, STEPS), the larger grid with `full`. `paper`
    adds the paper-shaped arm (PAPER_MODEL at `paper_lrs`, default PAPER_LRS) with the same seeds."""
    if scale not in LRS:
        raise ConfigError(f"scale={scale!r}: use one of {', '.join(LRS)}")
    if seeds < 1:
        raise ConfigError(f"seeds={seeds}: need at least 1 (3 or more for a confidence interval)")
    pick = 1 if full else 0
    base, warm = regime(scale, steps or STEPS[scale])
    active_width = base.model.top_k * base.model.d_expert
    moe = _moe(experts or EXPERTS[scale][pick], active_width)
    grid = product(axis("optim.lr", lrs or LRS[scale][pick]), _architectures(layers or LAYERS[scale][pick], moe, full))
    if paper:
        grid = union(grid, product(axis("optim.lr", paper_lrs or PAPER_LRS[scale]), [PAPER_MODEL]))
    labels = {"model.d_model": "d", "model.d_expert": "dexp"}
    return Experiment(base, product(grid, axis("seed", range(seeds))), warmstart=warm, labels=labels)
