"""Named experiments: Python functions that return an `Experiment` (moe_rl.sweep.grid): the config every run starts
from, the grid of runs and the warm start. `moe-rl sweep <name>` runs one; `--arg name=value` passes its arguments.

| name                   | the question it answers                                                 | CPU default      |
|------------------------|-------------------------------------------------------------------------|------------------|
| `smoke`                | does the sweep path work end to end (tests, CI)                         | 4 runs, ~30 s    |
| `churn_repro`          | update churn (both readings) vs lr, depth, experts, top-k, 3 seeds      | 18 runs, 25 min  |
| `objective_comparison` | GRPO / +R2 / +R3 / GSPO / GSPO+R2 where GRPO learns (long completions)   | 25 runs, see doc |
| `stress`               | the same methods at 8x lr and 8 minibatches: who collapses              | 15 runs, see doc |
| `ablations`            | clip range, minibatches, lr, experts, top-k, depth, one at a time       | 14 runs, ~5 min  |
| `correction`           | GRPO / +TIS / +IcePop / R3 / R3+TIS under bf16, fp8 and exact samplers  | 45 runs, see doc |
| `length_generalisation`| does RL beat the best-temperature warm start (7-term sums from 4-6)     | 5 runs, see doc  |
| `stability`            | the stability map: 6 methods x lr and staleness, one axis at a time     | 198 runs, ~5.5 h |
| `engine`               | GRPO / +R3 / +TIS on a real vLLM bf16 engine vs fp32 and its emulation | 15 runs, see doc |

CPU times are with `--workers 2` on a shared 2-core machine.

Each takes `scale="gpu"` for its GPU-sized variant. To add one: write a function in a new module here, give it a
docstring with its question and expected time, and list it in EXPERIMENTS.
"""

from collections.abc import Callable

from moe_rl.errors import ConfigError
from moe_rl.experiments.ablations import ablations
from moe_rl.experiments.churn_repro import churn_repro
from moe_rl.experiments.correction import correction
from moe_rl.experiments.engine import engine
from moe_rl.experiments.length_generalisation import length_generalisation
from moe_rl.experiments.objective_comparison import objective_comparison
from moe_rl.experiments.smoke import smoke
from moe_rl.experiments.stability import stability
from moe_rl.experiments.stress import stress
from moe_rl.sweep.grid import Experiment

EXPERIMENTS = {fn.__name__: fn for fn in (smoke, churn_repro, objective_comparison, ablations, stress, correction,
                                           length_generalisation, stability, engine)}


def get_experiment(name: str) -> Callable[..., Experiment]:
    """The experiment function registered under `name`; an unknown name is refused with the list of known ones."""
    if name not in EXPERIMENTS:
        raise ConfigError(f"unknown experiment {name!r}; available: {', '.join(EXPERIMENTS)}")
    return EXPERIMENTS[name]


__all__ = ["EXPERIMENTS", "get_experiment", "ablations", "churn_repro", "correction", "engine", "length_generalisation",
           "objective_comparison", "smoke", "stability", "stress"]
