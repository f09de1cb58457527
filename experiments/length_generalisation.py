"""length_generalisation: does RL teach the policy something a lower sampling temperature cannot, so that a method
comparison can be read as more than sharpening? GRPO (native routing) on longer running sums than the warm start
saw, judged against the warm start at its best temperature and greedy.

The regime (issue "Science 3", item 1): the long_regime warm start (experiments/long_regime.py: 4 MoE blocks of 64
experts, top-8; 800 SFT steps on 4-6-term running sums from a noisy demonstrator), then RL on 7-term sums with room
for the longer worked answer (64 new tokens). The warm start stops after five worked steps on most 7-term prompts
and writes the sixth only sometimes, so no temperature makes it right (its accuracy there is near 0 at every
temperature) while a group of 8 samples now and then holds a complete answer, which GRPO can reinforce.
Held-out: 1,024 seven-term prompts, sampled at T = 1 and greedy, before RL and every 10 rollout steps.

The criterion a study must meet before it compares methods here: over >= 5 seeds, the final held-out accuracy
beats the warm start's at its best temperature by >= 0.05 with a 95% CI excluding 0, and greedy accuracy rises
(CI excluding 0). The baseline row comes from `moe-rl evaluate` on the warm start with the same task:

    moe-rl sweep length_generalisation --workers 2                       # CPU: 5 seeds, 30 rollout steps
    moe-rl evaluate --checkpoint sweeps/length_generalisation/warmstart/<key> \\
        --set task.min_terms=7 task.max_terms=7 sampling.max_new_tokens=64
    moe-rl report sweeps/length_generalisation --out results/length_generalisation \\
        --baseline sweeps/length_generalisation/warmstart/<key>/evaluate

`--arg terms=8` moves the task (8-9 terms gave no signal in a probe: the warm start scores ~0 there, so every
group's rewards are equal and GRPO's advantages are 0); `--arg methods=all` adds GRPO+R2, GRPO+R3 and GSPO, for the
comparison the regime exists for.

CPU, timed (2026-12-01, 2-core AVX2 machine, --workers 2): the 5 runs took 743-807 s each, two at a time (about 15 s
per rollout step, about 60 s per 1,024-prompt evaluation), after the 800-step warm start (230 s) and the
baseline's `moe-rl evaluate` (about 4 minutes).
GPU (`scale="gpu"`): the gpu regime's warm start (4-8 terms of 1-2 digits) and RL on 10-term problems; not yet run.
"""

from __future__ import annotations

from dataclasses import replace

from moe_rl.errors import check_choice
from moe_rl.experiments.long_regime import regime_base, regime_warm_start
from moe_rl.rl.run_config import LogConfig
from moe_rl.sweep.grid import Experiment, axis, product

METHOD_SETS = {
    "grpo": [{"routing_mode": "native"}],
    "all": [{"routing_mode": "native"}, {"routing_mode": "R2"}, {"routing_mode": "R3"},
            {"objective.name": "gspo", "routing_mode": "native"}],
}
# Per scale: problems longer than the warm start's longest (4-6 terms on cpu, 4-8 on gpu), and room for the answer
# (a 7-term worked answer is up to ~45 characters; 64 leaves room for an 8th step and the EOS).
TERMS = {"cpu": 7, "gpu": 10}
MAX_NEW_TOKENS = {"cpu": 64, "gpu": 160}


def length_generalisation(scale: str = "cpu", seeds: int = 5, steps: int = 0, terms: int = 0,
                          methods: str = "grpo", eval_prompts: int = 1024) -> Experiment:
    """GRPO from the regime's warm start on `terms`-term problems (0: the scale's default, longer than the warm
    start saw), `seeds` seeds (`methods=all`: four methods); `steps` 0 takes the regime's (30 rollout steps on
    cpu)."""
    check_choice("methods", methods, tuple(METHOD_SETS))
    base = regime_base(scale, steps=steps)
    terms = terms or TERMS[scale]
    task = replace(base.task, min_terms=terms, max_terms=terms)
    sampling = replace(base.rollout.sampling, max_new_tokens=MAX_NEW_TOKENS[scale])
    base = replace(base, task=task, rollout=replace(base.rollout, sampling=sampling),
                   log=LogConfig(eval_every=10, eval_prompts=eval_prompts, samples_every=10))
    grid = product(axis("seed", range(seeds)), METHOD_SETS[methods])
    # The warm start keeps its own 4-6-term task: the RL problems are longer than any it was trained on.
    return Experiment(base, grid, warmstart=regime_warm_start(scale), warmstart_own_task=True)
