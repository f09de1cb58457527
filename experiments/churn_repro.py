"""churn_repro: how many activated experts change per RL update, per layer, as learning rate, depth, number of
experts and top-k vary?

The GSPO paper (arXiv 2507.18071, section 5.3) reports that about 10% of the experts activated for the same rollout
tokens change after each gradient update of a 48-layer MoE (128 experts, top-8), and more in deeper models. Every
run here records, per optimizer step, the policy change (`update/kl`, `update/log_ratio_abs_mean`) and the routing
change (`routing/update/churn`, `routing/update/churn/L{l}`) in metrics.jsonl, so that one sweep gives churn as a
function of lr (find the lr where churn is near 10% per update), of depth (the trend) and of E / K, for the same
size of policy change. GRPO with native routing (the setting the paper measured), warm started per architecture.

    moe-rl sweep churn_repro --workers 2                     # CPU: 5 lr x 3 depths x 2 (E, K) = 30 runs, 25 steps
    moe-rl sweep churn_repro --arg lrs=1e-4,3e-4 layers=4    # a slice
    moe-rl sweep churn_repro --arg scale=gpu --executor slurm --partition gpu --time 120

CPU (default): 30 runs x 25 rollout steps (100 updates each) plus 6 warm starts (300 SFT steps each): 4 min 57 s
with --workers 2 for the committed study (results/churn_repro), 9-10 min on a busier machine. GPU (`scale="gpu"`):
64 experts top-8 | 128 experts top-8, depths 12 | 24 | 48, lr 1e-6..1e-4; not yet run.

What the committed CPU study shows (churn per update, mean over each run's 100 updates, seed 0): 0.09-0.51% at lr
3e-5, 0.15-1.51% at 1e-4, 0.59-3.11% at 3e-4, 2.0-6.9% at 1e-3 and 4.8-13.6% at 3e-3. At every lr it grows with
depth (2 -> 8 blocks) and with experts (8/2 -> 32/4), and the last MoE layer churns several times more than the
first. Churn near 10% per update needs lr 3e-3 (11.1% and 13.6% with 32 experts, 4 and 8 blocks), where the tiny
model collapses (reward -> 0.01-0.03); at the learning rates where RL still works it stays an order of magnitude
below the paper's, which is what the GPU variant is for.
"""

from __future__ import annotations

from moe_rl.sweep.grid import Experiment, axis, product

from experiments.common import rl_base, warm_start

CPU_LRS = (3e-5, 1e-4, 3e-4, 1e-3, 3e-3)
GPU_LRS = (1e-6, 3e-6, 1e-5, 3e-5, 1e-4)


def churn_repro(scale: str = "cpu", steps: int = 25, seeds: int = 1, lrs: tuple[float, ...] = (),
                layers: tuple[int, ...] = (), experts: tuple[str, ...] = ()) -> Experiment:
    """Update churn over lr x depth x (experts, top-k); `experts` entries read "E/K" (e.g. 8/2,32/4).

    Empty tuples take the scale's defaults: cpu lr 3e-5..3e-3, depths 2 | 4 | 8, E/K 8/2 | 32/4; gpu lr 1e-6..1e-4,
    depths 12 | 24 | 48, E/K 64/8 | 128/8."""
    cpu = scale == "cpu"
    base = rl_base(scale, total_steps=steps)
    lrs = lrs or (CPU_LRS if cpu else GPU_LRS)
    layers = layers or ((2, 4, 8) if cpu else (12, 24, 48))
    experts = experts or (("8/2", "32/4") if cpu else ("64/8", "128/8"))
    moe = [{"model.n_experts": int(e), "model.top_k": int(k)} for e, k in (s.split("/") for s in experts)]
    grid = product(axis("optim.lr", lrs), axis("model.n_layers", layers), moe, axis("seed", range(seeds)))
    return Experiment(base, grid, warmstart=warm_start(scale))
