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

The task, model width, warm start and RL settings come from `regime()`: the long-completion regime of
experiments/long_regime.py (running sums with worked solutions of about 28 tokens; a warm start of 800 SFT steps on
a noisy demonstrator; 64 prompts x 8 completions per rollout step, 4 minibatches, 10 warmup updates; held-out
reward on 256 prompts every 5 steps; an emulated bf16 sampler). Every (E, K) has the same active expert width
(K x d_expert = 256 at CPU scale), so the cells differ in granularity, not in compute per token.

    moe-rl sweep churn_repro --workers 2                          # CPU: 3 seeds x 2 lr x 3 architectures = 18 runs
    moe-rl sweep churn_repro --arg full=true --workers 2          # 3 seeds x 3 lr x 3 depths x 3 (E, K) = 81 runs
    moe-rl sweep churn_repro --arg paper=true --workers 2         # + 48 MoE blocks, 128 experts, top-8, width 64/32
    moe-rl sweep churn_repro --arg lrs=1e-4,3e-4 layers=4 experts=64/8 seeds=5   # a slice
    moe-rl sweep churn_repro --arg fixed_init=true --workers 2    # every depth with the 4-block residual init scale
    moe-rl sweep churn_repro --arg k_cells=true warm_starts=2 seeds=4 --workers 2   # E and K apart, 2 warm starts
    moe-rl sweep churn_repro --arg scale=gpu --executor slurm --partition gpu --time 120

CPU (default): lr 5e-5 and 1.5e-4 x the L-shaped architecture grid {4 blocks 8/2, 4 blocks 64/8, 8 blocks 64/8}
x 3 seeds = 18 runs of 20 rollout steps (80 updates each), plus 3 warm starts. Why this grid: depth 2 does not
learn here (one seed each at lr 1.5e-4, 20 steps: held-out 0.301 -> 0.297 at 8/2 and 0.332 -> 0.312 at 64/8),
while depths 4 and 8 do (0.398 -> 0.590, 0.383 -> 0.656, 0.375 -> 0.582); the full depth x (E, K) product with
depth 8 did not fit 30 minutes. Timed with --workers 2 on a 2-core machine while another CPU-heavy job ran (so
slower than idle): warm starts 156 s (4 blocks 8/2), 218 s (4 blocks 64/8) and 494 s (8 blocks); runs of 20 steps
107, 168 and 213 s. `make reproduce` measures the whole (results/README.md). The lrs: 5e-5 is the regime's
(objective_comparison: +0.26 held-out in 30 steps); 1.5e-4 still learns (above) and moves the policy about 3x as far
per update; 4e-4 (full=true; and the stress experiment) loses reward. `full=true` (81 runs, 9 warm starts) costs
several times the default. `paper=true` adds 3 seeds x 2 lrs of a 48-block, 128-expert model. Measured on a 2-core
AMD EPYC with AVX2 (2026-12-01, commit e48d762, other jobs sharing the cores): its warm start took 74 min (800 SFT
steps at 4.1-5.0 s); a 10-step run (`--arg layers=48 experts=128/8 steps=10`, what results/churn_paper ran) took
1,757-1,760 s two at a time with other jobs on the cores and 922-937 s two at a time alone. The default grid's runs
took 255-543 s there (8-block runs the longest). `k_cells=true warm_starts=2 seeds=4` (results/churn_law) adds 64/2,
8/4 and 128/8 at 4 blocks and a second warm start for every architecture: 48 runs and 12 warm starts, of which
the first warm start of each old architecture and 10 of its runs are the default grid's (same keys; re-runs were
bit-identical). On the same machine (2026-12-01, commit 3998aea, two to four processes sharing the 2 cores): 4-block
warm starts 250-320 s, the 8-block one 534 s; runs 123-321 s. `fixed_init=true --only model.n_layers=8`: its
8-block warm start and 6 runs of 416-446 s (one 2,290 s, while the K-cells sweep held both cores). GPU (`scale="gpu"`):
64 experts top-8 | 128 experts top-8, depths 12 | 24 | 48, lr 1e-6..1e-4; not yet run. Numbers and their CIs:
results/churn_repro/README.md, made by `make reproduce`.
"""

from __future__ import annotations

from dataclasses import replace

from moe_rl.errors import ConfigError
from moe_rl.experiments.common import wider
from moe_rl.experiments.long_regime import regime_base, regime_warm_start
from moe_rl.rl.run_config import SFTConfig, TrainConfig
from moe_rl.sweep.grid import Experiment, Point, axis, product, union

# Swept values per scale: (default grid, full=true grid).
LRS = {"cpu": ((5e-5, 1.5e-4), (5e-5, 1.5e-4, 4e-4)), "gpu": ((1e-6, 1e-5, 1e-4), (1e-6, 3e-6, 1e-5, 3e-5, 1e-4))}
LAYERS = {"cpu": ((4, 8), (2, 4, 8)), "gpu": ((12, 24, 48), (12, 24, 48))}
EXPERTS = {"cpu": (("8/2", "64/8"), ("8/2", "32/4", "64/8")), "gpu": (("64/8", "128/8"), ("64/8", "128/8"))}
STEPS = {"cpu": 20, "gpu": 100}
# Cells that separate E from K at the default grid's active width: with 8/2 and 64/8, 64/2 moves K alone at E = 64
# (top-8 -> top-2) and E alone at top-2 (8 -> 64); 8/4 moves K alone at E = 8 (top-2 -> top-4); 128/8 moves E alone
# at top-8 (64 -> 128), the paper's (E, K). Not 8/8: with K = E every token uses every expert, so its expert set
# never changes and both readings are 0 by definition (docs/design.md section 5).
K_CELLS = {"cpu": ("64/2", "8/4", "128/8"), "gpu": ("128/2", "64/2")}
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
        if top_k >= experts:
            raise ConfigError(f"experts={entry!r}: top-k must be below the number of experts; with K >= E every "
                              "token uses every expert, so no routing can change")
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
                paper: bool = False, paper_lrs: tuple[float, ...] = (), fixed_init: bool = False,
                k_cells: bool = False, warm_starts: int = 1, d_model: int = 0) -> Experiment:
    """Update churn over lr x architecture x seeds; `experts` entries read "E/K" (e.g. 8/2,64/8), each at the same
    active expert width (see _moe). The architectures are the L-shaped grid of _architectures (every depth at the
    last E/K entry, every E/K entry at the first depth), or every depth x E/K with `full`.

    Empty values take the scale's defaults (LRS, LAYERS, EXPERTS, STEPS), the larger grid with `full`. `paper`
    adds the paper-shaped arm (PAPER_MODEL at `paper_lrs`, default PAPER_LRS) with the same seeds. `fixed_init`
    holds the residual-branch init scale at the shallowest depth's 1/sqrt(2 L) for every depth
    (`model.init_depth`), the arm that separates depth from the init that shrinks with it. `k_cells` adds, at the
    first depth, the cells K_CELLS[scale] that separate E from K at the same active width (E fixed while K moves,
    and K fixed while E moves). `warm_starts` > 1 gives each architecture that many warm starts (run seed s uses
    warm start s mod warm_starts), so that the fit's intervals can resample warm starts. `d_model` (0: the regime's
    64) widens every cell by one factor: the residual stream, the heads, the dense width and the active expert width
    (experiments.common.wider), so each (E, K) keeps its granularity at the new width."""
    if scale not in LRS:
        raise ConfigError(f"scale={scale!r}: use one of {', '.join(LRS)}")
    if seeds < 1:
        raise ConfigError(f"seeds={seeds}: need at least 1 (3 or more for a confidence interval)")
    pick = 1 if full else 0
    base, warm = regime(scale, steps or STEPS[scale])
    if d_model:
        base = replace(base, model=wider(base.model, d_model))
    active_width = base.model.top_k * base.model.d_expert
    moe = _moe(experts or EXPERTS[scale][pick], active_width)
    grid = product(axis("optim.lr", lrs or LRS[scale][pick]), _architectures(layers or LAYERS[scale][pick], moe, full))
    if k_cells:
        separating = product(axis("model.n_layers", (layers or LAYERS[scale][pick])[:1]),
                             _moe(K_CELLS[scale], active_width))
        grid = union(grid, product(axis("optim.lr", lrs or LRS[scale][pick]), separating))
    if paper:
        grid = union(grid, product(axis("optim.lr", paper_lrs or PAPER_LRS[scale]), [PAPER_MODEL]))
    labels = {"model.d_model": "d", "model.d_expert": "dexp", "model.init_depth": "init_depth"}
    if fixed_init:
        shallowest = min(layers or LAYERS[scale][pick])
        grid = [{**point, "model.init_depth": shallowest} for point in grid]
    if warm_starts < 1:
        raise ConfigError(f"warm_starts={warm_starts}: need at least 1")
    return Experiment(base, product(grid, axis("seed", range(seeds))), warmstart=warm, labels=labels,
                      warmstart_seeds=warm_starts)
